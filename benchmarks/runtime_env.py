"""shardwork-train's CPU runtime environment for a benchmark process; import it before torch.

It sets what ``shardwork-train`` sets before torch loads
(``shardwork.trainer.cli.set_cpu_runtime_env``): idle OpenMP threads sleep instead of spinning
(spin-waiting slowed every side's small blocks ~10x on the shared 2-core machine), and torch's
CPU tensors from 2 MiB sit on transparent huge pages where the kernel offers them. Every side
of a benchmark runs in the same process, so every side gets the same environment. An explicit
setting wins (e.g. ``THP_MEM_ALLOC_ENABLE=0``).
"""

from __future__ import annotations

import os

from shardwork.trainer.cli import set_cpu_runtime_env  # torch-free

set_cpu_runtime_env()

RUNTIME_ENV = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")}
"""The settings in force, for the results' records."""
