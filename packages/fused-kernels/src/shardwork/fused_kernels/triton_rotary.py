"""Triton rotary embedding: forward and backward are one kernel (the backward is the transposed rotation).

- ``x`` is viewed as ``[T, H, D]`` (T = all leading dims, strided views such as q/k
  slices of a fused qkv tensor included; last-dim stride must be 1). Grid:
  (T, head blocks); each program rotates ``BLOCK_H`` heads of one token.
- ``out[j] = x[j]·cos[j] + sign_j·x[p(j)]·sin[j]`` with ``p`` the pair partner
  (``j ± R/2`` half-split, ``j ^ 1`` interleaved) and ``sign = -1`` on the first of each pair.
  Its transpose ``dx[j] = dy[j]·cos[j] - sign_j·dy[p(j)]·sin[p(j)]`` is the same
  kernel with ``BACKWARD=True``.
- In place: all loads of a (token, head block) happen before its stores and
  programs own disjoint rows, so writing into ``x`` is race-free.
- Features ``R..D`` are copied when not in place (partial rotary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwork.fused_kernels.triton_launch import launch, next_pow2

__all__ = ["rotary"]


@triton.jit
def _rotary_kernel(X, COS, SIN, OUT, H, D, R, stride_xt, stride_xh, stride_ot, stride_oh,
                   INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, COPY_REST: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    j = tl.arange(0, BLOCK_R)
    jmask = j < R
    if INTERLEAVED:
        # Interleaved pairs are (2k, 2k + 1): the partner index is j xor 1.
        partner = j ^ 1
        first = (j % 2) == 0
    else:
        half = R // 2
        partner = tl.where(j < half, j + half, j - half)
        first = j < half
    # The transpose of the rotation: the pair's sign flips and the partner's sin is used.
    if BACKWARD:
        sign = tl.where(first, 1.0, -1.0)
        sin_idx = partner
    else:
        sign = tl.where(first, -1.0, 1.0)
        sin_idx = j
    c = tl.load(COS + t * R + j, mask=jmask, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * R + sin_idx, mask=jmask, other=0.0).to(tl.float32)
    mask = hmask[:, None] & jmask[None, :]
    xrow = X + t * stride_xt + heads[:, None] * stride_xh
    x = tl.load(xrow + j[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(xrow + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * c[None, :] + (sign * s)[None, :] * xp
    orow = OUT + t * stride_ot + heads[:, None] * stride_oh
    tl.store(orow + j[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    if COPY_REST:
        rest = R + tl.arange(0, BLOCK_REST)
        rmask = hmask[:, None] & (rest < D)[None, :]
        tl.store(orow + rest[None, :], tl.load(xrow + rest[None, :], mask=rmask), mask=rmask)


def _view3(x: torch.Tensor) -> torch.Tensor | None:
    h, d = x.shape[-2:]
    if x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, h, d)
    except RuntimeError:
        return None


def _run(x3, cos2, sin2, out3, *, interleaved: bool, backward: bool) -> None:
    t, h, d = x3.shape
    r = cos2.shape[1]
    block_r = next_pow2(r)
    block_h = max(1, min(next_pow2(h), 4096 // block_r, 16))
    # Partial rotary: features R..D need copying only into a separate output.
    copy_rest = d > r and out3.data_ptr() != x3.data_ptr()
    grid = (t, triton.cdiv(h, block_h))
    launch("rotary_bwd" if backward else "rotary_fwd", _rotary_kernel, grid, x3, cos2, sin2, out3,
           h, d, r, x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
           INTERLEAVED=interleaved, BACKWARD=backward, COPY_REST=copy_rest, BLOCK_H=block_h,
           BLOCK_R=block_r, BLOCK_REST=next_pow2(d - r))  # fmt: skip


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos2, sin2, interleaved, inplace):
        x3 = _view3(x)
        ctx.save_for_backward(cos2, sin2)
        ctx.interleaved = interleaved
        if inplace:
            # A layout _view3 cannot view: rotate a contiguous copy, then copy back into x.
            target = x3 if x3 is not None else x.contiguous().view(-1, *x.shape[-2:])
            _run(target, cos2, sin2, target, interleaved=interleaved, backward=False)
            if x3 is None:
                x.copy_(target.view(x.shape))
            # Tells autograd that x itself was modified (the in-place result is x).
            ctx.mark_dirty(x)
            return x
        if x3 is None:
            x3 = x.contiguous().view(-1, *x.shape[-2:])
        out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
        _run(x3, cos2, sin2, out, interleaved=interleaved, backward=False)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        cos2, sin2 = ctx.saved_tensors
        dy3 = _view3(dy)
        if dy3 is None:
            dy3 = dy.contiguous().view(-1, *dy.shape[-2:])
        dx = torch.empty(dy3.shape, dtype=dy.dtype, device=dy.device)
        _run(dy3, cos2, sin2, dx, interleaved=ctx.interleaved, backward=True)
        return dx.view(dy.shape), None, None, None, None


def rotary(x, cos, sin, *, interleaved: bool, inplace: bool) -> torch.Tensor:
    """Rotary embedding through the Triton kernel (gradients to ``x`` only)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "backend='triton' treats cos/sin as constants; detach them or use backend='torch'"
        )
    lead = tuple(x.shape[:-2])
    r = cos.shape[-1]
    # One table row per token (t * R indexing in the kernel), whatever cos/sin broadcast from.
    cos2 = cos.expand(*lead, r).reshape(-1, r).contiguous()
    sin2 = sin.expand(*lead, r).reshape(-1, r).contiguous()
    return _Rotary.apply(x, cos2, sin2, bool(interleaved), bool(inplace))
