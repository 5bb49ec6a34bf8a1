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
- Four ops per rotation: ``x·cos`` and ``x·sin'`` over the whole rotary width (``sin'``: the
  sine table with each pair's members swapped, so its product holds the cross terms), then one
  subtract and one add on the halves. Six ops on the halves took 3.05 ms for a dense layer's
  query and key forward + backward (``[256, 4, 8|4, 64]``, 2 threads), four take 1.97 (1.78 and
  1.48 at one thread); the dense step 635.9 -> 631.9 ms, old and new interleaved.
- The tables are constants: no gradient flows to ``cos``/``sin`` (as in the Triton backend),
  and only they are saved for backward.
- Arithmetic in float32 (float64 for float64 input); output and gradient in ``x.dtype``.
- ``rotary_qkv``: the same rotation of q and k straight out of a fused ``[s, b, (nq +
  2·nkv)·d]`` projection, written into batch-first buffers returned as SDPA's ``[b, n, s, d]``
  views (v copied there too), with a backward that writes the fused gradient block by block.
  Nothing keeps the qkv output alive for backward (v was a view of it). Measured at the dense
  benchmark's shape (2 threads, same bits): the attention block alone, timed in a loop, 16.5
  -> 15.5 ms forward + backward, but the whole training step does not move beyond its noise
  (three paired A/B runs: old/new 0.997, 0.999, 0.999).
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels._checks import acc_dtype

__all__ = ["rotary", "rotary_qkv", "rotate_into"]


def _pairs(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the first and second member of every rotation pair along the last dim."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    first, second = t.chunk(2, dim=-1)
    return first, second


def _rotate_into(out, x, cos, sin, *, interleaved: bool, transpose: bool) -> None:
    """``out = x·cos + rotate(x)·sin`` (or its transpose) on ``[..., R]`` views.

    Two whole-width products, then one add and one subtract on the halves (four ops, not six):
    ``x·cos`` holds ``(a·c_a, b·c_b)``, and ``x`` times the sine table with its pair members
    swapped holds the cross terms ``(a·s_b, b·s_a)`` (the transpose's are ``(a·s_a, b·s_b)``,
    the table as it is), so each output is the same two rounded products, added or subtracted."""
    torch.mul(x, cos, out=out)
    if transpose:
        cross_table = sin
    else:
        # The sine table with each pair's members swapped (small: one row per position).
        cross_table = torch.empty_like(sin)
        swap_a, swap_b = _pairs(cross_table, interleaved)
        s_a, s_b = _pairs(sin, interleaved)
        swap_a.copy_(s_b)
        swap_b.copy_(s_a)
    cross_a, cross_b = _pairs(x * cross_table, interleaved)
    out_a, out_b = _pairs(out, interleaved)
    if transpose:
        # The transpose of the rotation: each pair member takes the other's sine.
        out_a.add_(cross_b)  # + b·s_b
        out_b.sub_(cross_a)  # - a·s_a
    else:
        out_a.sub_(cross_b)  # - b·s_a
        out_b.add_(cross_a)  # + a·s_b


def rotate_into(out, x, cos, sin, *, interleaved: bool, transpose: bool) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [..., heads, head_dim]`` into ``out``
    (a new tensor when None, else any strided tensor of ``x``'s shape and dtype, e.g. a view of
    a larger buffer); the rest pass through. ``transpose``: the backward's rotation. Returns
    ``out``."""
    rotary_dim = cos.shape[-1]
    acc = acc_dtype(x)
    # [..., R] -> [..., 1, R]: the same table row for every head.
    c, s = cos.unsqueeze(-2).to(acc), sin.unsqueeze(-2).to(acc)
    if out is None:
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
        return rotate_into(None, x, cos, sin, interleaved=interleaved, transpose=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dx = rotate_into(None, dy, cos, sin, interleaved=ctx.interleaved, transpose=True)
        return dx, None, None, None


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of ``x [..., heads, head_dim]`` (validated by the caller), a new tensor."""
    return _Rotary.apply(x, cos, sin, interleaved)


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads, num_kv_heads, interleaved):
        s, b, _ = qkv.shape
        nqk = num_heads + num_kv_heads
        heads = qkv.unflatten(-1, (nqk + num_kv_heads, -1))
        d = heads.shape[-1]
        # New batch-first buffers (nothing keeps qkv alive), returned as SDPA's [b, n, s, d]
        # views. Queries and keys are adjacent in qkv: one rotation for both.
        qk = torch.empty(b, s, nqk, d, dtype=qkv.dtype, device=qkv.device)
        rotate_into(qk.transpose(0, 1), heads[:, :, :nqk], cos, sin,
                    interleaved=interleaved, transpose=False)  # fmt: skip
        v = torch.empty(b, s, num_kv_heads, d, dtype=qkv.dtype, device=qkv.device)
        v.transpose(0, 1).copy_(heads[:, :, nqk:])
        ctx.save_for_backward(cos, sin)
        ctx.layout = (num_heads, num_kv_heads, interleaved)
        q, k = qk.split((num_heads, num_kv_heads), dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        num_heads, num_kv_heads, interleaved = ctx.layout
        b, _, s, d = dq.shape
        nqk = num_heads + num_kv_heads
        # The fused gradient written block by block: nothing to concatenate.
        dqkv = torch.empty(s, b, nqk + num_kv_heads, d, dtype=dq.dtype, device=dq.device)
        for grad, heads in ((dq, dqkv[:, :, :num_heads]), (dk, dqkv[:, :, num_heads:nqk])):
            rotate_into(heads, grad.permute(2, 0, 1, 3), cos, sin,
                        interleaved=interleaved, transpose=True)  # fmt: skip
        dqkv[:, :, nqk:].copy_(dv.permute(2, 0, 1, 3))
        return dqkv.flatten(2), None, None, None, None, None


def rotary_qkv(qkv, cos, sin, num_heads: int, num_kv_heads: int, *, interleaved: bool):
    """``qkv [s, b, (nq + 2·nkv)·d]`` -> rotated ``q [b, nq, s, d]``, rotated ``k [b, nkv, s, d]``
    and ``v [b, nkv, s, d]`` (validated by the caller)."""
    return _RotaryQKV.apply(qkv, cos, sin, num_heads, num_kv_heads, interleaved)
