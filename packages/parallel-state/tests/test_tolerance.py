"""assert_close_at_scale: the bound atol = ulps * eps(dtype) * max|expected| + rtol * |e|."""

import pytest
import torch

from shardwork.parallel_state.testing import assert_close_at_scale, scale_atol, ulps_of_scale


def _expected(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(6, 7, generator=g, dtype=torch.float64) * 3.0).to(dtype)


def test_scale_atol_is_the_formula():
    e = _expected()
    want = 8 * 2.0**-23 * float(e.abs().max())  # fp32 eps = 2^-23, written out independently
    assert scale_atol(e, ulps=8) == pytest.approx(want, rel=1e-12)
    want16 = 2 * 2.0**-7 * float(e.abs().max())  # bf16 eps = 2^-7
    assert scale_atol(e, ulps=2, dtype=torch.bfloat16) == pytest.approx(want16, rel=1e-12)


def test_ulps_of_scale_measures_the_worst_element():
    e = _expected(torch.float64)
    a = e.clone()
    a[2, 3] += 3 * 2.0**-23 * float(e.abs().max())
    assert ulps_of_scale(a, e, dtype=torch.float32) == pytest.approx(3.0, rel=1e-9)
    assert ulps_of_scale(e, e) == 0.0


def test_bound_is_atol_plus_rtol_at_the_edge():
    e = _expected(torch.float64)
    worst = int(e.abs().argmin())  # the element where atol, not rtol, dominates
    bound = 8 * 2.0**-23 * float(e.abs().max()) + 1e-6 * abs(float(e.flatten()[worst]))
    inside, outside = e.clone(), e.clone()
    inside.view(-1)[worst] += 0.99 * bound
    outside.view(-1)[worst] += 1.01 * bound
    assert_close_at_scale(inside, e, dtype=torch.float32, name="x")
    with pytest.raises(AssertionError, match=r"x: 1 of 42 elements .*max error") as info:
        assert_close_at_scale(outside, e, dtype=torch.float32, name="x")
    assert f"{1.01 * bound:.3e}" in str(info.value)
    assert f"atol={8 * 2.0**-23 * float(e.abs().max()):.3e}" in str(info.value)


def test_integers_are_exact_and_shapes_checked():
    m = torch.randint(0, 5, (4, 3), generator=torch.Generator().manual_seed(1))
    assert_close_at_scale(m.clone(), m, name="map")
    off = m.clone()
    off[0, 0] += 1
    with pytest.raises(AssertionError, match="map: integer tensors differ in 1 of 12"):
        assert_close_at_scale(off, m, name="map")
    with pytest.raises(AssertionError, match=r"shape \(3, 4\)"):
        assert_close_at_scale(m.T, m, name="map")


def test_nan_and_inf_must_sit_in_the_same_places():
    e = _expected()
    e[0, 0], e[1, 1] = float("nan"), float("inf")
    assert_close_at_scale(e.clone(), e)
    moved = e.clone()
    moved[0, 0], moved[0, 1] = 1.0, float("nan")
    with pytest.raises(AssertionError, match="NaN/inf"):
        assert_close_at_scale(moved, e)
    with pytest.raises(ValueError, match=r"dtype=torch\.int64"):
        scale_atol(e, dtype=torch.int64)
