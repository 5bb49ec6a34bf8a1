"""``HFRouterGate``: a :class:`TopKRouter` that takes a transformers router module's place.

Legend: B batch, S sequence, T = B·S tokens, H hidden, E experts, K top_k.

- Same call contract as the module it replaces: ``gate(hidden)`` with ``hidden`` [B, S, H] or
  its rows [T, H] in transformers' batch-major order, returning ``(router_logits_TE,
  top_k_weights_TK, top_k_index_TK)``, so the MoE block, its experts (any
  ``experts_implementation``) and transformers' router-logits recorder work unchanged.
- Layout: transformers holds tokens batch-major [B, S]; shardwork's router counts them
  sequence-major [S, B] (the sequence aux loss sums over each sequence's tokens). The
  logits are reordered to [S, B] for :meth:`TopKRouter.route` and its results back; the
  2-D call learns (B, S) from ``token_layout``, which the owning block's pre-hook sets.
- Same tensors under the same names: ``weight`` (and gpt-oss's ``bias``) are the replaced
  module's own Parameters (an optimizer made before the swap keeps training them); DeepSeek's
  ``e_score_correction_bias`` is the router's fp32 ``expert_bias``, saved and loaded under its
  transformers name, so a saved model loads in stock transformers.
- Activation recomputation (gradient checkpointing) calls the router again after the model's
  forward has returned: ``recomputing`` (set by the swap's model hooks) makes that call
  repeat the first one's values without counting tokens or logging losses a second time.
- Capacity dropping leaves a token fewer than K experts: its free slots point at an
  unrouted expert with weight 0 (no contribution, no gradient).
"""

from __future__ import annotations

import contextlib

import torch

from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.router import TopKRouter
from shardwork.moe_router.tracker import AuxLossTracker

HF_EXPERT_BIAS = "e_score_correction_bias"
"""transformers' name for the DeepSeek-V3 expert bias (``expert_bias`` here)."""


def sequence_major(x_BSE: torch.Tensor) -> torch.Tensor:
    """[B, S, E] -> [S·B, E] rows in [S, B] order (the router's token order)."""
    return x_BSE.transpose(0, 1).reshape(-1, x_BSE.shape[-1])


def batch_major(x_TE: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """[S·B, E] rows in [S, B] order -> [B·S, E] rows in [B, S] order (transformers')."""
    return x_TE.view(seq_len, batch, -1).transpose(0, 1).reshape(batch * seq_len, -1)


def top_k_slots(
    probs_TE: torch.Tensor, map_TE: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_TK, index_TK) of a dense routing: each token's routed experts, highest
    probability first; slots left free by capacity dropping get an unrouted expert and a
    weight of exactly 0."""
    # Unrouted experts rank below every routed one (probabilities are >= 0).
    ranked_TE = probs_TE.detach().masked_fill(~map_TE, -1.0)
    index_TK = ranked_TE.topk(top_k, dim=-1).indices
    kept_TK = map_TE.gather(1, index_TK)
    weights_TK = probs_TE.gather(1, index_TK) * kept_TK.to(probs_TE.dtype)
    return weights_TK, index_TK


class HFRouterGate(TopKRouter):
    """shardwork's router in a transformers router module's place (see the module docstring).

    Args:
        config: the routing (``families.router_config_for``) plus load-balancing options.
        hf_router: the transformers module replaced; its ``weight`` (and ``bias``) Parameters
            are taken over, its ``e_score_correction_bias`` copied into ``expert_bias``.
        tracker: receives this layer's loss values and token counts (row ``layer_index``).
        layer_index: 0-based index among the model's MoE layers.
        dp_group: ranks holding other data (the global aux loss and the expert-bias update
            sum their token counts over it); None: one process.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        hf_router: torch.nn.Module,
        tracker: AuxLossTracker,
        layer_index: int,
        dp_group=None,
    ) -> None:
        super().__init__(
            config,
            tp_dp_cp_group=dp_group,
            tracker=tracker,
            layer_index=layer_index,
            device=hf_router.weight.device,
        )
        self.weight = hf_router.weight
        if config.add_bias:
            self.bias = hf_router.bias
        if config.enable_expert_bias:
            with torch.no_grad():
                self.expert_bias.copy_(getattr(hf_router, HF_EXPERT_BIAS))
        self.replaced_class = type(hf_router).__name__
        self.token_layout: tuple[int, int] | None = None
        """(B, S) of the block input, set by the block's forward pre-hook for 2-D calls."""
        self.padding_BS: torch.Tensor | None = None
        """bool [B, S], True at padding tokens (left out of losses and counts); set per
        model forward from its ``attention_mask``, None without padding."""
        self.recomputing = False
        """True between model forwards: a call then is an activation recomputation."""
        self._global_counts_before: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor):
        """``hidden`` [B, S, H] or [B·S, H] (batch-major) -> ``(router_logits [B·S, E],
        top_k_weights [B·S, K], top_k_index [B·S, K])`` as transformers' routers return them."""
        if self.recomputing:
            with self._as_last_call():
                return self._route_batch_major(hidden)
        if self.global_tokens_per_expert is not None:
            self._global_counts_before = (
                self.global_tokens_per_expert.clone(),
                self.global_aux_steps.clone(),
            )
        return self._route_batch_major(hidden)

    def _route_batch_major(self, hidden: torch.Tensor):
        cfg = self.config
        batch, seq_len = self._batch_and_seq(hidden)
        logits_BSE = self.logits(hidden.reshape(batch, seq_len, cfg.hidden_size))
        padding_T = None
        if self.padding_BS is not None and self.padding_BS.shape == (batch, seq_len):
            padding_T = self.padding_BS.transpose(0, 1).reshape(-1)
        probs_TE, map_TE = self.route(
            sequence_major(logits_BSE), seq_len=seq_len, batch=batch, padding_mask=padding_T
        )
        weights_TK, index_TK = top_k_slots(
            batch_major(probs_TE, batch, seq_len),
            batch_major(map_TE, batch, seq_len),
            cfg.top_k,
        )
        return logits_BSE.reshape(batch * seq_len, -1), weights_TK, index_TK

    @contextlib.contextmanager
    def _as_last_call(self):
        """An activation recomputation (gradient checkpointing) of this router's last call:
        no tracker record, no expert-bias count, and the global aux loss's running counts as
        they were before that call, so it computes the same values and counts nothing twice.
        Right when each micro-batch's backward follows its forward (gradient accumulation)."""
        saved = (self.tracker, self.local_tokens_per_expert)
        saved_global = (self.global_tokens_per_expert, self.global_aux_steps)
        self.tracker, self.local_tokens_per_expert = None, None
        if self._global_counts_before is not None:
            counts, steps = self._global_counts_before
            self.global_tokens_per_expert, self.global_aux_steps = counts.clone(), steps.clone()
        try:
            yield
        finally:
            self.tracker, self.local_tokens_per_expert = saved
            self.global_tokens_per_expert, self.global_aux_steps = saved_global

    def _batch_and_seq(self, hidden: torch.Tensor) -> tuple[int, int]:
        if hidden.dim() == 3:
            return hidden.shape[0], hidden.shape[1]
        layout = self.token_layout
        if hidden.dim() != 2 or layout is None or layout[0] * layout[1] != hidden.shape[0]:
            raise ValueError(
                f"hidden shape {tuple(hidden.shape)} is invalid for the shardwork router of MoE "
                f"layer {self.layer_index}: pass [batch, seq, hidden], or call it from its MoE "
                f"block (which records the block input's [batch, seq], here {layout})"
            )
        return layout

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.expert_bias is not None:
            destination[prefix + HF_EXPERT_BIAS] = destination.pop(prefix + "expert_bias")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.expert_bias is not None and prefix + HF_EXPERT_BIAS in state_dict:
            state_dict[prefix + "expert_bias"] = state_dict.pop(prefix + HF_EXPERT_BIAS)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"replaces={self.replaced_class}, num_experts={cfg.num_experts}, top_k={cfg.top_k}, "
            f"score_function={cfg.score_function!r}, load_balancing_type="
            f"{cfg.load_balancing_type!r}"
        )
