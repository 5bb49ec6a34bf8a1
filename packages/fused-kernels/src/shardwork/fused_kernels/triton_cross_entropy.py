"""Triton kernels of the (vocab-parallel) cross entropy: streaming row statistics and the gradient.

- ``stats``: one program per token streams its vocab shard in ``BLOCK_V`` chunks with
  an online max / rescaled sum of exponentials (and the plain sum for label
  smoothing), all float32 in registers; the label's logit is a torch gather (N
  elements). Output ``[N, 4]`` float32, the layout ``cross_entropy`` combines over TP.
- ``grad``: 2-D grid (token, vocab chunk) writes
  ``g·(exp(x - lse) - ε/V - (1-ε)·[v = label])`` straight into a logits-dtype
  tensor: the only logits-sized buffer is the gradient itself.
- ``SOFTCAP``: the logits are raw ``z`` and the loss sees ``x = cap·tanh(z / cap)`` (Gemma 2's
  final-logit soft-capping, computed in float32 in registers); the gradient becomes
  ``dz = dx·(1 - tanh²)``. ``tanh`` is written with ``exp`` (``tl`` has none):
  ``sign(u)·(1 - e)/(1 + e)``, ``e = exp(-2|u|)``, which never overflows.
- Both kernels work on any ``[rows, cols]`` block with unit column stride (a whole shard, or a
  token or vocab chunk of one in ``linear_cross_entropy``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwork.fused_kernels.triton_launch import launch, next_pow2

__all__ = ["grad", "stats"]


@triton.jit
def _tanh(u):
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _ce_stats(X, STATS, V, stride_x, cap, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr,
              BLOCK_V: tl.constexpr):  # fmt: skip
    # int64: row * stride overflows int32 once N x V passes 2**31 elements (e.g. 16k x 128k).
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride_x
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        # Masked lanes load -inf: they change neither the max nor the sum of exponentials.
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if SOFTCAP:
            # tanh maps the masked lanes' -inf to -cap: put -inf back so they add nothing.
            x = tl.where(mask, cap * _tanh(x / cap), float("-inf"))
        new_m = tl.maximum(m, tl.max(x, axis=0))
        # Online softmax (Milakov and Gimelshein, 2018): rescale the running sum to the new max.
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        if SMOOTH:
            # Masked lanes hold -inf here: keep them out of the plain sum.
            total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    tl.store(STATS + row * 4, m)
    tl.store(STATS + row * 4 + 1, s)
    tl.store(STATS + row * 4 + 3, total)


@triton.jit
def _ce_grad(X, DX, LSE, G, LBL, V, stride_x, stride_dx, smoothing, vocab_total, cap,
             SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + row)
    g = tl.load(G + row)
    label = tl.load(LBL + row)
    if SOFTCAP:
        t = _tanh(x / cap)
        x = cap * t
    p = tl.exp(x - lse)
    if SMOOTH:
        p = p - smoothing / vocab_total
    # Labels outside this shard arrive as -1 and match no column.
    p = tl.where(cols == label, p - (1.0 - smoothing), p) * g
    if SOFTCAP:
        p = p * (1.0 - t * t)
    tl.store(DX + row * stride_dx + cols, p.to(DX.dtype.element_ty), mask=mask)


def _block_v(v: int) -> int:
    return min(4096, next_pow2(v))


def stats(
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    in_shard: torch.Tensor,
    *,
    smoothing: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-row float32 ``[N, 4]``: (max, Σ exp(x - max), label logit or 0, Σ x) of this block
    (``x`` soft-capped when ``softcap`` is set)."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.zeros(n, 4, dtype=torch.float32, device=logits.device)
    if v == 0:
        # An all-padding shard: no class here (max -inf, Σexp 0, no label, Σx 0).
        out[:, 0] = float("-inf")
        return out
    launch("cross_entropy_stats", _ce_stats, (n,), logits, out, v, logits.stride(0),
           _cap(softcap), SMOOTH=smoothing, SOFTCAP=softcap is not None, BLOCK_V=_block_v(v),
           num_warps=8)  # fmt: skip
    # clamp: an out-of-shard label would index out of range; its value is replaced by 0 below.
    picked = logits.gather(1, local_labels.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1).float()
    if softcap is not None:
        picked = torch.tanh(picked / softcap) * softcap
    out[:, 2] = torch.where(in_shard, picked, 0.0)
    return out


def _cap(softcap: float | None) -> float:
    # Any float when there is no cap: the SOFTCAP=False specialisation never reads it.
    return 1.0 if softcap is None else float(softcap)


def grad(
    logits,
    local_labels,
    in_shard,
    lse,
    grad_rows,
    *,
    smoothing: float,
    vocab_total: int,
    softcap: float | None = None,
    out=None,
) -> torch.Tensor:
    """Gradient of the per-token losses (weighted by ``grad_rows``) w.r.t. ``logits``, in ``logits.dtype``.

    ``out``: write into this tensor (the logits themselves for an in-place backward; each
    program reads its chunk before storing to it, and programs own disjoint chunks).
    """
    n, v = logits.shape
    src = logits if logits.stride(1) == 1 else logits.contiguous()
    if out is not None and out.stride(1) == 1:
        dx = out
    else:
        dx = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    labels = torch.where(in_shard, local_labels, -1).contiguous()
    block_v = _block_v(v)
    launch("cross_entropy_grad", _ce_grad, (n, triton.cdiv(v, block_v)), src, dx,
           lse.contiguous(), grad_rows.contiguous(), labels, v, src.stride(0), dx.stride(0),
           float(smoothing), float(vocab_total), _cap(softcap), SMOOTH=smoothing > 0,
           SOFTCAP=softcap is not None, BLOCK_V=block_v, num_warps=8)  # fmt: skip
    if out is not None and dx is not out:
        out.copy_(dx)
        return out
    return dx
