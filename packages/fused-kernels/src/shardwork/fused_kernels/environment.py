"""The environment variables fused-kernels reads, checked in one call.

- ``SHARDWORK_KERNEL_BACKEND`` (:data:`~shardwork.fused_kernels.backend.BACKEND_ENV`): the
  process-wide default backend until ``set_default_backend`` is called.
- ``SHARDWORK_CPU_GEMM`` (:data:`~shardwork.fused_kernels.cpu_gemm.CPU_GEMM_ENV`): the library
  of ``"auto"`` float32 CPU products (``auto``, ``mkl`` or ``onednn``).

Neither is read at import, so a bad value cannot make the package unimportable; the first op
that reads one raises ValueError naming it. A program that wants every such mistake before it
starts work calls :func:`environment_problems` first (``shardwork-train`` does, beside its
configuration check).
"""

from __future__ import annotations

from shardwork.fused_kernels.backend import backend_env_problem
from shardwork.fused_kernels.cpu_gemm import cpu_gemm_env_problem

__all__ = ["environment_problems"]


def environment_problems() -> list[str]:
    """One sentence per environment variable of this package set to a value it cannot use
    (variable, value and the valid values); empty when all are unset or valid."""
    return [p for p in (backend_env_problem(), cpu_gemm_env_problem()) if p is not None]
