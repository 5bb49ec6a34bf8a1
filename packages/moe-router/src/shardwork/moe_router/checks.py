"""Argument checks shared by :class:`RouterConfig` and the public routing functions.

One rule, one place: ``RouterConfig`` checks its fields with these at construction, and the
pure functions (``topk_routing``, ``group_limited_topk``, ``expert_capacity``,
``drop_to_capacity``, ...) check their arguments with the same rules before any work, so a
function called directly refuses what a config would refuse. ``owner`` prefixes every
message: ``"RouterConfig."`` for a field, ``"topk_routing: "`` for a function argument.
Only Python values and tensor shapes are read here: no check costs a host-device sync.
"""

from __future__ import annotations

import math

import torch


def is_int(value: object) -> bool:
    """A real integer (``True`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float (``True`` is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """A number that is neither infinite nor NaN."""
    return is_number(value) and math.isfinite(value)


def check_bool(owner: str, name: str, value: object) -> None:
    """TypeError unless ``value`` is ``True`` or ``False`` (the string ``"False"`` is true)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner}{name}={value!r} is invalid: it must be True or False "
            f"(got {type(value).__name__})"
        )


def check_tensor(owner: str, name: str, value: object, *, dims: int | None = None) -> None:
    """TypeError unless ``value`` is a tensor; ValueError unless it has ``dims`` dimensions."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{owner}{name} is invalid: it must be a torch.Tensor (got {type(value).__name__})"
        )
    if dims is not None and value.dim() != dims:
        raise ValueError(
            f"{owner}{name} of shape {tuple(value.shape)} is invalid: it must have {dims} "
            "dimensions"
        )


def check_same_shape(
    owner: str, name: str, value: object, like_name: str, like: torch.Tensor
) -> None:
    """TypeError unless ``value`` is a tensor; ValueError unless it has the shape of the tensor
    ``like`` (the argument ``like_name``), e.g. gate weights beside up weights."""
    check_tensor(owner, name, value)
    if value.shape != like.shape:
        raise ValueError(
            f"{owner}{name} of shape {tuple(value.shape)} is invalid: it must have "
            f"{like_name}'s shape {tuple(like.shape)}"
        )


def check_top_k(owner: str, top_k: object, num_experts: int) -> None:
    """``top_k`` must be an integer from 1 to ``num_experts``."""
    if not is_int(top_k) or top_k < 1:
        raise ValueError(f"{owner}top_k={top_k!r} is invalid: it must be an integer >= 1")
    if top_k > num_experts:
        raise ValueError(
            f"{owner}top_k={top_k} is invalid: it must be <= num_experts={num_experts}"
        )


def check_groups(
    owner: str,
    *,
    num_experts: int,
    top_k: int,
    num_groups: object,
    group_top_k: object,
    group_score_top_n: object,
) -> None:
    """Group-limited routing: both of ``num_groups`` / ``group_top_k`` or neither; equal
    groups; ``group_top_k <= num_groups``; enough kept experts for the top-k; a group score
    ``group_score_top_n`` from 1 to the experts per group (see :class:`RouterConfig`)."""
    if (num_groups is None) != (group_top_k is None):
        raise ValueError(
            f"{owner}num_groups={num_groups!r} and group_top_k={group_top_k!r}: "
            "group-limited routing needs both set (or both None)"
        )
    if num_groups is None:
        if group_score_top_n is not None:
            raise ValueError(
                f"{owner}group_score_top_n={group_score_top_n!r} is invalid without "
                "group-limited routing: set num_groups and group_top_k, or leave it None"
            )
        return
    for name, value in (("num_groups", num_groups), ("group_top_k", group_top_k)):
        if not is_int(value) or value < 1:
            raise ValueError(
                f"{owner}{name}={value!r} is invalid: it must be None or an integer >= 1"
            )
    if num_experts % num_groups != 0:
        raise ValueError(
            f"{owner}num_groups={num_groups} is invalid: num_experts={num_experts} must be "
            "divisible by it"
        )
    if group_top_k > num_groups:
        raise ValueError(
            f"{owner}group_top_k={group_top_k} is invalid: it must be <= num_groups={num_groups}"
        )
    _check_group_split(owner, num_experts // num_groups, top_k, group_top_k, group_score_top_n)


def _check_group_split(
    owner: str, per_group: int, top_k: int, group_top_k: int, group_score_top_n: object
) -> None:
    """Megatron's group score (``group_score_top_n=None``) takes ``top_k / group_top_k``
    experts per group, so it needs a whole number; an explicit group score (transformers'
    top-2 rule, e.g. DeepSeek-style top-6 of 4 kept groups) only needs enough eligible
    experts for the top-k."""
    if group_score_top_n is None:
        if top_k % group_top_k != 0 or top_k // group_top_k > per_group:
            raise ValueError(
                f"{owner}group_top_k={group_top_k} is invalid with top_k={top_k}: with "
                "group_score_top_n=None (Megatron's group score) top_k must be a multiple of "
                f"group_top_k and top_k/group_top_k <= experts per group ({per_group}); or "
                "set group_score_top_n"
            )
        return
    if top_k > group_top_k * per_group:
        raise ValueError(
            f"{owner}top_k={top_k} is invalid: group_top_k={group_top_k} groups of "
            f"{per_group} experts leave only {group_top_k * per_group} to choose from"
        )
    n = group_score_top_n
    if not is_int(n) or not 1 <= n <= per_group:
        raise ValueError(
            f"{owner}group_score_top_n={n!r} is invalid: it must be None or an integer from 1 "
            f"to the experts per group ({per_group})"
        )


def check_capacity_factor(owner: str, capacity_factor: object) -> None:
    """A finite number > 0 (no dropping at all is ``RouterConfig.capacity_factor=None``)."""
    if not is_finite_number(capacity_factor) or capacity_factor <= 0:
        raise ValueError(
            f"{owner}capacity_factor={capacity_factor!r} is invalid: it must be a finite number > 0"
        )
