"""shardwork.moe_router — a complete MoE router and token dispatch in plain torch.

- :class:`RouterConfig` / :class:`TopKRouter`: Megatron-Core 0.19 ``TopKRouter`` semantics,
  option for option (softmax / sigmoid / sqrtsoftplus, group-limited top-k, capacity, every
  load-balancing loss, z-loss, aux-loss-free expert bias, random routing);
  :func:`group_score_top_n_for_hf` says which group-scoring rule a Hugging Face config implies;
  :class:`RouterReplay` records routing decisions and replays them in a later forward
  (:func:`gather_records` / :func:`shard_records` move records between parallel layouts);
  quantile balancing's step update is :func:`update_quantile_balancing`.
- :class:`AuxLossScale`, :func:`attach_aux_loss`, :class:`AuxLossTracker`: aux losses reach
  backward without changing outputs; per-layer logging; caller-owned objects.
- :func:`permute` / :func:`unpermute`, :class:`AllGatherDispatcher`,
  :class:`AllToAllDispatcher`, :class:`GroupedMLP`, :class:`MoEBlock`: expert and expert-tensor
  parallel token dispatch with groups passed as arguments, torch collectives only.
"""

from shardwork.moe_router.aux_loss import AuxLossScale, attach_aux_loss, switch_aux_loss, z_loss
from shardwork.moe_router.block import MoEBlock
from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.dispatcher import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    Dispatched,
    DispatchHandle,
)
from shardwork.moe_router.experts import GroupedMLP
from shardwork.moe_router.hf_config import group_score_top_n_for_hf
from shardwork.moe_router.permute import pad_routing_map, permute, unpermute
from shardwork.moe_router.quantile_balancing import update_quantile_balancing
from shardwork.moe_router.replay import RouterReplay
from shardwork.moe_router.replay_layout import (
    gather_records,
    local_token_rows,
    merge_record_shards,
    shard_records,
)
from shardwork.moe_router.router import TopKRouter, update_expert_bias
from shardwork.moe_router.scoring import (
    aux_loss_scores,
    drop_to_capacity,
    expert_capacity,
    group_limited_topk,
    sinkhorn,
    topk_routing,
)
from shardwork.moe_router.tracker import LOSS_NAMES, AuxLossTracker

__all__ = [
    "LOSS_NAMES",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "AuxLossScale",
    "AuxLossTracker",
    "DispatchHandle",
    "Dispatched",
    "GroupedMLP",
    "MoEBlock",
    "RouterConfig",
    "RouterReplay",
    "TopKRouter",
    "attach_aux_loss",
    "aux_loss_scores",
    "drop_to_capacity",
    "expert_capacity",
    "gather_records",
    "group_limited_topk",
    "group_score_top_n_for_hf",
    "local_token_rows",
    "merge_record_shards",
    "pad_routing_map",
    "permute",
    "shard_records",
    "sinkhorn",
    "switch_aux_loss",
    "topk_routing",
    "unpermute",
    "update_expert_bias",
    "update_quantile_balancing",
    "z_loss",
]
