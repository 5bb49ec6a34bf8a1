"""Block masks and block attention against a dense masked softmax written here (fp64).

The reference: a boolean ``[s, s]`` mask built by double loops from document ids and positions
(causal, same document, ``i - j < window``), a softmax over the allowed keys, grouped-query heads
mapped explicitly. Context parallelism is emulated in one process (each cp rank's load-balanced
rows against all keys; gradients summed over ranks) here, and run for real at cp=2 in
``test_attention_cp2_packed_matches_dense_reference``. Layouts have documents of awkward
lengths (1 token, empty, crossing every cp chunk boundary) and windows shorter and longer than
documents; banded tiles are made small so sliding windows take every path. Two planted bugs (a
missing document boundary, a merge that ignores the log-sum-exp weights) are shown to fail the
same check at the same tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardwork.models.masked_attention as masked_attention_module
from shardwork.models import GPTConfig, GPTModel, block_attention, build_block_mask
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks

# fp64 sums of a few dozen O(1) terms: a few ulps of the tensor's scale.
FP64 = dict(rtol=0.0, ulps=64)

# (cp, cu_seqlens, window, tile): cp chunks are total / (2 cp) tokens long.
LAYOUTS = [
    (1, [0, 5, 13, 16], None, 256),
    (1, [0, 16], 6, 4),
    (2, [0, 3, 11, 13, 24], None, 256),  # chunks of 6: documents cross 6, 12 and 18
    (2, [0, 1, 1, 9, 24], 4, 3),  # a one-token and an empty document, banded tiles
    (2, [0, 24], 5, 2),
    (2, [0, 7, 24], 40, 256),  # a window longer than every document: global attention
    (3, [0, 7, 8, 20, 24], None, 256),
    (3, [0, 7, 8, 20, 24], 3, 2),
]


def _documents(cu: list[int]) -> list[int]:
    doc, out = 0, []
    for i in range(cu[-1]):
        while i >= cu[doc + 1]:
            doc += 1
        out.append(doc)
    return out


def _allowed(cu: list[int], window: int | None) -> torch.Tensor:
    """``[s, s]`` True where query i attends key j (double loop)."""
    s, doc = cu[-1], _documents(cu)
    allowed = torch.zeros(s, s, dtype=torch.bool)
    for i in range(s):
        for j in range(s):
            allowed[i, j] = j <= i and doc[i] == doc[j] and (window is None or i - j < window)
    return allowed


def _rank_rows(total: int, cp: int, rank: int) -> list[int]:
    """Global rows of a cp rank: chunk ``rank`` then chunk ``2cp-1-rank`` of ``2cp`` chunks."""
    m = total // (2 * cp)
    return (
        [c * m + i for c in (rank, 2 * cp - 1 - rank) for i in range(m)]
        if cp > 1
        else list(range(total))
    )


def _reference(q, k, v, allowed, scale, softcap=None):
    """Dense masked softmax (of ``cap·tanh(scores / cap)`` with ``softcap``); query head j
    reads kv head j // (nq / nkv)."""
    heads = [j * k.shape[1] // q.shape[1] for j in range(q.shape[1])]
    scores = (q @ k[:, heads].transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs @ v[:, heads]


def _qkv(total, *, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, 4, total, 8), (2, 2, total, 8), (2, 2, total, dv))
    return [torch.randn(s, dtype=torch.float64, generator=gen).requires_grad_() for s in shapes]


def _check_against_reference(cp, cu, window, tile, *, fused, dv=8, mask_cu=None, softcap=None):
    """Every cp rank's output rows and the rank-summed q/k/v gradients equal the reference."""
    total, scale = cu[-1], 0.37
    q, k, v = _qkv(total, dv=dv)
    ref = _reference(q, k, v, _allowed(cu, window), scale, softcap)
    grad_out = torch.randn(
        ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9)
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        rows = _rank_rows(total, cp, rank)
        mask = build_block_mask(
            len(rows),
            cp_rank=rank,
            cp_size=cp,
            cu_seqlens=torch.tensor(mask_cu or cu),
            window=window,
            tile=tile,
        )
        out = block_attention(q[:, :, rows], k, v, mask, scale=scale, fused=fused, softcap=softcap)
        assert_close_at_scale(out, ref[:, :, rows], name=f"rank {rank} output", **FP64)
        for total_grad, grad in zip(
            grads, torch.autograd.grad(out, (q, k, v), grad_out[:, :, rows])
        ):
            total_grad += grad
    for name, grad, ref_grad in zip("qkv", grads, ref_grads):
        assert_close_at_scale(grad, ref_grad, name=f"d{name}", **FP64)


@pytest.mark.parametrize(("cp", "cu", "window", "tile"), LAYOUTS)
def test_block_mask_rows_match_loops_and_keep_masks_small(cp, cu, window, tile):
    total = cu[-1]
    full = _allowed(cu, window)
    for rank in range(cp):
        rows = _rank_rows(total, cp, rank)
        mask = build_block_mask(
            len(rows),
            cp_rank=rank,
            cp_size=cp,
            cu_seqlens=torch.tensor(cu),
            window=window,
            tile=tile,
        )
        assert torch.equal(mask.to_dense(), full[rows])
        for seg in mask.segments:
            for piece in seg.pieces(window):
                if piece.kind == "banded":  # the only explicit mask, bounded per tile
                    assert seg.stop - seg.start <= tile
                    assert piece.stop - piece.start <= tile + window - 1


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-segment-sdpa"])
@pytest.mark.parametrize(("cp", "cu", "window", "tile"), LAYOUTS)
def test_block_attention_matches_dense_masked_softmax(cp, cu, window, tile, fused):
    _check_against_reference(cp, cu, window, tile, fused=fused)


@pytest.mark.parametrize(("cp", "cu", "window", "tile"), [LAYOUTS[2], LAYOUTS[3], LAYOUTS[7]])
def test_softcapped_segments_match_dense_reference(cp, cu, window, tile):
    """Explicit capped scores per segment, grouped-query heads broadcast (not repeated)."""
    _check_against_reference(cp, cu, window, tile, fused=None, softcap=0.6)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=20 must equal .* length 24"):
        build_block_mask(12, cp_size=2, cu_seqlens=torch.tensor([0, 5, 20]))
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 9, 5, 24\] must start at 0 and be"):
        build_block_mask(24, cu_seqlens=torch.tensor([0, 9, 5, 24]))
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        build_block_mask(24, window=0)
    q, k, v = _qkv(24)
    mask = build_block_mask(24, cu_seqlens=torch.tensor([0, 9, 24]))
    with pytest.raises(ValueError, match="fused=True needs CPU tensors, dropout_p=0"):
        block_attention(q, k, v, mask, dropout_p=0.1, fused=True)
    with pytest.raises(ValueError, match="block mask of 24 queries x 24 keys does not fit"):
        block_attention(q[:, :, :12], k, v, mask)


@pytest.mark.parametrize("dv", [5, 11])
def test_value_head_size_differs_from_query_head_size(dv):
    """MLA's layout (v narrower or wider than q/k) on the fused path, which pads to one size."""
    _check_against_reference(2, [0, 3, 11, 13, 24], None, 256, fused=True, dv=dv)


def test_planted_missing_document_boundary_fails_the_check():
    """A mask built without the boundary at 11 lets documents 1 and 2 see each other."""
    _check_against_reference(2, [0, 3, 11, 13, 24], None, 256, fused=True)
    with pytest.raises(AssertionError, match="output"):
        _check_against_reference(
            2, [0, 3, 11, 13, 24], None, 256, fused=True, mask_cu=[0, 3, 13, 24]
        )


def test_planted_unweighted_merge_fails_the_check(monkeypatch):
    """Averaging the two pieces of a segment instead of weighting them by their log-sum-exp."""

    def average(results):
        out = sum(o for o, _ in results) / len(results)
        return out, results[0][1]

    monkeypatch.setattr(masked_attention_module, "_merge", average)
    with pytest.raises(AssertionError, match="output"):
        _check_against_reference(2, [0, 24], None, 256, fused=True)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(
    ("cp", "cu", "window"),
    [(1, [0, 700, 1100, 2048], None), (2, [0, 300, 1500, 2048], None), (2, [0, 2048], 64)],
    ids=["packed", "cp2-packed", "cp2-window"],
)
def test_fused_path_allocates_nothing_quadratic(cp, cu, window):
    """Forward and backward at s=2048 create no tensor bigger than q (b·nq·s_local·d = 16k
    elements here) or one banded tile mask (256 x 319): an [s, s] mask would be 4M elements."""
    total, rows = cu[-1], _rank_rows(cu[-1], cp, 0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, len(rows), 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, total, 8, generator=gen, requires_grad=True) for _ in range(2))
    mask = build_block_mask(len(rows), cp_size=cp, cu_seqlens=torch.tensor(cu), window=window)
    with _LargestTensor() as seen:
        block_attention(q, k, v, mask).sum().backward()
    assert seen.largest <= max(q.numel(), 256 * (256 + 63))
    assert seen.largest < total * total // 16


def _attention_cp2_case(cu: list[int], window: int | None, softcap: float | None):
    """One attention layer at cp=2 vs the dense reference on the whole sequence (fp64)."""
    groups = init_process_groups(ParallelConfig(cp=2))
    total, hidden = cu[-1], 32
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        ffn_hidden_size=48,
        vocab_size=64,
        params_dtype=torch.float64,
        position_embedding_type="none",
        sliding_window=window,  # pattern None: every layer slides
        attn_logit_softcapping=softcap,
    )
    model = GPTModel(cfg, groups)
    attn = model.decoder.layers[0].self_attention
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.4)
    x = torch.randn(total, 1, hidden, dtype=torch.float64, generator=gen)
    grad_out = torch.randn(total, 1, hidden, dtype=torch.float64, generator=gen)
    rows = _rank_rows(total, 2, groups.rank("cp"))
    local = x[rows].clone().requires_grad_()
    out = attn(local, model._attention_inputs(len(rows), torch.tensor(cu), local.device))
    out.backward(grad_out[rows])
    w_qkv = attn.linear_qkv.weight.detach().clone().requires_grad_()
    w_proj = attn.linear_proj.weight.detach()
    whole = x.clone().requires_grad_()
    q, k, v = (whole[:, 0] @ w_qkv.T).split((32, 16, 16), dim=-1)
    q, k, v = (t.reshape(total, -1, 8).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    scale = 8**-0.5
    if softcap is None:
        ctx = _reference(q, k, v, _allowed(cu, window), scale)
    else:
        heads = [j // 2 for j in range(4)]
        scores = torch.tanh((q @ k[:, heads].transpose(-1, -2)) * scale / softcap) * softcap
        scores = scores.masked_fill(~_allowed(cu, window), float("-inf"))
        ctx = torch.softmax(scores, dim=-1) @ v[:, heads]
    ref = (ctx[0].transpose(0, 1).reshape(total, 32) @ w_proj.T).unsqueeze(1)
    ref.backward(grad_out)
    assert_close_at_scale(out, ref[rows], name="output", **FP64)
    assert_close_at_scale(local.grad, whole.grad[rows], name="input grad", **FP64)
    grad = attn.linear_qkv.weight.grad.clone()
    torch.distributed.all_reduce(grad, group=groups.cp)
    assert_close_at_scale(grad, w_qkv.grad, name="qkv weight grad", **FP64)
    return float(out.detach().abs().sum())


def _attention_cp2_cases():
    cu = [0, 5, 13, 14, 24]
    return [
        _attention_cp2_case(cu, None, None),
        _attention_cp2_case(cu, 4, None),
        _attention_cp2_case([0, 24], 5, 0.8),
    ]


@pytest.mark.multirank
def test_attention_cp2_packed_matches_dense_reference():
    """Documents crossing every chunk boundary (chunks of 6), with and without a window and with
    soft-capped scores; the keys' gradient crosses ranks through the gather's reduce-scatter."""
    run_on_ranks(_attention_cp2_cases, 2)
