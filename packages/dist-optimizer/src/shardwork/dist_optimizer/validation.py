"""Argument checks shared by the configs, wrappers and optimizers of this package.

A user mistake must raise before any work, naming the argument and its value and saying
what is valid: TypeError for a wrong type (a string where a number goes, ``"False"`` where a
bool goes: a non-empty string is truthy and would silently act as True), ValueError for a
wrong value. ``label`` is how the message names the argument, e.g. ``"DDPConfig.bucket_size"``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from shardwork.parallel_state import ProcessGroups

__all__ = [
    "check_betas",
    "check_bool",
    "check_int",
    "check_loss_scaler",
    "check_process_groups",
    "check_real",
    "check_type",
    "is_real",
    "option_label",
    "short_repr",
    "with_article",
]

LOSS_SCALER_METHODS = ("update", "state_dict", "load_state_dict")
"""What the optimizers call on a loss scaler besides reading ``.scale``: ``update`` every step,
the other two when saving and loading a checkpoint."""


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` on one line, cut at ``limit`` characters (a wrongly passed tensor or
    optimizer would otherwise print pages into the message)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def with_article(noun: str) -> str:
    """``"a DDPConfig"``, ``"an OptimizerConfig"``."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def is_real(value: Any) -> bool:
    """A real number (int, float, numpy scalar...) that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_bool(label: str, value: Any) -> None:
    """TypeError unless ``value`` is a real bool (``"False"`` would act as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{label}={value!r}; valid: True or False (a bool)")


def check_int(label: str, value: Any, *, minimum: int, allow_none: bool = False) -> None:
    """TypeError unless ``value`` is an int (not a bool; None too with ``allow_none``),
    ValueError if it is below ``minimum``."""
    if value is None and allow_none:
        return
    valid = f"an int >= {minimum}" + (" or None" if allow_none else "")
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{label}={value!r}; valid: {valid}")
    if value < minimum:
        raise ValueError(f"{label}={value!r}; valid: {valid}")


def check_real(
    label: str,
    value: Any,
    *,
    at_least: float | None = None,
    below: float | None = None,
    finite: bool = True,
) -> None:
    """TypeError unless ``value`` is a real number (a string such as ``"1e-3"`` is not),
    ValueError if it is nan, outside ``[at_least, below)`` or (with ``finite``) infinite."""
    kind = "a finite real number" if finite else "a real number"
    if at_least is not None and below is not None:
        valid = f"{kind} in [{at_least}, {below})"
    elif at_least is not None:
        valid = f"{kind} >= {at_least}"
    else:
        valid = kind
    if not is_real(value):
        raise TypeError(f"{label}={value!r}; valid: {valid}")
    in_range = (at_least is None or value >= at_least) and (below is None or value < below)
    if math.isnan(value) or not in_range or (finite and not math.isfinite(value)):
        raise ValueError(f"{label}={value!r}; valid: {valid}")


def check_betas(label: str, betas: Any) -> None:
    """TypeError unless ``betas`` is a tuple or list, ValueError unless it holds two real
    numbers in [0, 1) (Adam's moment decays)."""
    valid = "a pair (beta1, beta2) of finite real numbers in [0, 1)"
    if not isinstance(betas, (tuple, list)):
        raise TypeError(f"{label}={betas!r}; valid: {valid}")
    if len(betas) != 2:
        raise ValueError(f"{label}={betas!r} has {len(betas)} entries; valid: {valid}")
    for i, beta in enumerate(betas):
        check_real(f"{label}[{i}]", beta, at_least=0, below=1)


def option_label(owner: str, name: str, group_index: int | None) -> str:
    """How a message names an optimizer option: ``AdamW.lr`` for the constructor argument,
    ``AdamW.param_groups[1]['lr']`` for a param group's own value."""
    if group_index is None:
        return f"{owner}.{name}"
    return f"{owner}.param_groups[{group_index}][{name!r}]"


def check_type(label: str, value: Any, kind: type, example: str) -> None:
    """TypeError unless ``value`` is None or a ``kind``; ``example`` says how to build one."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(
            f"{label}={short_repr(value)} is {with_article(type(value).__name__)}; valid: "
            f"{with_article(kind.__name__)} ({example}) or None"
        )


def check_process_groups(label: str, value: Any) -> None:
    """TypeError unless ``value`` is None or a :class:`ProcessGroups` bundle (a
    ``ParallelConfig`` describes the groups but is not them)."""
    check_type(
        label,
        value,
        ProcessGroups,
        "what init_process_groups(ParallelConfig(...)) returns, or ProcessGroups.single()",
    )


def check_loss_scaler(label: str, scaler: Any) -> None:
    """TypeError unless ``scaler`` is None or has what the optimizers use: a real ``.scale``
    and callable ``update(found_nonfinite)``, ``state_dict()``, ``load_state_dict(state)``
    (a bare number is not a scaler: wrap it in ``ConstantLossScaler``)."""
    if scaler is None:
        return
    missing = [name for name in LOSS_SCALER_METHODS if not callable(getattr(scaler, name, None))]
    if not is_real(getattr(scaler, "scale", None)):
        missing.insert(0, "scale (a real number)")
    if missing:
        raise TypeError(
            f"{label}={short_repr(scaler)} is {with_article(type(scaler).__name__)} without "
            f"{', '.join(missing)}; "
            "valid: None, a DynamicLossScaler or ConstantLossScaler (e.g. "
            "ConstantLossScaler(2.0) for a fixed scale), or an object with a real .scale and "
            "methods update(found_nonfinite), state_dict() and load_state_dict(state)"
        )
