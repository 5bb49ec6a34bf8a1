"""Rotary embedding for the torch backend: eager torch ops with a hand-written backward.

The reference (``rotary.apply_rotary_reference``) builds ``rotate(x)`` with a negation and a
``cat`` (``stack`` when interleaved), adds two full products, and ``cat``s the pass-through
channels back; autograd then differentiates the tables too. Here each half of every rotation
pair ``(a, b)`` (the two halves of the rotary dim, or even and odd channels when interleaved)
is written straight into the output:

    out_a = a·c_a - b·s_a,    out_b = b·c_b + a·s_b

and the backward is the transposed rotation, written the same way into the input gradient:

    dx_a = dy_a·c_a + dy_b·s_b,    dx_b = dy_b·c_b - dy_a·s_a

- Each element is the reference's arithmetic (one product per term, then one add or
  subtract; ``x + (-y)`` is ``x - y`` exactly in IEEE arithmetic), so outputs and gradients
  equal the reference's bit for bit; only fewer passes and no concatenation.
- The tables are constants: no gradient flows to ``cos``/``sin`` (as in the Triton backend),
  and only they are saved for backward.
- Arithmetic in float32 (float64 for float64 input); output and gradient in ``x.dtype``.
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels._checks import acc_dtype

__all__ = ["rotary"]


def _pairs(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the first and second member of every rotation pair along the last dim."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    first, second = t.chunk(2, dim=-1)
    return first, second


def _rotate_into(out, x, cos, sin, *, interleaved: bool, transpose: bool) -> None:
    """``out = x·cos + rotate(x)·sin`` (or its transpose) on ``[..., R]`` views."""
    a, b = _pairs(x, interleaved)
    c_a, c_b = _pairs(cos, interleaved)
    s_a, s_b = _pairs(sin, interleaved)
    out_a, out_b = _pairs(out, interleaved)
    if transpose:
        # The transpose of the rotation: each pair member takes the other's sine.
        torch.mul(a, c_a, out=out_a).add_(b * s_b)
        torch.mul(b, c_b, out=out_b).sub_(a * s_a)
    else:
        torch.mul(a, c_a, out=out_a).sub_(b * s_a)
        torch.mul(b, c_b, out=out_b).add_(a * s_b)


def _apply(x, cos, sin, *, interleaved: bool, transpose: bool) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x``; the rest pass through."""
    rotary_dim = cos.shape[-1]
    acc = acc_dtype(x)
    # [..., R] -> [..., 1, R]: the same table row for every head.
    c, s = cos.unsqueeze(-2).to(acc), sin.unsqueeze(-2).to(acc)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rotated = out[..., :rotary_dim]
    target = rotated if x.dtype == acc else torch.empty(rotated.shape, dtype=acc, device=x.device)
    _rotate_into(
        target, x[..., :rotary_dim].to(acc), c, s, interleaved=interleaved, transpose=transpose
    )
    if target is not rotated:
        rotated.copy_(target)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:].copy_(x[..., rotary_dim:])
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        ctx.interleaved = interleaved
        ctx.save_for_backward(cos, sin)
        return _apply(x, cos, sin, interleaved=interleaved, transpose=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dx = _apply(dy, cos, sin, interleaved=ctx.interleaved, transpose=True)
        return dx, None, None, None


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of ``x [..., heads, head_dim]`` (validated by the caller), a new tensor."""
    return _Rotary.apply(x, cos, sin, interleaved)
