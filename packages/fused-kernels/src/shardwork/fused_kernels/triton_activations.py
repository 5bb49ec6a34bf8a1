"""Triton SwiGLU / GeGLU on a fused [gate | up] input, with optional per-token weights.

- 2-D grid: (row blocks, column blocks of the I outputs); every load upcast to float32.
- Backward recomputes the activation from the saved input (nothing else saved):
  ``dgate = dy·w·up·act'(gate)``, ``dup = dy·w·act(gate)``, and the token-weight
  gradient ``Σ_cols dy·act(gate)·up`` as per-column-block partial sums
  ``[rows, column blocks]`` that torch adds up (so no atomics, deterministic).
- ``KIND``: 0 SwiGLU, 1 GeGLU (tanh approximation), 2 GeGLU (erf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwork.fused_kernels.triton_launch import launch, next_pow2

__all__ = ["glu"]

_KINDS = {"swiglu": 0, "geglu_tanh": 1, "geglu_erf": 2}
_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2 = 0.7071067811865476


@triton.jit
def _act(g, KIND: tl.constexpr):
    """Return (act(g), act'(g)) in float32."""
    if KIND == 0:
        s = tl.sigmoid(g)
        # silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
        return g * s, s * (1.0 + g * (1.0 - s))
    elif KIND == 1:
        # GELU's tanh approximation (Hendrycks and Gimpel, 2016): 0.5 g (1 + tanh(sqrt(2/pi) (g +
        # 0.044715 g^3))).
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh
        d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * d_inner
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        # Standard normal pdf: 1 / sqrt(2 pi) = 0.3989...
        pdf = 0.3989422804014327 * tl.exp(-0.5 * g * g)
        return g * cdf, cdf + g * pdf


@triton.jit
def _glu_fwd(X, TW, Y, M, NI, KIND: tl.constexpr, HAS_TW: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols < NI)[None, :]
    rows64 = rows.to(tl.int64)
    # A row of X is [gate | up]: gate at col, up at col + NI.
    xoff = rows64[:, None] * (2 * NI) + cols[None, :]
    g = tl.load(X + xoff, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + xoff + NI, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act(g, KIND)
    y = a * u
    if HAS_TW:
        y = y * tl.load(TW + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + rows64[:, None] * NI + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(X, TW, DY, DX, DTW, M, NI, NUM_COL_BLOCKS, KIND: tl.constexpr, HAS_TW: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cb = tl.program_id(1)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols < NI)[None, :]
    rows64 = rows.to(tl.int64)
    xoff = rows64[:, None] * (2 * NI) + cols[None, :]
    g = tl.load(X + xoff, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + xoff + NI, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64[:, None] * NI + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _act(g, KIND)
    if HAS_TW:
        tw = tl.load(TW + rows, mask=rmask, other=0.0).to(tl.float32)
        # This column block's share of the token-weight gradient; torch sums the blocks afterwards.
        tl.store(DTW + rows64 * NUM_COL_BLOCKS + cb, tl.sum(dy * a * u, axis=1), mask=rmask)
        dy = dy * tw[:, None]
    tl.store(DX + xoff, (dy * u * da).to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + xoff + NI, (dy * a).to(DX.dtype.element_ty), mask=mask)


def _blocks(i: int) -> tuple[int, int]:
    block_n = min(1024, next_pow2(i))
    block_m = max(1, min(16, 2048 // block_n))
    return block_m, block_n


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_weights, kind):
        two_i = x.shape[-1]
        i = two_i // 2
        x2 = x.reshape(-1, two_i).contiguous()
        m = x2.shape[0]
        tw = None if token_weights is None else token_weights.reshape(m).contiguous()
        y = torch.empty(m, i, dtype=x.dtype, device=x.device)
        block_m, block_n = _blocks(i)
        grid = (triton.cdiv(m, block_m), triton.cdiv(i, block_n))
        # No token weights: x2 fills the pointer slot; with HAS_TW=False the kernel never reads it.
        launch(f"{kind}_fwd", _glu_fwd, grid, x2, x2 if tw is None else tw, y, m, i,
               KIND=_KINDS[kind], HAS_TW=tw is not None, BLOCK_M=block_m, BLOCK_N=block_n)  # fmt: skip
        ctx.save_for_backward(x2, tw)
        ctx.cfg = (kind, x.shape, None if token_weights is None else token_weights.shape)
        return y.view(*x.shape[:-1], i)

    @staticmethod
    def backward(ctx, dy):
        x2, tw = ctx.saved_tensors
        kind, x_shape, tw_shape = ctx.cfg
        m, two_i = x2.shape
        i = two_i // 2
        dy2 = dy.reshape(m, i).contiguous()
        dx = torch.empty_like(x2)
        block_m, block_n = _blocks(i)
        grid = (triton.cdiv(m, block_m), triton.cdiv(i, block_n))
        dtw = torch.empty(m, grid[1], dtype=torch.float32, device=x2.device)
        launch(f"{kind}_bwd", _glu_bwd, grid, x2, x2 if tw is None else tw, dy2, dx, dtw, m, i,
               grid[1], KIND=_KINDS[kind], HAS_TW=tw is not None, BLOCK_M=block_m, BLOCK_N=block_n)  # fmt: skip
        grad_tw = None
        if tw is not None and ctx.needs_input_grad[1]:
            grad_tw = dtw.sum(dim=1).to(tw.dtype).view(tw_shape)
        return dx.view(x_shape), grad_tw, None


def glu(x: torch.Tensor, token_weights: torch.Tensor | None, *, kind: str) -> torch.Tensor:
    """Gated activation ``kind`` (swiglu, geglu_tanh, geglu_erf) of ``x [..., 2I]`` via Triton."""
    return _GLU.apply(x, token_weights, kind)
