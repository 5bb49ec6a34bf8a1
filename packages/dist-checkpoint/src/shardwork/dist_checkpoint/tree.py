"""Walking nested "sharded state dicts" (dicts, lists and tuples of leaves).

- A leaf is a `ShardedTensor`, a `ShardedObject` or any other value ("plain" value).
- A path is the tuple of dict keys / list indices from the root to a leaf. Its first element
  is the leaf's *section* (by convention ``"model"``, ``"optimizer"``, ``"rng"``, ...), which is
  what granular loads filter on.
- `map_leaves` rebuilds the same structure with each leaf replaced, so a loaded state dict has
  exactly the template's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Path", "iter_leaves", "map_leaves", "path_str", "section_of"]

Path = tuple[Any, ...]


def iter_leaves(state: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every leaf in depth-first, insertion order."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from iter_leaves(value, (*prefix, key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from iter_leaves(value, (*prefix, index))
    else:
        yield prefix, state


def map_leaves(state: Any, fn: Callable[[Path, Any], Any], prefix: Path = ()) -> Any:
    """Return a copy of the container structure of ``state`` with ``fn(path, leaf)`` as leaves."""
    if isinstance(state, dict):
        return {key: map_leaves(value, fn, (*prefix, key)) for key, value in state.items()}
    if isinstance(state, list):
        return [map_leaves(value, fn, (*prefix, i)) for i, value in enumerate(state)]
    if isinstance(state, tuple):
        return tuple(map_leaves(value, fn, (*prefix, i)) for i, value in enumerate(state))
    return fn(prefix, state)


def path_str(path: Path) -> str:
    """Human- and JSON-friendly form of a path: ``"optimizer/state/3/exp_avg"``."""
    return "/".join(str(p) for p in path)


def section_of(path: Path) -> str:
    """The top-level key a leaf lives under (``""`` for a bare leaf)."""
    return str(path[0]) if path else ""
