"""``MoERouter``: moe-router's :class:`TopKRouter` inside a ShardedModule.

- The gating weight ``[E, H]`` is a parameter of this module (checkpoint key
  ``...mlp.router.weight``, layout-independent init, ``ParamMeta.sequence_parallel`` under
  sequence parallelism since each TP rank routes only its own tokens). Logits are computed here
  in the router dtype and handed to ``TopKRouter.route`` — top-k, group limits, capacity,
  aux losses, z-loss, expert-bias counting and the tracker are moe-router's, unchanged.
- The inner router keeps its buffers (``expert_bias`` for aux-loss-free balancing, saved as
  ``...mlp.router.expert_bias``); it holds no parameter of its own.
- Under full-layer recompute the router runs again inside backward; that second run records
  nothing (tracker values, expert-bias token counts), so logged loads and bias updates are
  those of one forward. (A ``global_aux_loss`` accumulates its counts in both runs.)
"""

from __future__ import annotations

import torch

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.models.module import ShardedModule
from shardwork.models.sharding import describe_param
from shardwork.moe_router import AuxLossScale, AuxLossTracker, RouterConfig, TopKRouter
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["MoERouter"]

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class MoERouter(ShardedModule):
    """Gating linear + moe-router routing; ``forward(hidden) -> (probs_TE, routing_map_TE)``."""

    def __init__(
        self,
        config: RouterConfig,
        groups: ProcessGroups,
        *,
        sequence_parallel: bool,
        tp_cp_group,
        tp_dp_cp_group,
        tracker: AuxLossTracker | None,
        loss_scale: AuxLossScale | None,
        layer_index: int,
        params_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        self.inner = TopKRouter(
            config,
            tp_cp_group=tp_cp_group,
            tp_dp_cp_group=tp_dp_cp_group,
            tracker=tracker,
            loss_scale=loss_scale,
            layer_index=layer_index,
            device=device,
        )
        if self.inner.bias is not None:
            raise ValueError("RouterConfig.add_bias=True is not supported by the models' MoE layer")
        del self.inner.weight
        self.inner.register_parameter("weight", None)
        self.weight = describe_param(
            torch.nn.Parameter(
                torch.empty(
                    (config.num_experts, config.hidden_size), dtype=params_dtype, device=device
                )
            ),
            ParamMeta(sequence_parallel=sequence_parallel),
            init="normal",
        )

    @property
    def config(self) -> RouterConfig:
        return self.inner.config

    @property
    def expert_bias(self) -> torch.Tensor | None:
        return self.inner.expert_bias

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the expert bias and step counters (after a meta-device build is materialised)."""
        for name in ("expert_bias", "local_tokens_per_expert"):
            buf = getattr(self.inner, name, None)
            if buf is not None:
                buf.zero_()
        self.inner.reset_step_state()

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [s, b, h]`` -> ``(probs_TE, routing_map_TE)`` with T = s·b (row-major)."""
        cfg = self.inner.config
        seq_len, batch = hidden.shape[0], hidden.shape[1]
        x = self.inner._jitter(hidden)
        dtype = _DTYPES.get(cfg.router_dtype, hidden.dtype)
        logits = torch.mm(x.reshape(-1, x.shape[-1]).to(dtype), self.weight.to(dtype).t())
        if torch._C._current_graph_task_id() == -1:
            return self.inner.route(logits, seq_len=seq_len, batch=batch)
        # Recomputed inside backward (full-layer recompute): the first forward already
        # recorded tracker values and expert-bias token counts; do not count them twice.
        tracker, counts = self.inner.tracker, self.inner.local_tokens_per_expert
        self.inner.tracker = None
        if counts is not None:
            self.inner.local_tokens_per_expert = None
        try:
            return self.inner.route(logits, seq_len=seq_len, batch=batch)
        finally:
            self.inner.tracker = tracker
            if counts is not None:
                self.inner.local_tokens_per_expert = counts

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        out = super().sharded_state_dict(prefix)
        bias = self.inner.expert_bias
        if bias is not None:
            rid = self.shard_ctx.replica_id(False)
            key = f"{prefix}expert_bias"
            out[key] = ShardedTensor(key, bias, tuple(bias.shape), (0,), replica_id=rid)
        return out
