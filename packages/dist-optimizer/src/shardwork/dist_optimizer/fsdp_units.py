"""Which modules become FSDP units, and on which data-parallel group each one shards.

An FSDP unit gathers and reduces its parameters in one collective. The units of a model are,
in the order ``fully_shard`` must see them (bottom-up):

1. per block (a transformer layer), its *expert containers*: the largest submodules whose
   parameters are all expert parameters (``ParamMeta.is_expert``). They shard over the
   expert-data-parallel group (edp), because ranks of one expert-parallel rank's dp replicas
   hold the same experts, while every other parameter shards over dp×cp;
2. the block itself, for the rest of its parameters (attention, norms, router, shared
   experts), over dp×cp;
3. the same two steps for the root module (embedding, final norm, LM head; and any expert
   container outside the blocks).

Pure module-tree arithmetic: nothing here communicates. A module holding expert and dense
parameters directly (no submodule separates them) cannot be split over two groups and is
refused with a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from shardwork.parallel_state import get_param_meta

__all__ = ["check_blocks", "expert_containers", "own_parameters"]


def own_parameters(
    module: nn.Module, is_unit: Callable[[nn.Module], bool]
) -> list[tuple[str, nn.Parameter]]:
    """Parameters below ``module`` that no unit below it (``is_unit``) already owns."""
    found: list[tuple[str, nn.Parameter]] = []

    def walk(m: nn.Module, prefix: str) -> None:
        for name, p in m.named_parameters(recurse=False):
            found.append((prefix + name, p))
        for name, child in m.named_children():
            if not is_unit(child):
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return found


def expert_containers(
    root: nn.Module, is_unit: Callable[[nn.Module], bool], *, where: str
) -> list[nn.Module]:
    """The largest submodules of ``root`` (not inside another unit) whose parameters are all
    expert parameters. ValueError when a module holds expert and dense parameters directly."""
    containers: list[nn.Module] = []

    def walk(m: nn.Module, path: str) -> None:
        params = [p for _, p in own_parameters(m, is_unit)]
        if m is not root and params and all(get_param_meta(p).is_expert for p in params):
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                # fully_shard needs modules with a forward: a list of experts is grouped by its
                # items (one unit all the same).
                containers.extend(c for c in m.children() if any(True for _ in c.parameters()))
            else:
                containers.append(m)
            return
        direct = list(m.named_parameters(recurse=False))
        kinds = {get_param_meta(p).is_expert for _, p in direct}
        if len(kinds) > 1:
            names = ", ".join(
                f"{n} ({'expert' if get_param_meta(p).is_expert else 'dense'})" for n, p in direct
            )
            raise ValueError(
                f"FullyShardedDataParallel: module {path or where!r} holds expert and dense "
                f"parameters directly ({names}); expert parameters shard over the expert-data-"
                "parallel group and dense ones over dp×cp, so they must live in different "
                "submodules"
            )
        for name, child in m.named_children():
            if not is_unit(child):
                walk(child, f"{path}.{name}" if path else name)

    walk(root, "")
    return containers


def check_blocks(module: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """ValueError unless ``blocks`` are distinct, proper submodules of ``module``, none inside
    another."""
    inside = {id(m) for m in module.modules()}
    seen: set[int] = set()
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise ValueError(f"blocks[{i}] is a {type(block).__name__}; valid: an nn.Module")
        if block is module or id(block) not in inside:
            raise ValueError(
                f"blocks[{i}] ({type(block).__name__}) is not a submodule of the wrapped model; "
                "valid: its transformer layers, e.g. list(model.decoder.layers)"
            )
        if id(block) in seen:
            raise ValueError(f"blocks[{i}] appears twice; valid: each block once")
        seen.add(id(block))
    for i, block in enumerate(blocks):
        nested = [
            j
            for j, other in enumerate(blocks)
            if other is not block and any(m is other for m in block.modules())
        ]
        if nested:
            raise ValueError(
                f"blocks[{nested[0]}] lies inside blocks[{i}]; valid: blocks that do not nest"
            )
