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
    def forward(ctx, x, weights, kind):
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
        ctx.kind, ctx.x_dtype = kind, x.dtype
        ctx.weights_dtype = None if weights is None else weights.dtype
        ctx.save_for_backward(xf, act, w)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xf, act, w = ctx.saved_tensors
        gate, up = xf.chunk(2, dim=-1)
        dy = dy.to(xf.dtype)
        dweights = None
        if w is not None:
            if ctx.needs_input_grad[1]:
                # The reference's gradient of ``(act · up) · w`` with respect to w, summed over
                # the broadcast columns.
                dweights = (dy * (act * up)).sum(dim=-1, keepdim=True).to(ctx.weights_dtype)
            dy = dy * w
        dx = None
        if ctx.needs_input_grad[0]:
            # One [..., 2I] buffer; each half is written in place, so no cat of the halves.
            dx = torch.empty_like(xf)
            dgate, dup = dx.chunk(2, dim=-1)
            torch.mul(dy, act, out=dup)
            _activation_backward(dy * up, gate, ctx.kind, dgate)
            dx = dx.to(ctx.x_dtype)
        return dx, dweights, None


def glu(x: torch.Tensor, token_weights: torch.Tensor | None, *, kind: str) -> torch.Tensor:
    """Gated activation ``kind`` (``swiglu``, ``geglu_tanh``, ``geglu_erf``) of ``x [..., 2I]``.

    ``token_weights``: ``[...]`` or ``[..., 1]`` (validated by the caller), or None.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r} is not a gated activation; valid: {', '.join(_KINDS)}")
    weights = token_weights
    if weights is not None and weights.shape == x.shape[:-1]:
        # [...] -> [..., 1]: one weight per row, broadcast over the I columns.
        weights = weights.unsqueeze(-1)
    return _GatedActivation.apply(x, weights, kind)
