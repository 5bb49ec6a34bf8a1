"""``ShardedModule``: the base of every layer here; gives ``sharded_state_dict()`` to all of them.

- A module knows its :class:`~shardwork.parallel_state.ProcessGroups` and derives from them
  a :class:`~shardwork.models.sharding.ShardContext` (tp rank/size, dp×cp replica rank).
- ``sharded_state_dict(prefix)`` returns ``{key: ShardedTensor}`` for every parameter below
  it in global coordinates; modules override :meth:`ShardedModule._child_prefix` to rename
  children (global layer numbers) or :meth:`sharded_state_dict` to alias a key (tied head).
- :func:`layout_groups` builds a ProcessGroups *description* (sizes and ranks of an arbitrary
  layout, no process group handles) so a model can be built on the meta device for, say,
  rank 37 of a 64-GPU job on one CPU machine.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.models.sharding import ShardContext, param_shards
from shardwork.parallel_state import GROUP_NAMES, ParallelConfig, ProcessGroups, RankLayout

__all__ = ["ShardedModule", "layout_groups", "shard_context"]


def shard_context(groups: ProcessGroups) -> ShardContext:
    return ShardContext(
        tp_rank=groups.rank("tp"), tp_size=groups.size("tp"), replica_rank=groups.rank("dp_cp")
    )


def layout_groups(parallel: ParallelConfig, world_size: int, rank: int) -> ProcessGroups:
    """Sizes and ranks of ``rank`` in a ``world_size`` layout, with no communicator (``None``).

    For shape-only (meta device) builds and checkpoint planning; a model built from it must
    not run a forward with more than one rank in a group.
    """
    layout = RankLayout.build(parallel, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not in [0, world_size={world_size})")
    members = {}
    for name in GROUP_NAMES:
        for group in layout.groups[name]:
            if rank in group:  # middle pipeline stages are in no embedding group
                members[name] = tuple(group)
    members = MappingProxyType(members)
    handles = MappingProxyType(dict.fromkeys(GROUP_NAMES))
    gloo = MappingProxyType({n: None for n in ("dp", "dp_cp", "edp")})
    return ProcessGroups(layout.config, rank, members, handles, gloo)


class ShardedModule(torch.nn.Module):
    """A module whose parameters know their place in the global model (see module docstring)."""

    def __init__(self, groups: ProcessGroups) -> None:
        super().__init__()
        self.groups = groups
        self.shard_ctx = shard_context(groups)

    def _child_prefix(self, name: str, index: int | None = None) -> str:
        """Key segment of child ``name`` (item ``index`` of a ModuleList child)."""
        return name if index is None else f"{name}.{index}"

    def _sharded_children(self):
        """Yield ``(key segment, ShardedModule)`` for every child, ModuleList items included."""
        for name, child in self._modules.items():
            if child is None:
                continue
            if isinstance(child, torch.nn.ModuleList):
                for i, item in enumerate(child):
                    yield self._child_prefix(name, i), item
            elif isinstance(child, ShardedModule):
                yield self._child_prefix(name), child
            else:
                assert not any(True for _ in child.parameters()), (
                    f"{type(child).__name__} holds parameters but is not a ShardedModule"
                )

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """Every parameter below this module as ShardedTensors keyed by global name."""
        out: dict[str, ShardedTensor] = {}
        for name, param in self._parameters.items():
            if param is None:
                continue
            for st in param_shards(param, prefix + name, self.shard_ctx):
                out[st.key] = st
        for segment, child in self._sharded_children():
            out.update(child.sharded_state_dict(f"{prefix}{segment}."))
        return out

    def named_sharded_modules(self, prefix: str = ""):
        """Yield ``(global name, module)`` for this module and every ShardedModule below it.

        Names use the checkpoint's segments (global layer numbers on a pipeline stage), so a
        pattern over them means the same module at every layout."""
        yield prefix.removesuffix("."), self
        for segment, child in self._sharded_children():
            yield from child.named_sharded_modules(f"{prefix}{segment}.")

    def named_param_keys(self, prefix: str = ""):
        """Yield ``(global_key, param, module)`` for each parameter (the key before block suffixes)."""
        for name, param in self._parameters.items():
            if param is not None:
                yield prefix + name, param, self
        for segment, child in self._sharded_children():
            yield from child.named_param_keys(f"{prefix}{segment}.")


def to_empty_keep_meta(module: torch.nn.Module, device: str | torch.device) -> None:
    """Like ``Module.to_empty`` but keeps each parameter's Python attributes (its ParamMeta
    and checkpoint/init description), which ``to_empty`` drops when leaving the meta device."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            new = torch.nn.Parameter(
                torch.empty_like(param, device=device), requires_grad=param.requires_grad
            )
            # ParamMeta, fused blocks, real rows and init rule are plain attributes of the Parameter
            # object: copy them onto the new one or init and checkpointing lose the description.
            new.__dict__.update(param.__dict__)
            sub._parameters[name] = new
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = torch.empty_like(buf, device=device)
