"""``TopKRouter``: gating linear + top-k routing + token dropping + load-balancing losses.

Legend: S sequence, B batch, T = S*B tokens, H hidden, E experts, K top_k.

- ``forward(hidden_SBH, padding_mask=...) -> (probs_TE, routing_map_TE)``, the same pair
  Megatron-Core's ``TopKRouter`` returns, option for option (see docs/moe-router.md).
- Losses reach backward without changing the layer's outputs: the load-balancing losses
  through one ``AuxLossGradient`` node on the returned probs, the z-loss through
  :func:`attach_aux_loss` on the logits; both scale their gradient by ``loss_scale``.
  ``route`` is the sequence: z-loss, selection, dropping, load-balancing losses
  (:mod:`.router_losses`), expert-bias token counts (:mod:`.counts`); the bias itself moves
  once per step in :func:`update_expert_bias`, outside the forward. Quantile balancing
  (:mod:`.quantile_balancing`) selects on the logits minus ``qb_beta`` and accumulates the
  quantile its step update (:func:`update_quantile_balancing`) consumes.
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

from shardwork.moe_router.aux_loss import AuxLossScale
from shardwork.moe_router.checks import check_tensor, is_int
from shardwork.moe_router.comm import group_size
from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.counts import routed_token_counts
from shardwork.moe_router.gating import GatingLinear, StraightThroughRandom
from shardwork.moe_router.quantile_balancing import quantile_balanced_topk
from shardwork.moe_router.replay import RouterReplay, check_replay_supported, indices_from_map
from shardwork.moe_router.router_losses import LossSite, apply_load_balancing, apply_z_loss
from shardwork.moe_router.routing_fn import route_topk
from shardwork.moe_router.scoring import drop_to_capacity, sinkhorn_routing
from shardwork.moe_router.tracker import AuxLossTracker

_FP32_BUFFERS = (
    "expert_bias",
    "local_tokens_per_expert",
    "global_tokens_per_expert",
    "global_aux_steps",
    "qb_beta",
    "qb_beta_accum",
)
_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


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
        replay: optional :class:`RouterReplay` recording or replaying this router's top-k
            choices under the key ``layer_index`` (needs it); not with sinkhorn or the fused
            path. An attribute: callers may set or swap it between forwards.
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
        replay: RouterReplay | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, RouterConfig):
            raise ValueError(f"config={config!r} is invalid: pass a RouterConfig")
        if replay is not None:
            check_replay_supported(config, layer_index)
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
        self.replay = replay
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
        if config.load_balancing_type == "quantile_balancing":
            # qb_beta is state (saved); the accumulators live for one step.
            self.register_buffer("qb_beta", torch.zeros(E, **f32))
            self.register_buffer("qb_beta_accum", torch.zeros(E, **f32), persistent=False)
            self.register_buffer(
                "qb_beta_count", torch.zeros((), dtype=torch.int64, device=device), persistent=False
            )
        else:
            self.qb_beta = self.qb_beta_accum = self.qb_beta_count = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) gating weight and bias; expert bias, ``qb_beta`` and counters to
        zero."""
        with torch.no_grad():
            self.weight.normal_(0.0, self.config.init_std)
            if self.bias is not None:
                self.bias.normal_(0.0, self.config.init_std)
        self.reset_step_state()
        for name in ("expert_bias", "qb_beta"):
            buf = getattr(self, name)
            if buf is not None:
                buf.zero_()

    def reset_step_state(self) -> None:
        """Zero the per-step counters (expert-bias token counts, global aux-loss counts,
        quantile-balancing accumulators)."""
        for name in (
            "local_tokens_per_expert",
            "global_tokens_per_expert",
            "global_aux_steps",
            "qb_beta_accum",
            "qb_beta_count",
        ):
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
        are left out of every loss and token count (they are still routed). Not with quantile
        balancing, whose balanced count T·K/E assumes every token is real.

        Returns ``(probs_TE, routing_map_TE)``: combine weights (zero off the map, dtype of
        the logits) and the bool token→expert map, T = S*B in row-major [S, B] order.
        """
        cfg = self.config
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"hidden shape {tuple(hidden.shape)} is invalid: expected [S, B, H] or [T, H] with "
                f"H = RouterConfig.hidden_size = {cfg.hidden_size}"
            )
        if not hidden.is_floating_point():
            raise TypeError(
                f"hidden of dtype {hidden.dtype} is invalid: it must be floating point (token "
                "vectors, not token ids)"
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
        logits_TE = self.logits(hidden).view(-1, cfg.num_experts)
        return self.route(logits_TE, seq_len=seq_len, batch=batch, padding_mask=padding_mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Router logits [..., E] of ``hidden`` [..., H], any leading shape: input jitter
        (training), the gate GEMM in the router dtype, the finite check, random logits
        (``force_load_balancing``). ``forward`` is this followed by :meth:`route`; callers
        whose tokens are not in [S, B] order reorder the logits in between."""
        cfg = self.config
        logits = self.gating(self._jitter(hidden))
        if cfg.check_finite and not bool(torch.isfinite(logits).all()):
            raise FloatingPointError(
                f"router logits contain NaN or Inf (layer_index={self.layer_index})"
            )
        if cfg.force_load_balancing:
            logits = StraightThroughRandom.apply(logits, self.generator)
        return logits

    def route(
        self,
        logits_TE: torch.Tensor,
        *,
        seq_len: int,
        batch: int,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing from logits (z-loss, selection, dropping, aux losses, expert-bias counts).

        ``logits_TE`` [T, E] floating, T = ``seq_len * batch`` tokens in row-major [S, B]
        order (the sequence aux loss reads sequences from it); ``padding_mask`` a bool [T].
        Shapes are checked first (ValueError / TypeError).
        """
        cfg = self.config
        self._check_route_args(logits_TE, seq_len, batch, padding_mask)
        if padding_mask is not None and cfg.load_balancing_type == "quantile_balancing":
            raise ValueError(
                "padding_mask is invalid with RouterConfig.load_balancing_type="
                "'quantile_balancing': its quantile assumes every token is real; pass None"
            )
        training = self.training and torch.is_grad_enabled()
        site = self._loss_site()
        logits_TE = apply_z_loss(site, logits_TE, padding_mask) if training else logits_TE
        probs_TE, map_TE, top_TK, scores_TE, plain_top_TK = self._select(logits_TE)
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
            probs_TE = apply_load_balancing(
                site,
                probs_TE,
                logits_TE,
                seq_len=seq_len,
                batch=batch,
                padding_mask=padding_mask,
                plain_top_TK=plain_top_TK,
                scores_TE=scores_TE,
            )
        self._count_routed_tokens(top_TK, map_TE, padding_mask)
        return probs_TE, map_TE

    def _check_route_args(self, logits_TE, seq_len, batch, padding_mask) -> None:
        """``route``'s inputs must describe ``seq_len * batch`` tokens of this router's E."""
        for name, value in (("seq_len", seq_len), ("batch", batch)):
            if not is_int(value) or value < 0:
                raise ValueError(
                    f"TopKRouter.route: {name}={value!r} is invalid: it must be an integer >= 0"
                )
        check_tensor("TopKRouter.route: ", "logits_TE", logits_TE)
        expected = (seq_len * batch, self.config.num_experts)
        if logits_TE.shape != expected:
            raise ValueError(
                f"TopKRouter.route: logits_TE of shape {tuple(logits_TE.shape)} is invalid: "
                f"expected (seq_len * batch, num_experts) = {expected} for seq_len={seq_len}, "
                f"batch={batch}, RouterConfig.num_experts={self.config.num_experts}"
            )
        if not logits_TE.is_floating_point():
            raise TypeError(
                f"TopKRouter.route: logits_TE of dtype {logits_TE.dtype} is invalid: it must be "
                "floating point"
            )
        if padding_mask is None:
            return
        check_tensor("TopKRouter.route: ", "padding_mask", padding_mask)
        if padding_mask.shape != expected[:1] or padding_mask.dtype != torch.bool:
            raise ValueError(
                f"TopKRouter.route: padding_mask of shape {tuple(padding_mask.shape)} and dtype "
                f"{padding_mask.dtype} is invalid: expected a bool tensor of shape {expected[:1]}"
            )

    def _select(self, logits_TE: torch.Tensor) -> tuple:
        """(probs_TE, map_TE, top_TK, scores_TE, plain_top_TK) of the configured selection.

        ``top_TK``: the K indices per token when the routing produced them; ``scores_TE``: the
        dense scores when it computed them; ``plain_top_TK``: a plain top-K of a monotone
        score (no groups, no expert bias) that the aux losses can reuse, else None.
        """
        cfg = self.config
        replay_mode = None if self.replay is None else self.replay.mode
        if replay_mode is not None:  # the attribute may have been set after construction
            check_replay_supported(cfg, self.layer_index)
        forced_TK = None
        if replay_mode == "replay":  # the recorded experts; probs from these logits
            forced_TK = self.replay.take(
                self.layer_index, logits_TE.shape[0], cfg.top_k, cfg.num_experts
            ).to(logits_TE.device)
        elif cfg.load_balancing_type == "quantile_balancing":
            forced_TK = self._quantile_balanced_choice(logits_TE)
        elif cfg.load_balancing_type == "sinkhorn":
            probs_TE, map_TE = sinkhorn_routing(logits_TE, cfg.top_k, training=self.training)
            return probs_TE, map_TE, None, None, None
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
            return fused.probs, fused.routing_map, None, None, None
        probs_TE, map_TE, top_TK, scores_TE = route_topk(
            logits_TE,
            cfg.top_k,
            score_function=cfg.score_function,
            pre_softmax=cfg.pre_softmax,
            num_groups=cfg.num_groups,
            group_top_k=cfg.group_top_k,
            group_score_top_n=cfg.group_score_top_n,
            scaling_factor=cfg.top_k_scaling_factor,
            expert_bias=self.expert_bias,
            replay_top_TK=forced_TK,
        )
        if forced_TK is not None:
            return probs_TE, map_TE, top_TK, scores_TE, None
        if replay_mode == "record":
            recorded = top_TK if top_TK is not None else indices_from_map(map_TE, cfg.top_k)
            self.replay.put(self.layer_index, recorded)
        plain_top_TK = None
        if cfg.group_top_k is None and self.expert_bias is None:
            # a plain top-K of a monotone score: reusable by the aux losses
            # (few experts: the bool map, counted in one dense sum; else the K indices)
            plain_top_TK = top_TK if top_TK is not None and cfg.num_experts > 32 else map_TE
        return probs_TE, map_TE, top_TK, scores_TE, plain_top_TK

    def _quantile_balanced_choice(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The K experts per token of quantile balancing; in a training forward with autograd
        on (not in a recompute that hid the accumulators), also accumulate the quantile."""
        accumulate = self.training and torch.is_grad_enabled() and self.qb_beta_accum is not None
        top_TK, quantile_E = quantile_balanced_topk(
            logits_TE,
            self.config.top_k,
            self.qb_beta,
            want_quantile=accumulate,
            token_group=self.tp_cp_group,
        )
        if accumulate:
            self.qb_beta_accum += quantile_E
            self.qb_beta_count += 1
        return top_TK

    def _loss_site(self) -> LossSite:
        """Where this call's losses go, read from the attributes now (callers may swap the
        tracker and the global aux-loss counters between calls)."""
        return LossSite(
            config=self.config,
            tp_cp_group=self.tp_cp_group,
            tp_dp_cp_group=self.tp_dp_cp_group,
            tracker=self.tracker,
            layer_index=self.layer_index,
            loss_scale=self.loss_scale,
            global_tokens_per_expert=self.global_tokens_per_expert,
            global_aux_steps=self.global_aux_steps,
        )

    def _count_routed_tokens(self, top_TK, map_TE, padding_mask) -> None:
        """Add the routed tokens to the expert-bias counters (consumed by
        :func:`update_expert_bias`) and report them to the tracker; training mode only."""
        if not self.training or (self.local_tokens_per_expert is None and self.tracker is None):
            return
        grad_enabled = torch.is_grad_enabled()  # False under recompute-free eval passes
        with torch.no_grad():
            counts_E = routed_token_counts(top_TK, map_TE, self.config.num_experts, padding_mask)
            if self.local_tokens_per_expert is not None and grad_enabled:
                self.local_tokens_per_expert += counts_E
            if self.tracker is not None:
                self.tracker.record_tokens(self.layer_index, counts_E)


@torch.no_grad()
def update_expert_bias(routers, *, group=None) -> None:
    """Aux-loss-free balancing step (DeepSeek-V3), once per global batch, after backward.

    For every router with an expert bias, in training mode: sum its token counts over
    ``group`` (the ranks that saw different tokens of this step: TP×CP×DP), then
    ``bias += rate * sign(mean_i(c_i) - c)`` and zero the counts. All routers' counts travel in
    one all-reduce; every rank of ``group`` must call this with the same routers.
    ``routers``: an iterable of :class:`TopKRouter` (TypeError otherwise, before the
    all-reduce).
    """
    routers = list(routers)
    for i, r in enumerate(routers):
        if not isinstance(r, TopKRouter):
            raise TypeError(
                f"update_expert_bias: routers[{i}]={r!r} is invalid: every entry must be a "
                f"TopKRouter (got {type(r).__name__})"
            )
    active = [r for r in routers if r.expert_bias is not None and r.training]
    if not active:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in active])
    if group_size(group) > 1:
        dist.all_reduce(counts, group=group)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    for r, off in zip(active, offset):
        r.expert_bias += torch.sign(off) * r.config.expert_bias_update_rate
        r.local_tokens_per_expert.zero_()
