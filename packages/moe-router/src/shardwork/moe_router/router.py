"""``TopKRouter``: gating linear + top-k routing + token dropping + load-balancing losses.

Legend: S sequence, B batch, T = S*B tokens, H hidden, E experts, K top_k.

- ``forward(hidden_SBH, padding_mask=...) -> (probs_TE, routing_map_TE)``, the same pair
  Megatron-Core's ``TopKRouter`` returns, option for option (see docs/moe-router.md).
- Losses reach backward without changing the layer's outputs: the load-balancing losses
  through one ``AuxLossGradient`` node on the returned probs, the z-loss through
  :func:`attach_aux_loss` on the logits; both scale their gradient by ``loss_scale``.
- Groups, the tracker and the loss scale are constructor arguments: nothing global.
  ``tp_cp_group``: ranks sharing one micro-batch's tokens (sequence-parallel TP × CP);
  ``tp_dp_cp_group``: those plus data parallel (global aux loss).
- ``expert_bias`` and the token counters stay fp32 through ``module.to(bf16)``.
- Fixes against Megatron-Core 0.19.2: expert-bias counting with a padding mask works
  (Megatron broadcasts a [T] mask against [T, E] and fails), position dropping keeps the
  earliest tokens, input jitter and expert-bias counting happen only in training mode, fp64
  router dtype keeps fp64 scores.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.moe_router.aux_loss import (
    AuxLossScale,
    attach_aux_loss,
    switch_aux_loss_from_sums,
    switch_loss_factor,
    z_loss,
)
from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.gating import GatingLinear, StraightThroughRandom
from shardwork.moe_router.routing_dense import dense_softmax, dense_threshold_map, use_dense
from shardwork.moe_router.routing_fn import (
    AuxLossGradient,
    aux_score_sums,
    normalised_scores,
    route_topk,
)
from shardwork.moe_router.scoring import (
    _activate,
    drop_to_capacity,
    score_dtype,
    sinkhorn_routing,
    topk_indices_nonnegative,
)
from shardwork.moe_router.tracker import AuxLossTracker

_FP32_BUFFERS = (
    "expert_bias",
    "local_tokens_per_expert",
    "global_tokens_per_expert",
    "global_aux_steps",
)
_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) a copy of a non-differentiable tensor over ``group``."""
    if group is None or _size(group) == 1:
        return t
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


class TopKRouter(torch.nn.Module):
    """Route each token to K experts; see :class:`RouterConfig` for every option.

    Args:
        config: the router options.
        tp_cp_group: group whose ranks hold the other shards of this micro-batch's tokens
            (sequence-parallel TP × CP); aux-loss token counts are summed over it.
        tp_dp_cp_group: ``tp_cp_group`` plus data parallel; the global aux loss sums over it.
        tracker: optional :class:`AuxLossTracker` receiving loss values and token counts.
        loss_scale: optional :class:`AuxLossScale`; aux-loss gradients are multiplied by it.
        layer_index: this router's row in ``tracker`` (0-based); needed with a tracker.
        generator: torch.Generator for jitter and random routing (default RNG when None).
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        tp_cp_group=None,
        tp_dp_cp_group=None,
        tracker: AuxLossTracker | None = None,
        loss_scale: AuxLossScale | None = None,
        layer_index: int | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, RouterConfig):
            raise ValueError(f"config={config!r} is invalid: pass a RouterConfig")
        if tracker is not None:
            if layer_index is None or not 0 <= layer_index < tracker.num_layers:
                raise ValueError(
                    f"layer_index={layer_index!r} is invalid: with a tracker of num_layers="
                    f"{tracker.num_layers} it must be an integer in [0, {tracker.num_layers})"
                )
            if tracker.num_experts != config.num_experts:
                raise ValueError(
                    f"tracker.num_experts={tracker.num_experts} does not match "
                    f"RouterConfig.num_experts={config.num_experts}"
                )
        self.config = config
        self.tp_cp_group = tp_cp_group
        self.tp_dp_cp_group = tp_dp_cp_group
        self.tracker = tracker
        self.loss_scale = loss_scale
        self.layer_index = layer_index
        self.generator = generator
        E, H = config.num_experts, config.hidden_size
        self.weight = torch.nn.Parameter(torch.empty(E, H, device=device))
        self.bias = torch.nn.Parameter(torch.empty(E, device=device)) if config.add_bias else None
        f32 = {"dtype": torch.float32, "device": device}
        if config.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, **f32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(E, **f32), persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        if config.aux_loss_coeff_for("global_aux_loss") > 0:
            self.register_buffer(
                "global_tokens_per_expert", torch.zeros(E, **f32), persistent=False
            )
            self.register_buffer("global_aux_steps", torch.zeros((), **f32), persistent=False)
        else:
            self.global_tokens_per_expert = None
            self.global_aux_steps = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) gating weight and bias; expert bias and counters to zero."""
        with torch.no_grad():
            self.weight.normal_(0.0, self.config.init_std)
            if self.bias is not None:
                self.bias.normal_(0.0, self.config.init_std)
        self.reset_step_state()
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def reset_step_state(self) -> None:
        """Zero the per-step counters (expert-bias token counts, global aux-loss counts)."""
        for name in ("local_tokens_per_expert", "global_tokens_per_expert", "global_aux_steps"):
            buf = getattr(self, name)
            if buf is not None:
                buf.zero_()

    def _apply(self, fn, recurse=True):
        # Keep expert bias and counters in fp32 through module.to(dtype) / .half() / .bfloat16().
        saved = {n: self._buffers[n] for n in _FP32_BUFFERS if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return self

    # ------------------------------------------------------------------ forward
    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., E] = hidden @ weight^T (+ bias), computed in the router dtype."""
        dtype = _ROUTER_DTYPES.get(self.config.router_dtype, hidden.dtype)
        x = hidden.reshape(-1, hidden.shape[-1])
        logits = GatingLinear.apply(x, self.weight, self.bias, dtype)
        return logits.view(*hidden.shape[:-1], -1)

    def _jitter(self, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.config.input_jitter_eps
        if eps is None or not self.training:
            return hidden
        low = torch.tensor(1.0 - eps, dtype=hidden.dtype, device=hidden.device)
        high = torch.tensor(1.0 + eps, dtype=hidden.dtype, device=hidden.device)
        u = torch.rand(
            hidden.shape, dtype=hidden.dtype, device=hidden.device, generator=self.generator
        )
        return hidden * (low + u * (high - low))

    def forward(
        self, hidden: torch.Tensor, *, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``hidden`` [S, B, H], or [T, H] read as one sequence (S = T, B = 1).

        ``padding_mask`` (bool, shape ``hidden.shape[:-1]``): True marks padding tokens, which
        are left out of every loss and token count (they are still routed).

        Returns ``(probs_TE, routing_map_TE)``: combine weights (zero off the map, dtype of
        the logits) and the bool token→expert map, T = S*B in row-major [S, B] order.
        """
        cfg = self.config
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"hidden shape {tuple(hidden.shape)} is invalid: expected [S, B, H] or [T, H] with "
                f"H = RouterConfig.hidden_size = {cfg.hidden_size}"
            )
        seq_len = hidden.shape[0]
        batch = hidden.shape[1] if hidden.dim() == 3 else 1
        if padding_mask is not None:
            if padding_mask.shape != hidden.shape[:-1]:
                raise ValueError(
                    f"padding_mask shape {tuple(padding_mask.shape)} is invalid: expected "
                    f"{tuple(hidden.shape[:-1])} (hidden without its last dim)"
                )
            padding_mask = padding_mask.reshape(-1).bool()
        logits_TE = self.gating(self._jitter(hidden)).view(-1, cfg.num_experts)
        if cfg.check_finite and not bool(torch.isfinite(logits_TE).all()):
            raise FloatingPointError(
                f"router logits contain NaN or Inf (layer_index={self.layer_index})"
            )
        if cfg.force_load_balancing:
            logits_TE = StraightThroughRandom.apply(logits_TE, self.generator)
        return self.route(logits_TE, seq_len=seq_len, batch=batch, padding_mask=padding_mask)

    def route(
        self,
        logits_TE: torch.Tensor,
        *,
        seq_len: int,
        batch: int,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing from logits (z-loss, selection, dropping, aux losses, expert-bias counts)."""
        cfg = self.config
        training = self.training and torch.is_grad_enabled()
        logits_TE = self._apply_z_loss(logits_TE, padding_mask) if training else logits_TE
        plain_top_TK = top_TK = scores_TE = None
        if cfg.load_balancing_type == "sinkhorn":
            probs_TE, map_TE = sinkhorn_routing(logits_TE, cfg.top_k, training=self.training)
        elif cfg.fused_backend is not None:
            from shardwork.fused_kernels import router_topk  # the [fused] extra

            fused = router_topk(
                logits_TE,
                topk=cfg.top_k,
                score_function=cfg.score_function,
                pre_softmax=cfg.pre_softmax,
                num_groups=cfg.num_groups,
                group_topk=cfg.group_top_k,
                expert_bias=self.expert_bias,
                scaling_factor=cfg.top_k_scaling_factor or None,
                backend=cfg.fused_backend,
            )
            probs_TE, map_TE = fused.probs, fused.routing_map
        else:
            probs_TE, map_TE, top_TK, scores_TE = route_topk(
                logits_TE,
                cfg.top_k,
                score_function=cfg.score_function,
                pre_softmax=cfg.pre_softmax,
                num_groups=cfg.num_groups,
                group_top_k=cfg.group_top_k,
                scaling_factor=cfg.top_k_scaling_factor,
                expert_bias=self.expert_bias,
            )
            if cfg.group_top_k is None and self.expert_bias is None:
                # a plain top-K of a monotone score: reusable by the aux losses
                # (few experts: the bool map, counted in one dense sum; else the K indices)
                plain_top_TK = top_TK if top_TK is not None and cfg.num_experts > 32 else map_TE
        if cfg.capacity_factor is not None:
            top_TK = None  # the map below may lose entries: count from it
            probs_TE, map_TE = drop_to_capacity(
                probs_TE,
                map_TE,
                top_k=cfg.top_k,
                capacity_factor=cfg.capacity_factor,
                drop_policy=cfg.token_drop_policy,
                pad_to_capacity=cfg.pad_to_capacity,
            )
        if training and cfg.aux_loss_enabled:
            probs_TE = self._apply_aux_losses(
                probs_TE, logits_TE, seq_len, batch, padding_mask, plain_top_TK, scores_TE
            )
        if self.training and (self.local_tokens_per_expert is not None or self.tracker is not None):
            grad_enabled = torch.is_grad_enabled()  # False under recompute-free eval passes
            with torch.no_grad():
                if top_TK is not None:  # K indices per token: cheaper than a dense [T, E] sum
                    valid = None if padding_mask is None else ~padding_mask
                    counts_E = _index_counts(top_TK, cfg.num_experts, 1, valid)
                else:
                    counted = (
                        map_TE if padding_mask is None else map_TE & ~padding_mask.unsqueeze(-1)
                    )
                    counts_E = counted.sum(dim=0)
                if self.local_tokens_per_expert is not None and grad_enabled:
                    self.local_tokens_per_expert += counts_E
                if self.tracker is not None:
                    self.tracker.record_tokens(self.layer_index, counts_E)
        return probs_TE, map_TE

    # ------------------------------------------------------------------ losses
    def _attach(self, x: torch.Tensor, loss: torch.Tensor, num_tokens) -> torch.Tensor:
        if self.config.calculate_per_token_loss:
            loss = loss * num_tokens * _size(self.tp_cp_group)
        return attach_aux_loss(x, loss, self.loss_scale)

    def _record(self, name: str, loss: torch.Tensor, coeff: float) -> None:
        if self.tracker is not None:  # the division only when someone logs it
            self.tracker.record_loss(name, self.layer_index, loss / coeff)

    def _apply_z_loss(self, logits_TE, padding_mask):
        coeff = self.config.z_loss_coeff
        if coeff is None:
            return logits_TE
        coeff = coeff / _size(self.tp_cp_group)
        loss = z_loss(logits_TE, coeff, padding_mask)
        n = logits_TE.shape[0] if padding_mask is None else (~padding_mask).sum()
        logits_TE = self._attach(logits_TE, loss, n)
        if coeff > 0:
            self._record("z_loss", loss, coeff)
        return logits_TE

    def _counts(self, local_E, num_rows: int, group, divisor: int, padded: bool):
        """(reduced tokens_per_expert, local token count, total token count)."""
        total_E = _summed(local_E, group)
        if padded:
            return total_E, local_E.sum() / divisor, total_E.sum() / divisor
        return total_E, num_rows, num_rows * _size(group)

    def _apply_aux_losses(
        self, probs_TE, logits_TE, seq_len, batch, padding_mask, plain_top_TK, scores_TE
    ):
        cfg = self.config
        E, K = cfg.num_experts, cfg.top_k
        padded = padding_mask is not None
        fn = cfg.score_function
        if scores_TE is None:  # post-softmax, fused or sinkhorn routing: dense scores, no grad
            with torch.no_grad():
                if fn == "softmax":
                    scores_TE = dense_softmax(logits_TE, score_dtype(logits_TE))
                else:
                    scores_TE = _activate(logits_TE, fn)
        # The map the losses count: a plain top-K of the scores (no groups, no expert bias),
        # as K indices per token or (dense path) a bool map.
        top_TK = plain_top_TK
        if top_TK is None and use_dense(scores_TE, K, None):
            top_TK = dense_threshold_map(scores_TE, K)
        if top_TK is None:
            top_TK = topk_indices_nonnegative(scores_TE, K)
        valid = None if not padded else ~padding_mask
        if top_TK.dtype == torch.bool:
            counted = top_TK if valid is None else top_TK & valid.unsqueeze(-1)
            counts_BE = counted.view(seq_len, batch, E).sum(dim=0)
        else:
            counts_BE = _index_counts(top_TK, E, batch, valid).view(batch, E)
        counts_E = None  # whole micro-batch counts, for the aux and global losses
        if cfg.aux_loss_coeff_for("aux_loss") > 0 or cfg.aux_loss_coeff_for("global_aux_loss") > 0:
            counts_E = counts_BE.sum(dim=0) if batch > 1 else counts_BE[0]
        num_tokens = logits_TE.shape[0]
        # Each loss is L = c * sum(sums * tpe) with sums = aux_score_sums(...): collect
        # dL/dsums per loss ([1, E] or [B, E]) and inject them all in one autograd node. The
        # sums themselves are computed only for the tracker's loss values.
        normalised = normalised_scores(scores_TE, fn)
        sums_BE = None
        if self.tracker is not None:
            sums_BE = aux_score_sums(normalised[0], batch, valid)
        terms = []  # dL/dsums of each loss, [1, E] or [B, E]
        work = scores_TE.dtype

        coeff = cfg.aux_loss_coeff_for("aux_loss")
        if coeff > 0:
            tpe, n_local, n_total = self._counts(counts_E, num_tokens, self.tp_cp_group, K, padded)
            whole = None if sums_BE is None else sums_BE.sum(dim=0)
            terms.append(
                self._switch_term("load_balancing_loss", coeff, tpe, n_local, n_total, whole, work)
            )

        coeff = cfg.aux_loss_coeff_for("seq_aux_loss")
        if coeff > 0:
            # Fold the batch into the expert axis: column b*E + i is expert i of sequence b.
            tpe, n_local, n_total = self._counts(
                counts_BE.reshape(-1), seq_len, self.tp_cp_group, K * batch, padded
            )
            folded = None if sums_BE is None else sums_BE.reshape(-1)
            terms.append(
                self._switch_term(
                    "seq_load_balancing_loss",
                    coeff,
                    tpe,
                    n_local,
                    n_total,
                    folded,
                    work,
                    batch=batch,
                )
            )

        coeff = cfg.aux_loss_coeff_for("global_aux_loss")
        if coeff > 0:
            tpe, n_local, n_total = self._counts(
                counts_E, num_tokens, self.tp_dp_cp_group, K, padded
            )
            with torch.no_grad():
                self.global_tokens_per_expert += tpe
                self.global_aux_steps += 1
            mean_tpe = self.global_tokens_per_expert / self.global_aux_steps
            whole = None if sums_BE is None else sums_BE.sum(dim=0)
            terms.append(
                self._switch_term(
                    "global_load_balancing_loss",
                    coeff,
                    mean_tpe,
                    n_local,
                    n_total,
                    whole,
                    work,
                )
            )

        if not terms or not logits_TE.requires_grad:
            return probs_TE
        dloss_BE = terms[0]
        for term in terms[1:]:
            dloss_BE = dloss_BE + term
        return AuxLossGradient.apply(
            probs_TE, logits_TE, scores_TE, normalised, dloss_BE, fn, batch, valid, self.loss_scale
        )

    def _switch_term(self, name, coeff, tpe, n_local, n_total, sums, dtype, *, batch: int = 1):
        """dL/dsums of one Switch-style loss L = c * sum(sums * tpe), shaped [batch, E] in
        ``dtype`` (the scores'; integer counts times a Python float would give fp32).
        ``batch`` > 1: the seq aux loss, a mean over the B sequences folded into the expert
        axis. Records L's value when the tracker's ``sums`` were computed."""
        E, K = self.config.num_experts, self.config.top_k
        formula = dict(num_experts=E, top_k=K, coeff=coeff, total_num_tokens=n_total)
        factor = switch_loss_factor(**formula) / batch
        dloss = tpe.to(dtype).view(batch, E)
        if sums is not None:
            loss = switch_aux_loss_from_sums(sums, tpe, **formula) / batch
            self._record(name, loss, coeff)
        return dloss * self._per_token(factor, n_local * batch)

    def _per_token(self, factor, num_tokens):
        """``factor`` times num_tokens * |TP×CP| with ``calculate_per_token_loss`` (the loss is
        then summed per token; the trainer divides by the global token count)."""
        if self.config.calculate_per_token_loss:
            return factor * num_tokens * _size(self.tp_cp_group)
        return factor


def _index_counts(top_TK, num_experts: int, batch: int, valid_T) -> torch.Tensor:
    """Per-sequence token counts [batch * E] (int64) from the K chosen indices per token.

    Column b*E + i counts tokens of sequence b (token t = s*batch + b) routed to expert i;
    padding tokens (``valid_T`` False) are not counted. Equals the column sums of the
    [S, batch*E] reshaped routing map, without building it.
    """
    T, K = top_TK.shape
    flat = top_TK
    if batch > 1:
        seq_of = torch.arange(T, device=top_TK.device) % batch
        flat = top_TK + (seq_of * num_experts).unsqueeze(-1)
    if valid_T is None:
        ones = torch.ones((), dtype=torch.int64, device=top_TK.device).expand(T * K)
    else:
        ones = valid_T.to(torch.int64).unsqueeze(-1).expand(T, K).reshape(-1)
    counts = torch.zeros(batch * num_experts, dtype=torch.int64, device=top_TK.device)
    return counts.scatter_add_(0, flat.reshape(-1), ones)


@torch.no_grad()
def update_expert_bias(routers, *, group=None) -> None:
    """Aux-loss-free balancing step (DeepSeek-V3), once per global batch, after backward.

    For every router with an expert bias, in training mode: sum its token counts over
    ``group`` (the ranks that saw different tokens of this step: TP×CP×DP), then
    ``bias += rate * sign(mean_i(c_i) - c)`` and zero the counts. All routers' counts travel in
    one all-reduce; every rank of ``group`` must call this with the same routers.
    """
    active = [r for r in routers if r.expert_bias is not None and r.training]
    if not active:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in active])
    if group is not None and _size(group) > 1:
        dist.all_reduce(counts, group=group)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    for r, off in zip(active, offset):
        r.expert_bias += torch.sign(off) * r.config.expert_bias_update_rate
        r.local_tokens_per_expert.zero_()
