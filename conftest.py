"""Repository-wide pytest setting: how many workers ``uv run pytest`` (``-n auto``) starts.

xdist's ``auto`` starts one worker per physical core of the machine, whatever the run may use.
Here it is capped twice:

- by the CPUs this process may run on (its affinity mask, e.g. ``taskset -c 0``, and a
  container's cgroup CPU quota): oversubscribed workers hold memory and slow each other
  (measured, the suite pinned to one of the 2 cores: xdist's 2 workers 10 min 17 s, one
  worker 9 min 38 s);
- by the memory free when the run starts. Each worker imports torch and keeps a pool of
  spawned rank processes for the multi-rank tests (``shardwork.parallel_state.testing``), alive
  for the whole run. Measured on the 2-core machine (private memory, ``smaps_rollup``): a
  worker 0.60-0.72 GiB, each rank process 0.40 GiB; pools hold 4 ranks after the common tests
  and 8 after the largest, so a worker holds ~2.2 GiB and up to ~3.9 GiB. One worker per core
  would need more memory than a many-core machine with less than ~4 GiB per core has (32
  cores, 64 GiB: ~70-125 GiB), and the kernel would kill workers mid-run.

``PYTEST_XDIST_AUTO_NUM_WORKERS`` (xdist's own override) and an explicit ``-n N`` still win.

Idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, what
``shardwork-train`` sets too), unless the variable is set: every worker's torch starts one
thread per core, so the workers' threads outnumber the cores, and a spinning thread holds a
core another worker needs. Set here, before any test module imports torch (OpenMP reads it
once, when it loads); the rank processes inherit it. Measured, the whole suite on the 2-core
machine (2 workers), one run each: 379 s wall and 505 s user CPU spinning, 360 s and 438 s
passive. Scheduling only: no result changes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

WORKER_PEAK_BYTES = 4 * 2**30
"""Memory one xdist worker may hold at its peak, with its rank pool (module docstring)."""


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    """The cgroup v2 limit less current use, or None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def available_memory_bytes() -> int | None:
    """Memory this run can use: the smaller of MemAvailable and the cgroup's headroom."""
    known = [m for m in (_meminfo_available(), _cgroup_headroom()) if m is not None]
    return min(known) if known else None


def usable_cpus() -> int | None:
    """CPUs this process may run on: its affinity mask, and the cgroup v2 quota when lower."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def workers_for(cores: int, memory: int | None) -> int:
    """One worker per core, but only as many as ``memory`` holds at their peak (at least 1)."""
    if memory is None:
        return cores
    return max(1, min(cores, memory // WORKER_PEAK_BYTES))


def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    from xdist.plugin import pytest_xdist_auto_num_workers as xdist_auto

    cores = xdist_auto(config)
    cpus = usable_cpus()
    return workers_for(cores if cpus is None else min(cores, cpus), available_memory_bytes())
