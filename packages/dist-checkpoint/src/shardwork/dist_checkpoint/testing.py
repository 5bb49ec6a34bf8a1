"""Test helpers: a small example state, tensors of awkward layouts and a save that is killed
at a fault point.

- `example_state(rank, world, ...)`: a sharded state dict with a row-sharded matrix, a tensor
  replicated on every rank, ZeRO-style flat shards and per-rank objects; values are a function
  of ``seed`` only (on any x86-64 CPU), so any layout can be checked against `example_global`.
- `run_killed_save(...)`: starts ``world_size`` fresh processes (forkserver, torch preloaded)
  that save through a `CheckpointManager` with ``SHARDWORK_CKPT_FAULT`` set, waits until a
  process dies of SIGKILL at the fault point, then kills the survivors (they block in a
  collective waiting for the dead rank), as a job launcher would.
- `TENSOR_CASES`: tensors whose dtype, shape or memory layout a ``torch.save``-format blob
  parser (`blob`) and writer (`archive`) must both get right, shared so that a case added
  once is checked on both sides; `seeded` is the generator their values come from.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_checkpoint.faults import FAULT_ENV
from shardwork.dist_checkpoint.manager import CheckpointManager
from shardwork.dist_checkpoint.sharded import ShardedObject, ShardedTensor

__all__ = ["TENSOR_CASES", "example_global", "example_state", "run_killed_save", "seeded"]

_ROWS, _COLS = 8, 6
_FLAT_SHAPE = (5, 7)


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``, so test values are a function of the seed only."""
    return torch.Generator().manual_seed(seed)


#: Name -> function making a fresh tensor: dtypes of other item sizes, a transposed view, a
#: block with a storage offset and non-contiguous rows, a 0-d and a 3-d tensor (seeds 1-7).
TENSOR_CASES: dict[str, Callable[[], torch.Tensor]] = {
    "float32": lambda: torch.randn(7, 5, generator=seeded(1)),
    "bfloat16": lambda: torch.randn(3, 9, generator=seeded(2)).to(torch.bfloat16),
    "transposed": lambda: torch.randn(6, 4, generator=seeded(3)).t(),
    "slice_with_offset": lambda: torch.randn(10, 8, generator=seeded(4))[3:7, 2:5],
    "zero_dim": lambda: torch.randn((), generator=seeded(5)),
    "bool": lambda: torch.randn(5, 3, generator=seeded(6)) > 0,
    "int64_3d": lambda: torch.randint(-9, 9, (2, 3, 4), generator=seeded(7)),
}


def example_global(seed: int) -> dict[str, torch.Tensor]:
    """Global float32 tensors of `example_state` for ``seed``: N(0, 1) drawn in float64 and
    rounded, so the values are the same on every x86-64 CPU. (torch draws float32 normals of 16
    or more elements on a vectorised path where the CPU has AVX2 and a scalar one elsewhere,
    whose last bits differ; its float64 draws take one path on all of them.)"""
    gen = seeded(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float()

    return {
        "matrix": normal(_ROWS, _COLS),
        "replicated": normal(11),
        "moment": normal(*_FLAT_SHAPE),
    }


def example_state(rank: int, world: int, *, seed: int, fill: bool = True) -> dict[str, Any]:
    """This rank's sharded state dict; ``fill=False`` gives a NaN template of the same layout.

    ``world`` must divide 8 (the matrix rows)."""
    if _ROWS % world:
        raise ValueError(f"world={world} is not valid; valid: a divisor of {_ROWS}")
    g = example_global(seed)

    def data(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if fill else torch.full_like(t, float("nan"))

    rows = _ROWS // world
    numel = g["moment"].numel()
    start, stop = numel * rank // world, numel * (rank + 1) // world
    return {
        "model": {
            "matrix": ShardedTensor.from_rank_offsets(
                "matrix", data(g["matrix"][rank * rows : (rank + 1) * rows]), (0, rank, world)
            ),
            "replicated": ShardedTensor.from_rank_offsets(
                "replicated", data(g["replicated"]), replica_id=rank
            ),
        },
        "optimizer": {
            "moment": ShardedTensor.from_flattened(
                "moment",
                data(g["moment"].flatten()[start:stop]),
                local_shape=_FLAT_SHAPE,
                global_shape=_FLAT_SHAPE,
                global_offset=(0, 0),
                flattened_range=(start, stop),
            ),
            "step": seed,
        },
        "rng": ShardedObject(
            "rng", {"rank": rank, "seed": seed} if fill else None, (world,), (rank,)
        ),
    }


def _child(root: str, step: int, rank: int, world: int, store_path: str, fault: str) -> None:
    os.environ[FAULT_ENV] = fault
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    manager = CheckpointManager(root)
    manager.save(step, example_state(rank, world, seed=step))
    dist.destroy_process_group()


def run_killed_save(
    root: str, step: int, *, world_size: int, fault: str, timeout: float = 180.0
) -> list[int | None]:
    """Save ``example_state(seed=step)`` as ``step`` on ``world_size`` new processes with
    ``SHARDWORK_CKPT_FAULT=fault``; return each process's exit code as it was before the
    survivors were killed: ``-SIGKILL`` for a rank that killed itself at the fault point,
    None for a rank still running (blocked on the dead one), 1 for a rank whose collective
    failed on the closed connection, 0 only if a save completed."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint"])
    with tempfile.TemporaryDirectory(prefix="shardwork-fault-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(root, step, r, world_size, store_path, fault))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.exitcode is not None for p in procs):
                break
            time.sleep(0.05)
        time.sleep(0.5)  # let ranks reaching the same fault point get there
        own = [p.exitcode for p in procs]
        for p in procs:
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=10)
        return own
