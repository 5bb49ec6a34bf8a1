"""Tokens/s, model FLOPs utilisation and memory.

- Achieved model TFLOP/s per device is always reported; model FLOPs per
  token come from shardwork.models' FLOPs calculator (never estimated here).
- MFU = achieved ÷ peak, only when the peak is known: ``logging.peak_tflops``
  when set, else a table of known accelerators (dense bf16). A CPU has no
  datasheet number torch can read, and a matmul measured at start-up on a
  shared machine made MFU swing past 100 %, so on a CPU MFU is reported only
  with ``logging.peak_tflops``.
- Memory: CUDA max allocated on GPUs, the process's peak RSS on CPU.
"""

from __future__ import annotations

import resource
import sys

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


def peak_tflops(device: torch.device, *, override: float | None) -> tuple[float | None, str]:
    """(peak TFLOP/s of one device or None when unknown, where the number comes from)."""
    if override is not None:
        return override, "logging.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"datasheet {key} dense bf16"
        return None, f"unknown peak for {name}"
    return None, "unknown peak for a CPU"


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated, or CPU max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20
