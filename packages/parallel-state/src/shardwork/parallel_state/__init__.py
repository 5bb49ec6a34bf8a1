"""shardwork.parallel_state: process groups passed explicitly, never global.

- :class:`ParallelConfig` — sizes of tp, pp, vpp, cp, ep, etp (dp derived), validated early.
- :class:`RankLayout` — every group's ranks as pure computation (Megatron-Core compatible).
- :func:`init_process_groups` / :class:`ProcessGroups` — create each group once; ``single()``.
- :class:`ParamMeta` — the per-parameter layout record every package reads;
  :func:`carry_param_attributes` keeps it (and every ``_shardwork_*`` attribute) when a
  parameter object is replaced, :func:`row_shard` the rows an FSDP-sharded parameter holds.
- differentiable collectives for tensor/sequence/context/expert parallel layers.
- :mod:`shardwork.parallel_state.testing` — run a test function on N gloo ranks.
"""

from shardwork.parallel_state.collectives import (
    all_to_all,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from shardwork.parallel_state.config import ORDER_TOKENS, ParallelConfig
from shardwork.parallel_state.groups import (
    ProcessGroups,
    group_rank,
    group_size,
    init_process_groups,
)
from shardwork.parallel_state.layout import GROUP_NAMES, RankLayout
from shardwork.parallel_state.param_meta import (
    ParamMeta,
    carry_param_attributes,
    get_param_meta,
    has_param_meta,
    set_param_meta,
)
from shardwork.parallel_state.row_shards import RowShard, row_shard

__version__ = "0.1.0"

__all__ = [
    "GROUP_NAMES",
    "ORDER_TOKENS",
    "ParallelConfig",
    "ParamMeta",
    "ProcessGroups",
    "RankLayout",
    "RowShard",
    "all_to_all",
    "carry_param_attributes",
    "copy_to_tp_region",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "get_param_meta",
    "group_rank",
    "group_size",
    "has_param_meta",
    "init_process_groups",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "row_shard",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "set_param_meta",
]
