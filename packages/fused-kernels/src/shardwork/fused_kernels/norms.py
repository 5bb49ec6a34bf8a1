"""RMSNorm and LayerNorm over the last dim: public ops, torch references and backend dispatch.

- Statistics (mean, variance, 1/rms) are computed in float32 (float64 for float64
  input); the output has ``x.dtype``. The weight (and bias) may be float32 beside
  bf16/fp16 activations; their gradients come back in their own dtype.
- ``zero_centered_gamma=True`` stores the scale as ``weight`` with the effective
  scale ``1 + weight`` (weight initialised at zero, decayed towards zero).
- The torch references are differentiable by autograd and are what tests hold every backend
  to; the Triton backend has its own forward and backward kernels (``triton_norms``). The
  torch backend runs RMSNorm through :mod:`~shardwork.fused_kernels.eager_norms` (the
  reference's forward, a closed-form backward with fewer passes; the reference itself under
  ``torch.compile``, which fuses it) and LayerNorm through the reference.
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import eager_norms, te_ops
from shardwork.fused_kernels._checks import (
    acc_dtype,
    check_bool,
    check_float,
    check_last_dim,
    check_positive,
    check_same_device,
)
from shardwork.fused_kernels.backend import resolve_backend

__all__ = ["layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference"]


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """Plain-torch RMSNorm: ``x / sqrt(mean(x²) + eps) * w`` in float32, cast to ``x.dtype``."""
    xf = x.to(acc_dtype(x))
    # RMSNorm (Zhang and Sennrich, 2019): no mean subtraction, scale by 1 / rms.
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.to(xf.dtype) + 1.0 if zero_centered_gamma else weight.to(xf.dtype)
    return (xf * rstd * w).to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """Plain-torch LayerNorm: ``(x - mean) / sqrt(var + eps) * w + b`` in float32, cast to ``x.dtype``."""
    xf = x.to(acc_dtype(x))
    mean = xf.mean(dim=-1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.to(xf.dtype) + 1.0 if zero_centered_gamma else weight.to(xf.dtype)
    y = xc * rstd * w
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def _validate(x, weight, bias, eps, zero_centered_gamma) -> None:
    check_float("x", x)
    check_float("weight", weight)
    if weight.dim() != 1:
        raise ValueError(f"weight.shape={tuple(weight.shape)}: must be 1-D [hidden]")
    check_last_dim("x", x, weight.shape[0], "the hidden size, weight.shape[0]")
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != tuple(weight.shape):
            raise ValueError(
                f"bias.shape={tuple(bias.shape)} must equal weight.shape={tuple(weight.shape)}"
            )
    check_positive("eps", eps)
    check_bool("zero_centered_gamma", zero_centered_gamma)
    check_same_device(x=x, weight=weight, bias=bias)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    zero_centered_gamma: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]`` with scale ``weight [hidden]``; output in ``x.dtype``.

    ``backend``: ``"auto" | "torch" | "triton" | "te"`` or None for the process default.
    """
    _validate(x, weight, None, eps, zero_centered_gamma)
    chosen = resolve_backend("rms_norm", backend, x.device, dtype=x.dtype)
    if chosen == "triton":
        from shardwork.fused_kernels import triton_norms

        return triton_norms.norm(
            x, weight, None, eps=eps, zero_centered_gamma=zero_centered_gamma, rms=True
        )
    if chosen == "te":
        return te_ops.rms_norm(x, weight, eps=eps, zero_centered_gamma=zero_centered_gamma)
    if torch.compiler.is_compiling():  # traced: the plain formula, which inductor fuses
        return rms_norm_reference(x, weight, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return eager_norms.rms_norm(x, weight, eps=eps, zero_centered_gamma=zero_centered_gamma)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """LayerNorm of ``x [..., hidden]`` with ``weight [hidden]`` and optional ``bias [hidden]``."""
    _validate(x, weight, bias, eps, zero_centered_gamma)
    chosen = resolve_backend("layer_norm", backend, x.device, dtype=x.dtype)
    if chosen == "triton":
        from shardwork.fused_kernels import triton_norms

        return triton_norms.norm(
            x, weight, bias, eps=eps, zero_centered_gamma=zero_centered_gamma, rms=False
        )
    if chosen == "te":
        return te_ops.layer_norm(x, weight, bias, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return layer_norm_reference(x, weight, bias, eps=eps, zero_centered_gamma=zero_centered_gamma)
