"""grad_stats against plain per-element torch formulas."""

from __future__ import annotations

import pytest
import torch

from shardwork.dist_optimizer.grad_stats import grad_stats


def _pieces(seed: int):
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(n, generator=g) for n in (7, 1, 33, 5)]
    pieces.append(torch.randn(4, 3, generator=g, dtype=torch.float64))
    pieces[2][torch.randperm(33, generator=g)[:6]] = 0.0  # some exact zeros
    pieces[4][1, 2] = 0.0
    return pieces


@pytest.mark.parametrize("count_zeros", [True, False])
def test_sums_and_zeros_over_counted_pieces_only(count_zeros):
    grads, counted = _pieces(0), [True, False, True, False, True]
    got = grad_stats(grads, counted, count_zeros=count_zeros)
    kept = [g for g, c in zip(grads, counted) if c]
    expected_sq = sum(float((g.double() ** 2).sum()) for g in kept)
    expected_zeros = sum(int((g == 0).sum()) for g in kept) if count_zeros else 0
    assert got.dtype == torch.float64
    assert got[0] == 0
    assert got[1].item() == pytest.approx(expected_sq, rel=1e-12)
    assert got[2] == expected_zeros


def test_non_finite_pieces_are_found_counted_or_not():
    grads, counted = _pieces(1), [True, False, True, False, True]
    grads[1][0] = float("nan")  # an uncounted (TP-replicated) piece still fails the check
    grads[2][3] = float("inf")
    grads[2][4] = float("-inf")
    got = grad_stats(grads, counted, count_zeros=True)
    assert got[0] == 2  # pieces holding a non-finite value
    grads[1][0] = 1.0
    assert grad_stats(grads, counted, count_zeros=True)[0] == 1


def test_huge_float32_values_are_finite():
    """Σg² in float64 cannot overflow for float32 gradients: no false non-finite."""
    big = torch.full((1000,), torch.finfo(torch.float32).max)
    got = grad_stats([big], [True], count_zeros=False)
    assert got[0] == 0 and torch.isfinite(got[1])


def test_no_pieces():
    assert torch.equal(grad_stats([], [], count_zeros=True), torch.zeros(3, dtype=torch.float64))
