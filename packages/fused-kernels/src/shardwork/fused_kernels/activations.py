"""Gated activations on a fused [gate | up] projection: SwiGLU and GeGLU, with per-token weights.

- Input ``x [..., 2*I]`` holds the gate half first and the up half second (the
  layout of a fused ``gate_up_proj``); output ``act(gate) * up`` has ``[..., I]``.
- ``token_weights [...]`` or ``[..., 1]`` multiplies each token's output (an MoE
  expert applies its routing probability here, so the probability receives a
  gradient without a separate multiply kernel).
- Arithmetic in float32 (float64 for float64 input); output in ``x.dtype``; the token-weight gradient in the
  token weights' dtype.
- GeGLU uses the tanh approximation of GELU by default (as Megatron and TE do);
  ``approximate="none"`` gives the erf form.
- Backends: ``torch`` runs :mod:`~shardwork.fused_kernels.eager_activations` (eager ops, a
  hand-written backward with no concatenation), or under ``torch.compile`` the plain formula
  (inductor fuses it); ``swiglu_reference`` / ``geglu_reference`` are the plain autograd
  formulas the tests hold every backend to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwork.fused_kernels import eager_activations, te_ops
from shardwork.fused_kernels._checks import (
    acc_dtype,
    check_bool,
    check_float,
    check_not_leaf_overwrite,
    check_same_device,
)
from shardwork.fused_kernels.backend import resolve_backend

__all__ = ["geglu", "geglu_reference", "swiglu", "swiglu_reference"]

_APPROXIMATE = ("tanh", "none")


def _weights_column(x: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """``token_weights`` as ``[..., 1]`` matching ``x.shape[:-1]``."""
    if token_weights.shape == x.shape[:-1]:
        return token_weights.unsqueeze(-1)
    return token_weights


def swiglu_reference(x: torch.Tensor, *, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch SwiGLU: ``silu(gate) * up (* token_weights)`` in float32, cast to ``x.dtype``."""
    gate, up = x.to(acc_dtype(x)).chunk(2, dim=-1)
    y = F.silu(gate) * up
    if token_weights is not None:
        y = y * _weights_column(x, token_weights).to(y.dtype)
    return y.to(x.dtype)


def geglu_reference(
    x: torch.Tensor, *, token_weights: torch.Tensor | None = None, approximate: str = "tanh"
) -> torch.Tensor:
    """Plain-torch GeGLU: ``gelu(gate) * up (* token_weights)`` in float32, cast to ``x.dtype``."""
    gate, up = x.to(acc_dtype(x)).chunk(2, dim=-1)
    y = F.gelu(gate, approximate=approximate) * up
    if token_weights is not None:
        y = y * _weights_column(x, token_weights).to(y.dtype)
    return y.to(x.dtype)


def _validate(x: torch.Tensor, token_weights: torch.Tensor | None, inplace_backward: bool) -> None:
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"x.shape={tuple(x.shape)}: last dim must be even ([gate | up] halves of 2*I)"
        )
    check_bool("inplace_backward", inplace_backward)
    # Refused on every backend (as apply_rotary's inplace=True is): the flag promises that x's
    # storage may take the gradient, which a parameter or a user's input cannot give.
    check_not_leaf_overwrite("inplace_backward", "x", x, inplace_backward)
    if token_weights is not None:
        check_float("token_weights", token_weights)
        lead = tuple(x.shape[:-1])
        if tuple(token_weights.shape) not in (lead, (*lead, 1)):
            raise ValueError(
                f"token_weights.shape={tuple(token_weights.shape)}: must be {lead} or {(*lead, 1)}"
            )
        check_same_device(x=x, token_weights=token_weights)


def swiglu(
    x: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    inplace_backward: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """SwiGLU of the fused projection ``x [..., 2*I]`` -> ``[..., I]``, times ``token_weights`` if given.

    ``inplace_backward=True``: the torch backend writes the input gradient into ``x``'s own
    storage (for an ``x`` nothing else reads, e.g. an MLP's fc1 output; one backward only).
    The other backends allocate the gradient as usual; results are the same. Every backend
    refuses it (ValueError) on a leaf that requires grad, whose values must survive backward.
    """
    _validate(x, token_weights, inplace_backward)
    chosen = resolve_backend("swiglu", backend, x.device, dtype=x.dtype)
    if chosen == "triton":
        from shardwork.fused_kernels import triton_activations

        return triton_activations.glu(x, token_weights, kind="swiglu")
    if chosen == "te":
        return te_ops.glu(x, token_weights, kind="swiglu")
    if torch.compiler.is_compiling():
        # Traced by torch.compile: the plain formula, which inductor fuses (the hand-written
        # backward's out= views into one buffer would break the graph).
        return swiglu_reference(x, token_weights=token_weights)
    return eager_activations.glu(x, token_weights, kind="swiglu", inplace_backward=inplace_backward)


def geglu(
    x: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    approximate: str = "tanh",
    inplace_backward: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """GeGLU of the fused projection ``x [..., 2*I]`` -> ``[..., I]``, times ``token_weights`` if given.

    ``inplace_backward``: as for :func:`swiglu`.
    """
    _validate(x, token_weights, inplace_backward)
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate={approximate!r}; valid: {', '.join(_APPROXIMATE)}")
    chosen = resolve_backend("geglu", backend, x.device, dtype=x.dtype)
    if chosen == "triton":
        from shardwork.fused_kernels import triton_activations

        kind = "geglu_tanh" if approximate == "tanh" else "geglu_erf"
        return triton_activations.glu(x, token_weights, kind=kind)
    if chosen == "te":
        if approximate != "tanh":
            raise ValueError("backend='te' offers GeGLU with approximate='tanh' only")
        return te_ops.glu(x, token_weights, kind="geglu")
    if torch.compiler.is_compiling():  # as in swiglu
        return geglu_reference(x, token_weights=token_weights, approximate=approximate)
    kind = "geglu_tanh" if approximate == "tanh" else "geglu_erf"
    return eager_activations.glu(x, token_weights, kind=kind, inplace_backward=inplace_backward)
