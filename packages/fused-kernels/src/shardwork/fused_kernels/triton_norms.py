"""Triton RMSNorm / LayerNorm: one forward and one backward kernel shared by both norms.

- Forward: a program normalises ``BLOCK_M`` rows of the whole hidden width at once
  (``BLOCK_N`` = next power of two >= hidden), float32 statistics, saves mean/rstd
  per row (float32, ``[M]``).
- Backward: a persistent grid (capped number of programs) walks row blocks with a
  stride, writes ``dx`` and accumulates ``dw``/``db`` partial sums per program in
  float32; the ``[programs, hidden]`` partials are summed by torch (tiny).
- ``dx = rstd·(w·dy - x̂·mean(w·dy·x̂) [- mean(w·dy)])``, ``dw = Σ dy·x̂``, ``db = Σ dy``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwork.fused_kernels.triton_launch import launch, max_programs, next_pow2

__all__ = ["MAX_HIDDEN", "norm"]

MAX_HIDDEN = 65536
"""Widest hidden size the single-tile kernels handle."""


@triton.jit
def _norm_fwd(X, W, B, Y, MEAN, RSTD, M, N, eps, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
              ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    # int64: rows * N overflows int32 past 2**31 elements.
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        # Padded columns (cols >= N) would add (0 - mean)**2 to the variance: zero them.
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=rmask)
    # eps keeps a constant row (zero variance) from dividing by zero.
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        # zero_centered_gamma: the stored weight is the offset from a scale of 1.
        w = w + 1.0
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, W, DY, DX, MEAN, RSTD, DW, DB, M, N, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
              ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    # Persistent grid: each program strides over row blocks and keeps one dw/db partial row.
    step = tl.num_programs(0) * BLOCK_M
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, step):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
            # Padded columns again: x - mean is not zero there.
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        # mean(x_hat * w * dy): the term the normalisation's Jacobian subtracts along x_hat.
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
    # One partial row per program, summed by torch afterwards: no atomics, so dw/db are
    # deterministic.
    tl.store(DW + pid * N + cols, dw_acc, mask=cmask)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, db_acc, mask=cmask)


def _blocks(n: int) -> tuple[int, int, int]:
    block_n = next_pow2(n)
    block_m = max(1, min(32, 4096 // block_n))
    num_warps = 4 if block_n <= 2048 else (8 if block_n <= 8192 else 16)
    return block_m, block_n, num_warps


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered, rms):
        n = x.shape[-1]
        # [..., N] -> [M, N]
        x2 = x.reshape(-1, n).contiguous()
        m = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block_m, block_n, warps = _blocks(n)
        # No bias: the weight only fills the pointer slot; with HAS_BIAS=False the kernel never
        # reads it.
        b = weight if bias is None else bias
        launch("rms_norm_fwd" if rms else "layer_norm_fwd", _norm_fwd, (triton.cdiv(m, block_m),),
               x2, weight, b, y, mean, rstd, m, n, eps, IS_RMS=rms, HAS_BIAS=bias is not None,
               ZERO_CENTERED=zero_centered, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)  # fmt: skip
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.cfg = (zero_centered, rms, x.shape)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        zero_centered, rms, shape = ctx.cfg
        m, n = x2.shape
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        block_m, block_n, warps = _blocks(n)
        programs = max(1, min(triton.cdiv(m, block_m), max_programs(x2.device)))
        dw = torch.zeros(programs, n, dtype=torch.float32, device=x2.device)
        db = (
            torch.zeros(programs, n, dtype=torch.float32, device=x2.device)
            if bias is not None
            # Never written without a bias (HAS_BIAS=False): dw fills the pointer slot.
            else dw
        )
        launch("rms_norm_bwd" if rms else "layer_norm_bwd", _norm_bwd, (programs,),
               x2, weight, dy2, dx, mean, rstd, dw, db, m, n, IS_RMS=rms, HAS_BIAS=bias is not None,
               ZERO_CENTERED=zero_centered, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)  # fmt: skip
        grad_bias = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx.view(shape), dw.sum(0).to(weight.dtype), grad_bias, None, None, None


def norm(x, weight, bias, *, eps: float, zero_centered_gamma: bool, rms: bool) -> torch.Tensor:
    """RMSNorm (``rms=True``) or LayerNorm of ``x [..., N]`` through the Triton kernels."""
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(
            f"x.shape[-1]={x.shape[-1]}: the Triton norm handles hidden sizes up to {MAX_HIDDEN}; "
            "use backend='torch'"
        )
    return _Norm.apply(x, weight, bias, float(eps), bool(zero_centered_gamma), bool(rms))
