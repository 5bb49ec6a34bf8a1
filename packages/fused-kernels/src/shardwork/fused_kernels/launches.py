"""Count Triton kernel launches, so tests (and users) can prove a kernel ran rather than a fallback.

``with count_launches() as launches: ...`` then ``launches["rms_norm_fwd"]``. Every
Triton launcher of this package calls :func:`record_launch` with its kernel's name.
Counters are only kept while a ``count_launches`` block is open (instrumentation,
not state any op reads).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

__all__ = ["count_launches", "record_launch"]

_lock = threading.Lock()
_open_counters: list[collections.Counter] = []


@contextlib.contextmanager
def count_launches() -> Iterator[collections.Counter]:
    """Open a counter of kernel launches by kernel name for the duration of the block."""
    counter: collections.Counter = collections.Counter()
    with _lock:
        _open_counters.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _open_counters.remove(counter)


def record_launch(name: str) -> None:
    """Note one launch of kernel ``name`` in every open counter."""
    if _open_counters:
        with _lock:
            for counter in _open_counters:
                counter[name] += 1
