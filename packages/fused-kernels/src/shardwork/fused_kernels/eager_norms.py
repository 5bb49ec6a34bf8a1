"""RMSNorm for the torch backend: eager torch ops with a hand-written backward.

Autograd through the reference (``norms.rms_norm_reference``) runs about nine elementwise
passes over ``[..., H]`` in backward (the product rule through ``x · rstd``, ``rsqrt``, the
mean's expand-and-divide, ``pow``'s ``2·x``, then the sum of the two input-gradient terms) and
keeps both ``x`` and ``x̂`` alive. The closed form needs five:

    x̂ = x · rstd,  g_w = dy · w,  dw = Σ_rows dy · x̂,
    dx = rstd · (g_w - x̂ · mean(g_w · x̂))

- Forward is the reference's, operation for operation (same output bits); only ``x̂`` and
  ``rstd`` are saved.
- Backward reorders the reference's sums (the mean of ``g_w · x̂`` instead of the sum of
  ``g_w · x`` scaled by ``rstd³ / H``, and a fused multiply-subtract): the input gradient
  differs from autograd's by rounding only; ``dw`` is the reference's sum exactly.
- Arithmetic in float32 (float64 for float64 input); gradients in the inputs' dtypes.
- ``zero_centered_gamma``: the scale is ``1 + weight``; ``dweight`` is the scale's gradient.
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels._checks import acc_dtype

__all__ = ["rms_norm"]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma):
        xf = x.to(acc_dtype(x))
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        scale = weight.to(xf.dtype) + 1.0 if zero_centered_gamma else weight.to(xf.dtype)
        x_hat = xf * rstd
        ctx.save_for_backward(x_hat, rstd, scale)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.weight_shape = weight.shape
        return (x_hat * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_hat, rstd, scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dy = dy.to(x_hat.dtype)
        dweight = None
        if ctx.needs_input_grad[1]:
            # Autograd's reduction of the broadcast product (sum over every leading dim).
            dweight = (dy * x_hat).sum_to_size(ctx.weight_shape).to(w_dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy * scale
            # mean(g_w · x̂) per row: the projection of g_w on x̂ that normalisation removes.
            proj = (dx * x_hat).mean(dim=-1, keepdim=True)
            dx.addcmul_(x_hat, proj, value=-1.0).mul_(rstd)
            dx = dx.to(x_dtype)
        return dx, dweight, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float, zero_centered_gamma: bool
) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` with ``weight [H]`` (validated by the caller)."""
    return _RMSNorm.apply(x, weight, eps, zero_centered_gamma)
