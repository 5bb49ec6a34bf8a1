"""Multi-token prediction (DeepSeek-V3 MTP): extra depths that predict tokens further ahead.

Depth ``k`` (1..D) at position ``i`` combines the previous depth's hidden state ``h`` (depth 0:
the main model's output after its final norm) with the embedding of token ``i+k``::

    h_k = layer_k(eh_proj_k([enorm_k(emb(t_{i+k})) ; hnorm_k(h_{k-1})]))
    logits_k = head(final_norm_k(h_k))        -> predicts t_{i+k+1} (= labels[i+k])

- The concatenation puts the embedding first, as Megatron-Core's and vLLM's DeepSeek-V3 MTP
  do (the paper's formula writes the hidden state first; the order only permutes
  ``eh_proj``'s input columns, so it matters for exchanging ``eh_proj`` weights).
- Embedding and head are the main model's (shared weights). On a pipeline's last stage
  (pp > 1) the embedding is a copy: the tied LM head's copy when embeddings are tied, else an
  MTP-owned copy with the embedding's checkpoint key (saved as a replica) and
  ``ParamMeta.shared_embedding`` so ``finalize_model_grads`` sums its gradient with the first
  stage's over the embedding group (the first stage's embedding is marked shared too).
- Targets and inputs are rolled left per document: with packed sequences (``cu_seqlens``)
  position ``i`` is ignored at depth ``k`` when ``i+k`` is in another document (or past the
  end), so no prediction crosses a document boundary. Context parallelism is refused (rolling
  would cross chunk boundaries).
- Loss: ``mtp_loss = loss_coeff / D · Σ_k loss_sum_k`` (sums over counted tokens, like the
  main loss; each depth through the head's fused linear cross-entropy, recomputing in backward,
  unless ``fused_linear_cross_entropy=False``) reaches backward through moe-router's
  :func:`attach_aux_loss` on the main head's input, multiplied by ``model.mtp_loss_scale``
  (the trainer sets it to its main-loss backward factor, e.g. ``1/N_global`` when it backprops ``loss_sum / N_global``); the model's
  return value is unchanged. :class:`MTPLossTracker` (``model.mtp.tracker``, last stage) keeps
  each depth's (loss sum, token count); :func:`reduce_mtp_losses` (every rank) gives the
  per-depth means for logging.
- MTP layers are ordinary :class:`TransformerLayer` s built from the spec's ``mtp`` entries
  (:func:`~shardwork.models.spec.spec_for`: MoE when the model is MoE), with global layer
  numbers ``num_layers + k - 1`` (their tracker rows follow the decoder's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.models.attention import AttentionInputs
from shardwork.models.context_parallel import document_ids
from shardwork.models.embedding import EMBEDDING_KEY
from shardwork.models.layer_kinds import BuildContext
from shardwork.models.loss import token_loss
from shardwork.models.module import ShardedModule
from shardwork.models.mtp_config import MTPConfig
from shardwork.models.norm import RMSNorm
from shardwork.models.parallel_linear import RowParallelLinear
from shardwork.models.sharding import describe_param, param_shards
from shardwork.models.spec import LayerSpec
from shardwork.models.transformer_layer import TransformerLayer, build_layer
from shardwork.parallel_state import (
    ParamMeta,
    ProcessGroups,
    gather_from_sequence_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
)

__all__ = [
    "MTPConfig",
    "MTPLossTracker",
    "MultiTokenPrediction",
    "reduce_mtp_losses",
    "roll_for_depth",
]


class MTPLossTracker:
    """Per-depth (loss sum, counted tokens) of the MTP losses, accumulated over micro-batches."""

    def __init__(self, num_depths: int, device: torch.device | str = "cpu") -> None:
        # float64: sums of many micro-batches' losses and token counts stay exact enough for
        # logging.
        self.values = torch.zeros(num_depths, 2, dtype=torch.float64, device=device)
        """``[depth, (loss_sum, num_tokens)]``."""

    def record(self, depth: int, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> None:
        self.values[depth, 0] += loss_sum.detach().to(self.values)
        self.values[depth, 1] += num_tokens.detach().to(self.values)

    def reset(self) -> None:
        self.values.zero_()

    def reduce(self, *, pp_group=None, dp_cp_group=None) -> None:
        """Sum over pipeline stages (only the last records) and data × context ranks."""
        for group in (pp_group, dp_cp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(self.values, group=group)

    def mean_losses(self) -> list[float]:
        """Per-depth mean loss (after :meth:`reduce`), for logging as ``mtp_loss_<k>``."""
        return [float(s / max(n, 1.0)) for s, n in self.values.tolist()]


def reduce_mtp_losses(chunks, groups: ProcessGroups) -> list[float]:
    """Per-depth mean MTP loss of this step; every rank of the layout calls it.

    Stages without MTP contribute zeros; sums and counts are all-reduced over pp and dp×cp
    before dividing (true per-token means). Call once per step, then ``tracker.reset()``.
    """
    chunks = [chunks] if isinstance(chunks, torch.nn.Module) else list(chunks)
    found, depths = None, None
    for chunk in chunks:
        while getattr(chunk, "mtp", None) is None and isinstance(
            getattr(chunk, "module", None), torch.nn.Module
        ):
            chunk = chunk.module
        depths = chunk.config.mtp.num_layers
        if getattr(chunk, "mtp", None) is not None:
            found = chunk.mtp.tracker.values
    # Stages without MTP still join with zeros: every pp rank must issue the same all-reduces.
    values = found.clone() if found is not None else torch.zeros(depths, 2, dtype=torch.float64)
    for group in (groups.group("pp"), groups.group("dp_cp")):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
    return [float(total / max(count, 1.0)) for total, count in values.tolist()]


def roll_for_depth(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    *,
    depth: int,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inputs ``t_{i+k}`` and targets ``labels[i+k]`` for depth ``k`` (``[b, s]`` each).

    Positions whose ``i+k`` is past the end or (packed) in another document get label -100
    and input id 0 (never counted).
    """
    s = input_ids.shape[1]
    k = depth
    idx = torch.arange(s, device=input_ids.device)
    src = idx + k
    valid = src < s
    if cu_seqlens is not None:
        docs = document_ids(cu_seqlens.to(input_ids.device), s)
        # A target in another packed document would leak across the boundary: ignore that position.
        valid = valid & (docs[src.clamp(max=s - 1)] == docs)
    src = src.clamp(max=s - 1)
    # Rolled left by k (labels[:, i+k] is t_{i+k+1}); invalid positions get id 0 and label -100.
    ids = torch.where(valid, input_ids[:, src], torch.zeros_like(input_ids))
    lab = torch.where(valid, labels[:, src], torch.full_like(labels, -100))
    mask = None
    if loss_mask is not None:
        mask = torch.where(valid, loss_mask[:, src], torch.zeros_like(loss_mask))
    return ids, lab, mask


def _embed(weight: torch.Tensor, ids: torch.Tensor, groups: ProcessGroups, sp: bool):
    """Vocab-parallel lookup with ``weight [V_pad/tp, h]`` (VocabParallelEmbedding's rule)."""
    # [b, s] -> [s, b], sequence first like the hidden states.
    x = ids.transpose(0, 1)
    tp = groups.size("tp")
    if tp == 1:
        return F.embedding(x, weight)
    rows = weight.shape[0]
    # Same rule as VocabParallelEmbedding: ids outside this rank's vocab rows look up row 0, are
    # zeroed, and the sum over TP leaves the one rank that owns each id.
    local = x - rows * groups.rank("tp")
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
    if sp:
        return reduce_scatter_to_sequence_region(out, groups.tp, dim=0)
    return reduce_from_tp_region(out, groups.tp)


class MTPDepth(ShardedModule):
    """One prediction depth: norms, ``eh_proj [h, 2h]`` (row-parallel), a layer, a final norm."""

    def __init__(self, config, groups, *, layer: TransformerLayer, device) -> None:
        super().__init__(groups)
        sp = config.sequence_parallel
        norm = dict(
            groups=groups,
            eps=config.norm_epsilon,
            backend=config.kernel_backend,
            partial_grad=sp,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            params_dtype=config.params_dtype,
            device=device,
        )
        self.sp = sp
        self.enorm = RMSNorm(config.hidden_size, **norm)
        self.hnorm = RMSNorm(config.hidden_size, **norm)
        self.eh_proj = RowParallelLinear(
            2 * config.hidden_size,
            config.hidden_size,
            groups=groups,
            sequence_parallel=sp,
            init="normal",
            params_dtype=config.params_dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )
        self.transformer_layer = layer
        self.final_layernorm = RMSNorm(config.hidden_size, **norm)

    def forward(self, hidden, embedded, inputs: AttentionInputs):
        # [emb ; hidden] order, as Megatron-Core's and vLLM's DeepSeek-V3 MTP concatenate: eh_proj's
        # input columns follow it.
        x = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)
        tp = self.groups.tp
        if self.sp:
            # eh_proj is row-parallel: each TP rank needs its slice of the 2h features for all
            # tokens. Backward keeps the own chunk: scatter_to_tp_region's backward all-gathers the
            # feature slices, so the gradient is already complete.
            x = gather_from_sequence_region(x, tp, dim=0, grad_is_partial=False)
        h = self.eh_proj(scatter_to_tp_region(x, tp))
        h = self.transformer_layer(h, inputs)
        return h, self.final_layernorm(h)


class MultiTokenPrediction(ShardedModule):
    """The MTP depths of a model's last stage (see module docstring)."""

    def __init__(
        self,
        config,
        groups,
        *,
        own_embedding: bool,
        specs: tuple[LayerSpec, ...],
        ctx: BuildContext,
        device=None,
    ) -> None:
        """``specs``: one layer spec per depth (``DecoderSpec.mtp``); ``ctx`` builds them."""
        super().__init__(groups)
        self.config = config
        mtp = config.mtp
        self.layers = torch.nn.ModuleList(
            MTPDepth(
                config,
                groups,
                layer=build_layer(spec, ctx, config.num_layers + k),
                device=device,
            )
            for k, spec in enumerate(specs)
        )
        self.embedding_weight = None
        if own_embedding:
            tp = groups.size("tp")
            self.embedding_weight = describe_param(
                torch.nn.Parameter(
                    torch.empty(
                        (config.padded_vocab_size // tp, config.hidden_size),
                        dtype=config.params_dtype,
                        device=device,
                    )
                ),
                ParamMeta(tp_axis=0, shared_embedding=True),
                init="normal",
                real_rows=config.vocab_size,
            )
        on_meta = device is not None and torch.device(device).type == "meta"
        self.tracker = MTPLossTracker(mtp.num_layers, device="cpu" if on_meta else device or "cpu")

    def named_param_keys(self, prefix: str = ""):
        for key, param, module in super().named_param_keys(prefix):
            if param is self.embedding_weight:
                yield EMBEDDING_KEY, param, module
            else:
                yield key, param, module

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        out = {}
        for segment, child in self._sharded_children():
            out.update(child.sharded_state_dict(f"{prefix}{segment}."))
        if self.embedding_weight is not None:
            # replica_offset=1: the first stage's embedding is the primary copy of this key; the
            # copy here is saved as a replica so the checkpoint holds one version.
            for st in param_shards(
                self.embedding_weight, EMBEDDING_KEY, self.shard_ctx, replica_offset=1
            ):
                out[st.key] = st
        return out

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        inputs: AttentionInputs,
        embedding_weight: torch.Tensor,
        head,
        head_weight: torch.Tensor | None,
    ) -> torch.Tensor:
        """Sum over depths of ``loss_sum_k`` times ``loss_coeff / D`` (0-d, with gradient)."""
        cfg = self.config
        emb_w = self.embedding_weight if self.embedding_weight is not None else embedding_weight
        total = None
        for k, depth in enumerate(self.layers, start=1):
            ids_k, lab_k, mask_k = roll_for_depth(
                input_ids, labels, loss_mask, depth=k, cu_seqlens=cu_seqlens
            )
            embedded = _embed(emb_w, ids_k, self.groups, cfg.sequence_parallel).to(hidden.dtype)
            hidden, normed = depth(hidden, embedded, inputs)
            loss_sum, n = self._depth_loss(head, normed, head_weight, lab_k, mask_k)
            self.tracker.record(k - 1, loss_sum, n)
            total = loss_sum if total is None else total + loss_sum
        return total * (cfg.mtp.loss_coeff / cfg.mtp.num_layers)

    def _depth_loss(self, head, normed, head_weight, labels, loss_mask):
        """``(loss_sum, num_tokens)`` of one depth through the shared head."""
        cfg = self.config
        if cfg.fused_linear_cross_entropy:
            # Recomputed in backward: a depth holds no dW from its forward to its backward, so
            # the depths and the main head never hold theirs at the same time.
            return head.token_loss(
                normed,
                labels,
                weight=head_weight,
                loss_mask=loss_mask,
                grad_in_forward=False,
                backend=cfg.kernel_backend,
            )
        return token_loss(
            head(normed, head_weight),
            labels,
            loss_mask=loss_mask,
            tp_group=self.groups.tp,
            inplace_backward=True,
            backend=cfg.kernel_backend,
        )
