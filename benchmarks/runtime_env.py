"""shardwork-train's CPU runtime environment for a benchmark process; import it before torch.

It sets what ``shardwork-train`` sets before torch loads
(``shardwork.trainer.cpu_runtime.set_cpu_runtime_env``): idle OpenMP threads sleep instead of
spinning (spin-waiting slowed every side's small blocks ~10x on the shared 2-core machine),
torch's CPU tensors from 2 MiB sit on transparent huge pages where the kernel offers them, and
glibc's allocator reuses freed memory instead of mapping every large block afresh. Every side
of a benchmark runs in the same process, so every side gets the same environment. An explicit
setting wins (e.g. ``THP_MEM_ALLOC_ENABLE=0``, or any ``MALLOC_*`` variable of glibc's).
"""

from __future__ import annotations

from shardwork.trainer.cpu_runtime import set_cpu_runtime_env  # torch-free

RUNTIME_ENV = set_cpu_runtime_env()
"""The settings in force, for the results' records."""
