"""Global keys for the optimizer's checkpointed state, whatever the layout.

shardwork.dist_optimizer saves ZeRO shards in global coordinates from each
parameter's ``ParamMeta`` (TP split and fused blocks), keyed by the parameter's
*name*. Names are local to a pipeline stage ("decoder.layers.0" exists on every
stage) and stacked experts are numbered locally, so the trainer supplies
``param_rects`` that fix exactly that:

- the key is the model's global key (``named_param_keys()`` of shardwork.models:
  global layer numbers), so stages never collide and any pp/vpp reloads it;
- stacked expert parameters ``[local experts, ...]`` get the expert axis placed
  at their first global expert (over ``ep``), and their TP split over ``etp``;
- the tied LM-head copy on the last stage (``shared_embedding``) uses the
  embedding's key as a replica of the first stage's copy.

Everything else (TP offsets, fused blocks) is dist_optimizer's
``default_param_rects``.
"""

from __future__ import annotations

import dataclasses

from shardwork.dist_optimizer.sharded_state import default_param_rects
from shardwork.models import EMBEDDING_KEY
from shardwork.parallel_state import get_param_meta

_EXPERT_SHARDS = "_shardwork_custom_shards"  # shardwork.models.moe.ExpertShards on stacked experts


def optimizer_param_rects(modules, groups):
    """A ``param_rects`` function for ``sharded_state_dict`` / ``load_sharded_state_dict``."""
    key_of = {id(p): key for m in modules for key, p, _ in m.named_param_keys()}
    pp_rank = groups.rank("pp")

    def rects(name, param):
        meta = get_param_meta(param)
        axis_group = "etp" if meta.is_expert else "tp"
        base = default_param_rects(
            name, param, tp_rank=groups.rank(axis_group), tp_size=groups.size(axis_group)
        )
        key = EMBEDDING_KEY if meta.shared_embedding else key_of[id(param)]
        shards = getattr(param, _EXPERT_SHARDS, None)
        out = []
        for rect in base:
            shape, offset = list(rect.global_shape), list(rect.global_offset)
            if shards is not None:
                shape[0] = param.shape[0] * groups.size("ep")
                offset[0] = shards.first_expert
            replica = rect.replica_id + (1 if meta.shared_embedding and pp_rank > 0 else 0)
            out.append(
                dataclasses.replace(
                    rect,
                    key=key,
                    global_shape=tuple(shape),
                    global_offset=tuple(offset),
                    replica_id=replica,
                )
            )
        return out

    return rects
