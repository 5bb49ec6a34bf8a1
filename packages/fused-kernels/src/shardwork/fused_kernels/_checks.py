"""Input validation shared by the public ops: an exception naming the argument, its value and
what is valid, raised before any work.

- Tensors: ``ValueError`` for a wrong dtype or shape (the package's style since its first ops).
- Python numbers and flags: ``TypeError`` when the type is wrong (``eps="1e-5"``, a bool where a
  number belongs, ``inplace_backward="False"``), then ``ValueError`` for a wrong value.
- Checks that read tensor values (labels in range, indices below a row count) are exact on CPU
  tensors; on other devices they are device-side asserts (:func:`torch._assert_async`), which
  cost no host-device sync and stop the program at a later synchronisation, or they are
  skipped where the caller says so.
"""

from __future__ import annotations

import math
import numbers

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


def check_number(name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is a real number: an int or a float, not a bool or a str."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}={value!r} must be a number (int or float), not {type(value).__name__}"
        )


def check_int(name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is an int (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int, not {type(value).__name__}")


def check_bool(name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is True or False (``"False"`` and 0 are not)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name}={value!r} must be a bool (True or False), not {type(value).__name__}"
        )


def check_positive(name: str, value: object) -> None:
    """A finite number > 0 (an epsilon, a cap, a scale): ``TypeError`` or ``ValueError``."""
    check_number(name, value)
    if not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


def check_fraction(name: str, value: object) -> None:
    """A number in ``[0, 1)`` (label smoothing's ε)."""
    check_number(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} must be in [0, 1)")


def check_not_leaf_overwrite(flag: str, name: str, t: torch.Tensor, overwrite: bool) -> None:
    """``ValueError`` when ``flag=True`` would write over ``t`` although ``t`` is a leaf that
    requires grad (a parameter or a user's input, whose values must survive backward)."""
    if overwrite and t.is_leaf and t.requires_grad:
        raise ValueError(
            f"{flag}=True on {name}, a leaf tensor that requires grad: its backward would "
            f"overwrite {name}'s values; use {flag}=False, or pass a non-leaf (a layer's output)"
        )


def check_labels(
    labels: torch.Tensor, *, ignore_index: int, num_classes: int, classes: str
) -> None:
    """Every label is ``ignore_index`` or in ``[0, num_classes)`` (``classes`` says where that
    count comes from). Exact on CPU tensors (``ValueError`` naming the first bad label and its
    position); a device-side assert elsewhere and while ``torch.compile`` traces (no host sync)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    valid = f"valid: ignore_index={ignore_index} or 0 <= label < {num_classes} ({classes})"
    if labels.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"labels: a label is out of range; {valid}")
        return
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(f"labels[{position}]={int(labels[position])} is out of range; {valid}")


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Arithmetic dtype of the references: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
