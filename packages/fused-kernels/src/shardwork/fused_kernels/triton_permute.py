"""Triton token permutation: row gather (permute) and table-driven row sums (unpermute).

- ``gather_rows``: ``out[j] = src[idx[j]]`` (× ``w[j]``), grid (row blocks, hidden blocks).
- ``scatter_rows`` (unpermute): each token sums its rows through a ``[N, K]`` table of
  destination rows (-1 = none; K = most experts any token reached), so the sum is
  deterministic and needs no atomics; float32 accumulation.
- Autograd pairs them: the backward of a gather is a table sum and vice versa; the
  prob gradient of unpermute is a per-row dot product ``Σ_h dy[idx[j], h]·permuted[j, h]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwork.fused_kernels.triton_launch import launch, next_pow2

__all__ = ["destination_table", "gather_rows", "scatter_rows"]


@triton.jit
def _gather_rows(SRC, IDX, W, DST, M, H, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_H: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < M
    mask = rmask[:, None] & (cols < H)[None, :]
    src_rows = tl.load(IDX + rows, mask=rmask, other=0).to(tl.int64)
    v = tl.load(SRC + src_rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        v = v * tl.load(W + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    tl.store(
        DST + rows.to(tl.int64)[:, None] * H + cols[None, :], v.to(DST.dtype.element_ty), mask=mask
    )


@triton.jit
def _sum_rows(SRC, TABLE, W, DST, N, H, K, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_H: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < N
    cmask = cols < H
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    # Each token sums its rows in table order, the same on every run: deterministic, no atomics.
    for k in range(K):
        j = tl.load(TABLE + rows64 * K + k, mask=rmask, other=-1)
        jmask = j >= 0
        v = tl.load(SRC + j.to(tl.int64)[:, None] * H + cols[None, :],
                    mask=jmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if HAS_W:
            v = v * tl.load(W + j, mask=jmask, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(DST + rows64[:, None] * H + cols[None, :], acc.to(DST.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])  # fmt: skip


@triton.jit
def _row_dot(A, IDX, B, OUT, M, H, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    a_rows = tl.load(IDX + rows, mask=rmask, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = rmask[:, None] & (cols < H)[None, :]
        a = tl.load(A + a_rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(a * b.to(tl.float32), axis=1)
    tl.store(OUT + rows, acc, mask=rmask)


def _blocks(h: int) -> tuple[int, int]:
    block_h = min(1024, next_pow2(h))
    return max(1, min(16, 2048 // block_h)), block_h


def destination_table(sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[N, K]`` int64: the permuted rows of each token (ascending), -1 padded; K = max rows per token."""
    m = sorted_indices.numel()
    counts = torch.bincount(sorted_indices, minlength=num_tokens)
    k = int(counts.max()) if m else 0
    # Stable sort by token: each token's permuted rows stay in ascending order.
    order = torch.argsort(sorted_indices, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    tokens = sorted_indices[order]
    # slot: the row's position among its token's rows.
    slot = torch.arange(m, device=sorted_indices.device) - starts[tokens]
    table = torch.full((num_tokens, max(k, 1)), -1, dtype=torch.int64, device=sorted_indices.device)
    table[tokens, slot] = order
    return table


def _gather(src, idx, w, m):
    h = src.shape[1]
    out = torch.empty(m, h, dtype=src.dtype, device=src.device)
    block_m, block_h = _blocks(h)
    launch("permute_gather_rows", _gather_rows, (triton.cdiv(m, block_m), triton.cdiv(h, block_h)),
           src, idx, src if w is None else w, out, m, h, HAS_W=w is not None, BLOCK_M=block_m,
           BLOCK_H=block_h)  # fmt: skip
    return out


def _sum(src, table, w, n):
    h = src.shape[1]
    out = torch.empty(n, h, dtype=src.dtype, device=src.device)
    block_n, block_h = _blocks(h)
    launch("permute_sum_rows", _sum_rows, (triton.cdiv(n, block_n), triton.cdiv(h, block_h)),
           src, table, src if w is None else w, out, n, h, table.shape[1], HAS_W=w is not None,
           BLOCK_N=block_n, BLOCK_H=block_h)  # fmt: skip
    return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, sorted_indices):
        ctx.save_for_backward(sorted_indices)
        ctx.num_tokens = tokens.shape[0]
        return _gather(
            tokens.contiguous(), sorted_indices.contiguous(), None, sorted_indices.numel()
        )

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        table = destination_table(sorted_indices, ctx.num_tokens)
        return _sum(grad.contiguous(), table, None, ctx.num_tokens), None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, sorted_indices, probs, num_tokens):
        permuted = permuted.contiguous()
        table = destination_table(sorted_indices, num_tokens)
        ctx.save_for_backward(permuted, sorted_indices, probs)
        return _sum(permuted, table, probs, num_tokens)

    @staticmethod
    def backward(ctx, grad):
        permuted, sorted_indices, probs = ctx.saved_tensors
        grad = grad.contiguous()
        m, h = permuted.shape
        # Backward of the weighted sum: each permuted row gets its token's gradient times its prob.
        d_permuted = _gather(grad, sorted_indices, probs, m)
        d_probs = None
        if probs is not None and ctx.needs_input_grad[2]:
            # d prob_j = sum_h dy[token_j, h] * permuted[j, h].
            out = torch.empty(m, dtype=torch.float32, device=grad.device)
            block_m, block_h = _blocks(h)
            launch("permute_row_dot", _row_dot, (triton.cdiv(m, block_m),), grad, sorted_indices,
                   permuted, out, m, h, BLOCK_M=block_m, BLOCK_H=block_h)  # fmt: skip
            d_probs = out.to(probs.dtype)
        return d_permuted, None, d_probs, None


def gather_rows(tokens: torch.Tensor, sorted_indices: torch.Tensor) -> torch.Tensor:
    """``tokens[sorted_indices]`` through Triton (differentiable w.r.t. ``tokens``)."""
    return _GatherRows.apply(tokens, sorted_indices)


def scatter_rows(permuted, sorted_indices, probs, num_tokens: int) -> torch.Tensor:
    """Unpermute: sum of each token's rows of ``permuted`` (× ``probs``) into ``[num_tokens, H]``."""
    if probs is not None:
        probs = probs.contiguous()
    return _ScatterRows.apply(permuted, sorted_indices.contiguous(), probs, int(num_tokens))
