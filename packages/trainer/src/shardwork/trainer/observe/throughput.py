"""Tokens/s, model FLOPs utilisation and memory.

- MFU = achieved model FLOP/s ÷ peak FLOP/s of the hardware for all ranks.
  Model FLOPs per token come from shardwork.models' FLOPs calculator (never
  estimated here). The peak is ``logging.peak_tflops`` per device when set;
  on CUDA a table of known accelerators (dense bf16/fp16); on a CPU a
  one-off measurement of this process's fp32 matmul rate (stated as such),
  since a CPU has no datasheet number torch can read.
- Memory: CUDA max allocated on GPUs, the process's peak RSS on CPU.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

_GPU_PEAK_TFLOPS = {  # dense bf16/fp16 tensor-core peaks, per device
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
    "B200": 2250.0,
    "GB200": 2500.0,
}


def measured_cpu_matmul_tflops(size: int = 512, repeats: int = 8) -> float:
    """fp32 matmul rate of this process (TFLOP/s), measured once (~0.1 s)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    elapsed = time.perf_counter() - start
    return 2 * size**3 * repeats / elapsed / 1e12


def peak_tflops(device: torch.device, *, override: float | None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number comes from)."""
    if override is not None:
        return override, "logging.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"datasheet {key} dense bf16"
        return measured_cpu_matmul_tflops(2048, 10), f"measured fp32 matmul on {name}"
    return measured_cpu_matmul_tflops(), "measured fp32 matmul on this CPU"


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated, or CPU max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20
