"""Autograd pieces of the router's front end.

- ``GatingLinear``: logits = x Wᵀ (+ b) in a chosen router dtype (fp32/fp64 whatever the
  model dtype). It saves x and W as given (no upcast copies kept for backward) and computes
  dW directly in W's [E, H] layout, dx in x's dtype.
- ``StraightThroughRandom``: replaces logits by standard-normal noise (balanced random
  routing for benchmarks) while passing the gradient through unchanged.
"""

from __future__ import annotations

import torch


class GatingLinear(torch.autograd.Function):
    """logits = x @ W^T (+ b) in the router dtype; saves x and W as given (no upcast copies
    kept alive) and writes dW directly in W's [E, H] layout."""

    @staticmethod
    def forward(ctx, x_TH, weight_EH, bias_E, dtype):
        ctx.save_for_backward(x_TH, weight_EH)
        ctx.dtype, ctx.has_bias, ctx.bias_dtype = dtype, bias_E is not None, None
        w = weight_EH.to(dtype)
        if bias_E is None:
            return torch.mm(x_TH.to(dtype), w.t())
        ctx.bias_dtype = bias_E.dtype
        return torch.addmm(bias_E.to(dtype), x_TH.to(dtype), w.t())

    @staticmethod
    def backward(ctx, grad_TE):
        x_TH, weight_EH = ctx.saved_tensors
        grad_TE = grad_TE.to(ctx.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad_TE, weight_EH.to(ctx.dtype)).to(x_TH.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(grad_TE.t(), x_TH.to(ctx.dtype)).to(weight_EH.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_TE.sum(dim=0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


class StraightThroughRandom(torch.autograd.Function):
    """Forward: standard-normal noise shaped like the logits; backward: identity."""

    @staticmethod
    def forward(ctx, logits, generator):
        return torch.randn(
            logits.shape, dtype=logits.dtype, device=logits.device, generator=generator
        )

    @staticmethod
    def backward(ctx, grad):
        return grad, None
