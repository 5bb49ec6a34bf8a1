"""``MoEBlock``: router + dispatcher + reference experts, a drop-in MoE feed-forward layer.

- ``forward(hidden [S, B, H] or [T, H], padding_mask=None) -> same shape``: route, dispatch,
  run the local experts, combine. Aux losses reach backward through the router's probs.
- Groups are arguments: ``ep_group``/``etp_group`` place experts, ``tp_group`` marks a dense
  TP group over which ``hidden`` is replicated (no sequence parallelism), ``tp_cp_group`` /
  ``tp_dp_cp_group`` are what the router's losses reduce over.
- Experts: :class:`GroupedMLP` (SwiGLU by default); a framework with its own experts uses
  ``router`` and ``dispatcher`` directly (see the README example).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwork.moe_router.aux_loss import AuxLossScale
from shardwork.moe_router.comm import group_size
from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from shardwork.moe_router.experts import GroupedMLP
from shardwork.moe_router.router import TopKRouter
from shardwork.moe_router.tracker import AuxLossTracker

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


class MoEBlock(torch.nn.Module):
    """Mixture-of-experts MLP: ``TopKRouter`` → dispatcher → ``GroupedMLP`` → combine."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        ffn_hidden_size: int,
        dispatcher: str = "alltoall",
        ep_group=None,
        etp_group=None,
        tp_group=None,
        tp_cp_group=None,
        tp_dp_cp_group=None,
        tracker: AuxLossTracker | None = None,
        loss_scale: AuxLossScale | None = None,
        layer_index: int | None = None,
        gated: bool = True,
        activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu,
    ) -> None:
        super().__init__()
        if dispatcher not in DISPATCHERS:
            raise ValueError(
                f"dispatcher={dispatcher!r} is invalid: use one of {tuple(DISPATCHERS)}"
            )
        self.router = TopKRouter(
            config,
            tp_cp_group=tp_cp_group,
            tp_dp_cp_group=tp_dp_cp_group,
            tracker=tracker,
            loss_scale=loss_scale,
            layer_index=layer_index,
        )
        self.dispatcher = DISPATCHERS[dispatcher](
            config.num_experts, ep_group=ep_group, etp_group=etp_group, tp_group=tp_group
        )
        self.experts = GroupedMLP(
            num_local_experts=self.dispatcher.num_local_experts,
            hidden_size=config.hidden_size,
            ffn_hidden_size=ffn_hidden_size,
            etp_size=group_size(etp_group),
            gated=gated,
            activation=activation,
            init_std=config.init_std,
        )

    def forward(
        self, hidden: torch.Tensor, *, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        probs_TE, map_TE = self.router(hidden, padding_mask=padding_mask)
        dispatched, handle = self.dispatcher.dispatch(hidden, probs_TE, map_TE)
        expert_out = self.experts(dispatched.tokens, dispatched.tokens_per_expert)
        return self.dispatcher.combine(expert_out, handle)
