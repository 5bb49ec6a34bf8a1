"""Run a function on N real gloo ranks from a pytest test.

Example::

    import pytest
    import torch.distributed as dist
    from shardwork.parallel_state.testing import run_on_ranks

    def _sum_of_ranks():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    @pytest.mark.multirank
    def test_all_reduce():
        assert run_on_ranks(_sum_of_ranks, world_size=4) == [6.0] * 4

The function must live at module level. Inside it the default process group
is initialised (gloo, this call's ranks only) and torch uses one intra-op
thread. Its return value must be picklable; each rank's value is returned in
rank order. A failing rank's traceback is re-raised as :class:`RankFailedError`;
ranks that hang past ``timeout`` seconds are killed and reported by
:class:`RankTimeoutError`. The rank processes are pooled per test process.

:func:`assert_close_at_scale` compares float results at fp32 (or the given dtype's) rounding
of the tensor's own scale and integer results exactly, so golden and cross-implementation
checks hold on any CPU (see ``tolerance.py``).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Sequence
from typing import Any

from shardwork.parallel_state.testing.pool import RankFailedError, RankPool, RankTimeoutError
from shardwork.parallel_state.testing.tolerance import (
    assert_close_at_scale,
    scale_atol,
    ulps_of_scale,
)

__all__ = [
    "RankFailedError",
    "RankTimeoutError",
    "assert_close_at_scale",
    "run_on_ranks",
    "scale_atol",
    "shutdown_pool",
    "ulps_of_scale",
]

_pool: RankPool | None = None


def _shared_pool() -> RankPool:
    global _pool
    if _pool is None:
        _pool = RankPool()
        atexit.register(shutdown_pool)
    return _pool


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results in rank order."""
    return _shared_pool().run(fn, world_size, args=args, kwargs=kwargs, timeout=timeout)


def shutdown_pool() -> None:
    """Stop the pooled rank processes (called automatically at exit)."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None
