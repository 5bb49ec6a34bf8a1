"""``MoERouter``: moe-router's :class:`TopKRouter` inside a ShardedModule.

- The gating weight ``[E, H]`` is a parameter of this module (checkpoint key
  ``...mlp.router.weight``, layout-independent normal init at ``RouterConfig.init_std``,
  ``ParamMeta.sequence_parallel`` under sequence parallelism since each TP rank routes only
  its own tokens). Logits are computed here in the router dtype and handed to
  ``TopKRouter.route`` — top-k, group limits, capacity, aux losses, z-loss, expert-bias
  counting and the tracker are moe-router's, unchanged.
- The inner router keeps its buffers (``expert_bias`` for aux-loss-free balancing, saved as
  ``...mlp.router.expert_bias``; ``qb_beta`` for quantile balancing, saved as
  ``...mlp.router.qb_beta``); it holds no parameter of its own.
- Under full-layer recompute the router runs again inside backward. Through the model's
  :class:`~shardwork.models.recompute.RecomputeReplay` the first run records the global aux
  loss's running counts before its update; the recompute records nothing (tracker values,
  expert-bias token counts, quantile-balancing accumulators, running counts) and computes the global aux loss from the
  recorded counts, so losses, gradients, logged values and bias updates equal those without
  recompute, also with several micro-batches in flight.
"""

from __future__ import annotations

import torch

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.models.module import ShardedModule
from shardwork.models.recompute import RecomputeReplay
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
        replay: RecomputeReplay | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        self.replay = replay
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
        # The gating weight lives on this ShardedModule (checkpoint key, layout-independent init,
        # ParamMeta); the inner router's own copy is removed so it is not a second parameter.
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
            std=config.init_std,
        )

    @property
    def config(self) -> RouterConfig:
        return self.inner.config

    @property
    def expert_bias(self) -> torch.Tensor | None:
        return self.inner.expert_bias

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the expert bias, ``qb_beta`` and step counters (after a meta-device build is
        materialised)."""
        for name in ("expert_bias", "local_tokens_per_expert", "qb_beta"):
            buf = getattr(self.inner, name, None)
            if buf is not None:
                buf.zero_()
        self.inner.reset_step_state()

    def gating_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [s, b, h]`` -> the gating logits ``[s·b, E]`` (token t = i·b + j, the row
        order the dispatcher uses) in the router dtype, before any scoring."""
        # Like Megatron-Core's moe_router_dtype: logits (and so top-k) in fp32/fp64 for stable
        # routing with many experts; unset means the activation dtype.
        dtype = _DTYPES.get(self.inner.config.router_dtype, hidden.dtype)
        return torch.mm(hidden.reshape(-1, hidden.shape[-1]).to(dtype), self.weight.to(dtype).t())

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [s, b, h]`` -> ``(probs_TE, routing_map_TE)`` with T = s·b (row-major)."""
        seq_len, batch = hidden.shape[0], hidden.shape[1]
        logits = self.gating_logits(self.inner._jitter(hidden))
        replay = self.replay
        if replay is not None and replay.recomputing:
            return self._route_again(logits, seq_len, batch, replay.replay())
        if replay is not None and replay.recording:
            replay.record(self._global_counts())
            return self.inner.route(logits, seq_len=seq_len, batch=batch)
        # -1: no backward pass is running on this thread, so this is an ordinary forward.
        if torch._C._current_graph_task_id() == -1:
            return self.inner.route(logits, seq_len=seq_len, batch=batch)
        # Recomputed inside backward by a checkpoint without our replay channel: record
        # nothing (the global aux loss then sees its running counts once more).
        return self._route_again(logits, seq_len, batch, None)

    def _global_counts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The global aux loss's running counts before this forward (None when unused)."""
        inner = self.inner
        if inner.global_tokens_per_expert is None or not self.training:
            return None
        return inner.global_tokens_per_expert.clone(), inner.global_aux_steps.clone()

    def _route_again(self, logits, seq_len: int, batch: int, counts) -> tuple:
        """Route in a recompute: no tracker values, no expert-bias token counts, no
        quantile-balancing accumulation (selection still uses ``qb_beta``, which moves only
        between steps), and the global aux loss computed from the running counts the first
        run saw (``counts``)."""
        inner = self.inner
        saved = {
            "tracker": inner.tracker,
            "local_tokens_per_expert": inner.local_tokens_per_expert,
            "global_tokens_per_expert": inner.global_tokens_per_expert,
            "global_aux_steps": inner.global_aux_steps,
            "qb_beta_accum": inner.qb_beta_accum,
        }
        inner.tracker = None
        for name in ("local_tokens_per_expert", "qb_beta_accum"):
            if saved[name] is not None:  # the router then counts / accumulates nothing
                setattr(inner, name, None)
        if counts is not None:  # updated in place by route: on copies, then dropped
            inner.global_tokens_per_expert = counts[0].clone()
            inner.global_aux_steps = counts[1].clone()
        try:
            return inner.route(logits, seq_len=seq_len, batch=batch)
        finally:
            for name, value in saved.items():
                setattr(inner, name, value)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        out = super().sharded_state_dict(prefix)
        rid = self.shard_ctx.replica_id(False)
        for name in ("expert_bias", "qb_beta"):
            buf = getattr(self.inner, name)
            if buf is not None:
                key = f"{prefix}{name}"
                out[key] = ShardedTensor(key, buf, tuple(buf.shape), (0,), replica_id=rid)
        return out
