"""Repository-wide pytest setting: how many workers ``uv run pytest`` (``-n auto``) starts.

xdist's ``auto`` starts one worker per physical core of the machine, whatever the run may use.
Here it is capped twice:

- by the CPUs this process may run on (its affinity mask, e.g. ``taskset -c 0``, and the CPU
  quota of its cgroups): oversubscribed workers hold memory and slow each other
  (measured, the suite pinned to one of the 2 cores: xdist's 2 workers 10 min 17 s, one
  worker 9 min 38 s);
- by the memory free when the run starts. Each worker imports torch and keeps a pool of
  spawned rank processes for the multi-rank tests (``shardwork.parallel_state.testing``), alive
  for the whole run. Measured on the 2-core machine (private memory, ``smaps_rollup``): a
  worker 0.60-0.72 GiB, each rank process 0.40 GiB; pools hold 4 ranks after the common tests
  and 8 after the largest, so a worker holds ~2.2 GiB and up to ~3.9 GiB. One worker per core
  would need more memory than a many-core machine with less than ~4 GiB per core has (32
  cores, 64 GiB: ~70-125 GiB), and the kernel would kill workers mid-run. The memory is the
  smaller of ``MemAvailable`` and the headroom of the process's cgroups: its own and every
  ancestor, cgroup v2 or v1 (a systemd unit's ``MemoryMax``, a container's ``--memory``;
  ``MemAvailable`` shows the host's). Measured on this machine (cgroup v1), inside a 6 GiB
  memory cgroup: 2 workers before stop 39, which read only a v2 limit at the root, 1 since.

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


CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
V1_UNLIMITED = 2**62
"""cgroup v1 writes "no limit" as a page-rounded 2^63 - 1; anything this large is none."""


def cgroup_dirs(
    controller: str, root: Path = CGROUP_ROOT, self_file: Path = SELF_CGROUP
) -> list[Path]:
    """The directories holding ``controller``'s limits for this process: its own cgroup and every
    ancestor up to the hierarchy's root, for cgroup v2 (``root``) and v1 (``root/controller``).

    A limit may sit at any level: a systemd unit's ``MemoryMax`` on the process's own cgroup,
    a container's on the root its namespace shows. A cgroup path that is not there (the process
    sees its own cgroup as the root, as in a container) leaves only the root."""
    try:
        lines = self_file.read_text().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path", at the root or, beside v1, under unified/
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
        elif controller in controllers.split(","):
            base = root / controller
        else:
            continue
        if ".." in Path(path).parts:  # a cgroup outside this namespace: only its root shows
            path = "/"
        leaf = base / path.lstrip("/")
        levels = [leaf, *leaf.parents]
        found += [d for d in levels[: levels.index(base) + 1] if d.is_dir()]
    return found


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cgroup_memory_headroom(root: Path = CGROUP_ROOT, self_file: Path = SELF_CGROUP) -> int | None:
    """The smallest ``limit - usage`` over this process's cgroups (v2 ``memory.max`` and
    ``memory.current``, v1 ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``), in bytes;
    None without a limit."""
    headrooms = []
    for d in cgroup_dirs("memory", root, self_file):
        for limit_file, usage_file in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):  # fmt: skip
            limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
            if limit is not None and usage is not None and limit < V1_UNLIMITED:
                headrooms.append(limit - usage)
    return min(headrooms) if headrooms else None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_file: Path = SELF_CGROUP) -> int | None:
    """The smallest CPU quota over this process's cgroups, in whole CPUs rounded up (v2
    ``cpu.max`` "quota period", v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None where no
    level sets one ("max", -1)."""
    quotas = []
    for d in cgroup_dirs("cpu", root, self_file):
        try:
            quota, period = (d / "cpu.max").read_text().split()
            pair = (None if quota == "max" else int(quota), int(period))
        except (OSError, ValueError):
            pair = (_read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us"))
        quota, period = pair
        if quota is not None and quota > 0 and period:
            quotas.append(max(1, math.ceil(quota / period)))
    return min(quotas) if quotas else None


def available_memory_bytes() -> int | None:
    """Memory this run can use: the smaller of MemAvailable and the cgroups' headroom."""
    known = [m for m in (_meminfo_available(), cgroup_memory_headroom()) if m is not None]
    return min(known) if known else None


def usable_cpus() -> int | None:
    """CPUs this process may run on: its affinity mask, and the cgroups' CPU quota when lower."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    quota = cgroup_cpu_quota()
    return count if quota is None else min(count, quota)


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
