"""The CPU runtime ``shardwork-train`` and ``shardwork-generate`` set up before torch loads.

Torch-free: the settings below are read by OpenMP when torch loads and by torch's CPU
allocator at its first large allocation, so they must be in place before either. A setting the
user already made wins, whatever its value.

- ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning.
- ``THP_MEM_ALLOC_ENABLE=1`` where the kernel offers transparent huge pages.
- glibc's allocator keeps freed memory for reuse (:func:`reuse_freed_memory`).

Each item's measured effect is in its function's docstring and in ``docs/trainer.md``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["huge_pages_offered", "reuse_freed_memory", "set_cpu_runtime_env"]

THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# mallopt parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Free memory at the top of the heap beyond this goes back to the kernel (mallopt takes an int).
TRIM_THRESHOLD_BYTES = 2**31 - 1
# glibc's own switches for what reuse_freed_memory changes: any of them set means "leave it".
GLIBC_MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def set_cpu_runtime_env(thp_mode_file: Path = THP_MODE_FILE) -> dict[str, object]:
    """Set what torch reads when it loads or first allocates, before either; an explicit
    setting in the environment wins. Returns the settings in force (for a benchmark's record).

    - ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning. On a CPU
      shared with other processes, spinning intra-op threads made a training step 4x slower
      (6.6 s vs 1.6 s measured on a loaded 2-core machine). On an idle machine sleeping has a
      price: each parallel op wakes the other threads (a small op 50 us instead of 4 us), and
      150 demo steps take 26.3 s against 24.2-24.9 s with a short spin (``GOMP_SPINCOUNT``
      1000-10000) or 21.7 s spinning without bound; but with two busy processes on the two
      cores the short spin costs 15-29 % (42.0 s passive, 48.4-54.1 s) and unbounded spinning
      2.3x (``benchmarks/results/openmp_wait.md``). Passive is the default that never loses
      much; on a machine of its own, ``GOMP_SPINCOUNT=3000`` or ``OMP_WAIT_POLICY=ACTIVE`` in
      the environment is faster.
    - ``THP_MEM_ALLOC_ENABLE=1`` where the kernel offers transparent huge pages
      (:func:`huge_pages_offered`): torch's CPU allocator then puts tensors of 2 MiB and more on
      2 MiB pages, so a fresh tensor's first write no longer faults in 4 KiB pages one by one.
    - :func:`reuse_freed_memory`.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if huge_pages_offered(thp_mode_file):
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return {
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "reuse_freed_memory": reuse_freed_memory(),
    }


def huge_pages_offered(thp_mode_file: Path = THP_MODE_FILE) -> bool:
    """Whether a process may ask for transparent huge pages: the kernel's mode is ``[always]``
    or ``[madvise]`` (``[never]``, or no such file, e.g. not Linux: no)."""
    try:
        mode = thp_mode_file.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def reuse_freed_memory() -> bool:
    """Make glibc's ``malloc`` serve every block from its heap and keep what is freed there;
    returns whether it did (False off glibc, or where a ``MALLOC_*`` variable of
    :data:`GLIBC_MALLOC_VARIABLES` is set: the user's choice stands).

    By default glibc maps each block above its mmap threshold (at most 32 MiB) fresh from the
    kernel and unmaps it on free, so every training step pays page faults and zeroing again
    for its large activations and gradients: a fresh ``[4096, 3584]`` float32 tensor's
    allocate-and-fill took 17.9 ms (3.9 ms on huge pages) against 1.3 ms for memory reused
    from the heap; with huge pages, even 6 MB tensors paid 3 ms each (the kernel zeroes and
    compacts 2 MiB pages at every fault). ``M_MMAP_MAX=0`` takes every block from the heap,
    and a 2 GiB ``M_TRIM_THRESHOLD`` keeps freed memory there, so from the second step on a
    step's allocations reuse the first step's memory. The demo run (``shardwork-train``, 300
    steps) took 42 s instead of 68 s; its peak resident memory rose 890 -> 1,050 MB (freed
    blocks do not always fit the next request), and the heap no longer shrinks after a peak
    unless over 2 GiB of its top is free.
    """
    if any(name in os.environ for name in GLIBC_MALLOC_VARIABLES):
        return False
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success, 0 for a value it refuses.
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _glibc() -> ctypes.CDLL | None:
    """The running process's C library where it is glibc (whose ``mallopt`` this module
    calls), else None."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
    except (AttributeError, ValueError, OSError):  # not a POSIX system, or no such name
        return None
    return ctypes.CDLL(None)
