"""Exact attention under a :class:`~shardwork.models.block_mask.BlockMask`, memory linear in ``s``.

Shapes (SDPA's layout): ``q [b, nq, s, d]``, ``k [b, nkv, sk, d]``, ``v [b, nkv, sk, dv]``
with keys in global position order; ``nq`` a multiple of ``nkv`` (query head ``j`` uses kv
head ``j // (nq / nkv)``, the order of ``repeat_interleave`` and Hugging Face's ``repeat_kv``).
Output ``[b, nq, s, dv]``.

- Fused path (CPU tensors, no attention dropout): one autograd function runs every piece of
  every segment (:meth:`QuerySegment.pieces`) through torch's CPU flash-attention kernel, which
  returns the log-sum-exp of each row along with the output. A segment with two pieces (keys
  before it, attended fully, and its own keys, causal) merges them exactly:
  ``lse = logaddexp(lse_1, lse_2)``, ``out = Σ exp(lse_i - lse) · out_i``. Backward runs the
  kernel's backward per piece with the merged output and log-sum-exp, which gives each piece
  its exact share of the gradient (the kernel's ``D = rowsum(dO ∘ O)`` and probabilities
  ``exp(s - lse)`` are then those of the whole row). Saved for backward: ``q, k, v``, the
  output and ``lse [b, nq, s]``: linear in ``s``. Banded pieces (sliding windows) build their
  ``tile x (tile + window - 1)`` mask when they run, in forward and again in backward.
- Per-segment SDPA (other devices, attention dropout, or ``fused=False``): one public
  ``scaled_dot_product_attention`` call per segment over its key span, with ``is_causal``
  when the segment is a single causal piece (packed documents at cp 1) and otherwise the
  segment's boolean mask, ``rows x key span`` (saved by autograd; at cp > 1 a chunk's rows times
  the keys before it, so this fallback is not linear in ``s`` there).
- Soft-capped scores (Gemma 2, :func:`capped_attention`): the capped score matrix is explicit
  by nature; it is computed per segment, rows times key span, never over keys a segment cannot
  see.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardwork.models.block_mask import BlockMask, QuerySegment
from shardwork.models.softcap import soft_cap

__all__ = ["block_attention", "capped_attention", "fused_block_attention_available"]

# Private ATen ops (stable since torch 2.3): the CPU flash-attention kernel with its row
# log-sum-exp, and its backward. Absent ops leave only the per-segment SDPA path.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def fused_block_attention_available(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether :func:`block_attention` takes the fused path for ``q`` (see module docstring)."""
    return q.device.type == "cpu" and dropout_p == 0.0 and _FLASH_CPU_BACKWARD is not None


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """``softmax(q·kᵀ·scale, masked by mask) v`` -> ``[b, nq, s, dv]`` (shapes in module doc).

    ``scale`` defaults to ``d^-0.5``; ``softcap`` caps the scores first (:func:`capped_attention`);
    ``fused``: None picks the fused path when it applies, False forces per-segment SDPA.
    """
    if q.shape[2] != mask.num_queries or k.shape[2] != mask.num_keys:
        raise ValueError(
            f"block mask of {mask.num_queries} queries x {mask.num_keys} keys does not fit "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)} (dim 2 is the sequence)"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if softcap is not None:
        masks = _SegmentMasks(mask.window, q.device)
        outs = [
            capped_attention(
                *_segment_tensors(q, k, v, seg),
                masks.allowed(seg),
                scale=scale,
                softcap=softcap,
                dropout_p=dropout_p,
            )
            for seg in mask.segments
        ]
        return torch.cat(outs, dim=2)
    if fused is None:
        fused = fused_block_attention_available(q, dropout_p)
    if fused:
        if not fused_block_attention_available(q, dropout_p):
            raise ValueError(
                f"fused=True needs CPU tensors, dropout_p=0 and torch's CPU flash-attention ops; "
                f"got device={q.device.type}, dropout_p={dropout_p}"
            )
        return _fused(q, k, v, mask, scale)
    return _per_segment_sdpa(q, k, v, mask, scale, dropout_p)


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    *,
    scale: float,
    softcap: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``softmax(cap·tanh(q·kᵀ·scale / cap), masked by allowed [sq, sk]) v`` -> ``[b, nq, sq, dv]``.

    Softmax in at least float32, like transformers' eager attention. Grouped-query heads
    broadcast: ``q`` is viewed ``[b, nkv, group, sq, d]`` against ``k [b, nkv, 1, sk, d]``.
    """
    b, nq, sq, d = q.shape
    nkv = k.shape[1]
    grouped = q.reshape(b, nkv, nq // nkv, sq, d)
    scores = soft_cap(torch.matmul(grouped, k.unsqueeze(2).transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=acc).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v.unsqueeze(2)).reshape(b, nq, sq, v.shape[-1])


def _segment_tensors(q, k, v, seg: QuerySegment):
    """The segment's queries and its key span of ``k``/``v`` (views)."""
    keys = slice(seg.key_start, seg.key_stop)
    return q[:, :, seg.start : seg.stop], k[:, :, keys], v[:, :, keys]


def _per_segment_sdpa(q, k, v, mask: BlockMask, scale, dropout_p):
    outs = []
    masks = _SegmentMasks(mask.window, q.device)
    for seg in mask.segments:
        pieces = seg.pieces(mask.window)
        causal = len(pieces) == 1 and pieces[0].kind == "causal"
        allowed = None if causal else masks.allowed(seg)
        outs.append(
            F.scaled_dot_product_attention(
                *_segment_tensors(q, k, v, seg),
                attn_mask=allowed,
                is_causal=causal,
                dropout_p=dropout_p,
                scale=scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        )
    return torch.cat(outs, dim=2)


def _fused(q, k, v, mask: BlockMask, scale):
    """The fused path; the CPU kernel needs one head size, so the narrower of qk / v is padded
    with zero features (zeros add nothing to scores, and padded output columns are dropped)."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        return _FusedBlockAttention.apply(q, k, F.pad(v, (0, d - dv)), mask, scale)[..., :dv]
    if d < dv:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    return _FusedBlockAttention.apply(q, k, v, mask, scale)


class _SegmentMasks:
    """One call's segment masks, built once per geometry: a segment's mask depends only on its
    rows, key span and ``position - key_start`` (:meth:`QuerySegment.allowed`), so the interior
    tiles of a sliding window share one. The last few geometries are kept (tiles run in order),
    so the cache stays a few tiles' masks however many documents there are."""

    KEEP = 8

    def __init__(self, window: int | None, device: torch.device) -> None:
        self.window, self.device = window, device
        self._allowed: dict[tuple, torch.Tensor] = {}
        self._bias: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _keep(cache: dict, key: tuple, make):
        if key not in cache:
            if len(cache) >= _SegmentMasks.KEEP:
                cache.pop(next(iter(cache)))  # the oldest geometry
            cache[key] = make()
        return cache[key]

    def allowed(self, seg: QuerySegment) -> torch.Tensor:
        """Boolean ``[rows, key span]`` of ``seg`` (True = attend)."""
        key = (seg.stop - seg.start, seg.key_stop - seg.key_start, seg.position - seg.key_start)
        return self._keep(self._allowed, key, lambda: seg.allowed(self.window, self.device))

    def bias(self, seg: QuerySegment, kind: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The CPU kernel's additive mask (0 / -inf) of a banded piece, None for the others."""
        if kind != "banded":
            return None
        key = (seg.stop - seg.start, seg.key_stop - seg.key_start, seg.position - seg.key_start)

        def make():
            allowed = self.allowed(seg)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            return bias.masked_fill_(~allowed, float("-inf"))

        return self._keep(self._bias, key, make)


def _merge(results):
    """Exact union of attention over disjoint key sets from ``(out, lse)`` of each set."""
    lse = functools.reduce(torch.logaddexp, [row_lse for _, row_lse in results])
    out = sum(torch.exp(row_lse - lse).unsqueeze(-1) * o.to(lse.dtype) for o, row_lse in results)
    return out.to(results[0][0].dtype), lse


class _FusedBlockAttention(torch.autograd.Function):
    """Every piece through the CPU flash kernel, merged by log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, mask: BlockMask, scale: float):
        # Laid out like q (as the kernel lays out its own output): attention's [s, b, n, d]
        # storage then reaches linear_proj as a view, no copy. Head sizes are equal here.
        out = torch.empty_like(q)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.empty(q.shape[:3], dtype=lse_dtype, device=q.device)
        masks = _SegmentMasks(mask.window, q.device)
        for seg in mask.segments:
            start, stop = seg.start, seg.stop
            qs = q[:, :, start:stop]
            results = [
                _FLASH_CPU(
                    qs,
                    k[:, :, piece.start : piece.stop],
                    v[:, :, piece.start : piece.stop],
                    0.0,
                    piece.kind == "causal",
                    attn_mask=masks.bias(seg, piece.kind, q.dtype),
                    scale=scale,
                )
                for piece in seg.pieces(mask.window)
            ]
            seg_out, seg_lse = results[0] if len(results) == 1 else _merge(results)
            out[:, :, start:stop] = seg_out
            lse[:, :, start:stop] = seg_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        mask: BlockMask = ctx.mask
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        masks = _SegmentMasks(mask.window, q.device)
        for seg in mask.segments:
            rows = slice(seg.start, seg.stop)
            for piece in seg.pieces(mask.window):
                keys = slice(piece.start, piece.stop)
                # Merged out/lse of the whole row: the kernel then returns this piece's exact
                # share of dq and the exact dk/dv of its keys.
                gq, gk, gv = _FLASH_CPU_BACKWARD(
                    grad_out[:, :, rows],
                    q[:, :, rows],
                    k[:, :, keys],
                    v[:, :, keys],
                    out[:, :, rows],
                    lse[:, :, rows],
                    0.0,
                    piece.kind == "causal",
                    attn_mask=masks.bias(seg, piece.kind, q.dtype),
                    scale=ctx.scale,
                )
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        return dq, dk, dv, None, None
