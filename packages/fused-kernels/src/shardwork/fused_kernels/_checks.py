"""Input validation shared by the public ops: ``ValueError`` naming the argument, its value and what is valid."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}.dtype={t.dtype} is not supported; valid: float16, bfloat16, float32, float64"
        )


def check_last_dim(name: str, t: torch.Tensor, size: int, what: str) -> None:
    if t.dim() == 0 or t.shape[-1] != size:
        raise ValueError(f"{name}.shape={tuple(t.shape)}: last dim must be {size} ({what})")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Arithmetic dtype of the references: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
