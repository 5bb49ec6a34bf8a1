"""SwiGLU / GeGLU for the torch backend: eager torch ops with a hand-written backward.

The reference (``activations.swiglu_reference``) is differentiated by autograd, whose backward
of ``x.chunk(2)`` concatenates the gate and up gradients into a new ``[..., 2I]`` tensor: one
extra read and write of the whole input gradient. Here the backward allocates that gradient
once and writes each half in place (``out=`` views), so nothing is concatenated.

- Same formulas and operation order as the reference: forward ``act(gate) · up (· w)``;
  backward ``dy_w = dy · w``, ``dup = dy_w · act(gate)``, ``dgate = act'(gate) · (dy_w · up)``
  (torch's ``silu_backward`` / ``gelu_backward``), ``dw = Σ_cols dy · act(gate) · up``.
  Results equal the reference's bit for bit, except that an elementwise kernel writing a row
  slice may take its scalar tail path where the reference's contiguous tensor is vectorised
  (``I`` not a multiple of the vector width): a difference of rounding only.
- Arithmetic in float32 (float64 for float64 input); output and input gradient in ``x.dtype``.
- Saved for backward: the (upcast) input and ``act(gate)``, as the reference saves.
- ``inplace_backward=True`` writes the input gradient over the saved input (the fc1 output of
  an MLP, read by nothing else): no ``[..., 2I]`` allocation in backward at all. The saved
  input then no longer holds its values, so a second backward through the same graph fails
  (autograd's check of the saved tensor's version).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwork.fused_kernels._checks import acc_dtype

__all__ = ["glu"]

_KINDS = ("swiglu", "geglu_tanh", "geglu_erf")


def _activation(gate: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "swiglu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh" if kind == "geglu_tanh" else "none")


def _activation_backward(grad: torch.Tensor, gate: torch.Tensor, kind: str, out: torch.Tensor):
    """``out = grad · act'(gate)``, written into the view ``out``."""
    if kind == "swiglu":
        torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=out)
    else:
        approximate = "tanh" if kind == "geglu_tanh" else "none"
        torch.ops.aten.gelu_backward.grad_input(grad, gate, approximate=approximate, grad_input=out)


class _GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, kind, inplace_backward):
        acc = acc_dtype(x)
        xf = x.to(acc)
        gate, up = xf.chunk(2, dim=-1)
        act = _activation(gate, kind)
        y = act * up
        w = None
        if weights is not None:
            w = weights.to(acc)
            # Fresh tensor: multiplying in place saves an allocation, same rounding as y * w.
            y.mul_(w)
        ctx.kind, ctx.x_dtype, ctx.inplace = kind, x.dtype, inplace_backward
        ctx.weights_dtype = None if weights is None else weights.dtype
        ctx.save_for_backward(xf, act, w)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xf, act, w = ctx.saved_tensors
        gate, up = xf.chunk(2, dim=-1)
        dy = dy.to(xf.dtype)
        dweights = scratch = None
        if w is not None:
            if ctx.needs_input_grad[1]:
                # The reference's gradient of ``(act · up) · w`` with respect to w, summed over
                # the broadcast columns (dy · (act · up): the same product, rounded the same).
                scratch = (act * up).mul_(dy)
                dweights = scratch.sum(dim=-1, keepdim=True).to(ctx.weights_dtype)
            dy = dy * w
        dx = None
        if ctx.needs_input_grad[0]:
            # One [..., 2I] buffer, each half written in place (no cat of the halves): a new one,
            # or with inplace_backward the saved input itself, whose values are read before
            # each element is overwritten.
            dx = xf if ctx.inplace else torch.empty_like(xf)
            dgate, dup = dx.chunk(2, dim=-1)
            # dy · up, kept before the up half may be overwritten below.
            scratch = torch.mul(dy, up, out=scratch) if scratch is not None else dy * up
            torch.mul(dy, act, out=dup)
            _activation_backward(scratch, gate, ctx.kind, dgate)
            dx = dx.to(ctx.x_dtype)
        return dx, dweights, None, None


def glu(
    x: torch.Tensor,
    token_weights: torch.Tensor | None,
    *,
    kind: str,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Gated activation ``kind`` (``swiglu``, ``geglu_tanh``, ``geglu_erf``) of ``x [..., 2I]``.

    ``token_weights``: ``[...]`` or ``[..., 1]`` (validated by the caller), or None.
    ``inplace_backward``: the backward writes the input gradient into the storage of ``x``
    (float32/float64 ``x``; a lower-precision ``x`` is upcast first, and the upcast copy is
    reused). Only for an ``x`` that nothing else reads after the forward (a projection's output
    feeding only this op); the graph can then be backpropagated once.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r} is not a gated activation; valid: {', '.join(_KINDS)}")
    weights = token_weights
    if weights is not None and weights.shape == x.shape[:-1]:
        # [...] -> [..., 1]: one weight per row, broadcast over the I columns.
        weights = weights.unsqueeze(-1)
    return _GatedActivation.apply(x, weights, kind, inplace_backward)
