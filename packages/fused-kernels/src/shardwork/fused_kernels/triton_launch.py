"""Shared helpers of the Triton backend: block sizes, program caps and counted launches.

Imported only when a Triton kernel is about to run (so ``import shardwork.fused_kernels``
never needs Triton). Kernels upcast every load to float32 before arithmetic: bf16
arithmetic is wrong under Triton's CPU interpreter and float32 is what the
statistics need anyway.
"""

from __future__ import annotations

import functools

import torch
import triton

from shardwork.fused_kernels.launches import record_launch

__all__ = ["launch", "max_programs", "next_pow2"]


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def max_programs(device: torch.device, per_sm: int = 4) -> int:
    """Cap on persistent programs: ``per_sm`` per SM on CUDA, 2 under the CPU interpreter."""
    if device.type == "cuda":
        return per_sm * _sm_count(
            device.index if device.index is not None else torch.cuda.current_device()
        )
    return 2


def launch(name: str, kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)`` and record it under ``name`` (see ``launches``)."""
    if all(g > 0 for g in grid):
        record_launch(name)
        kernel[grid](*args, **kwargs)
