"""Compare float results at the rounding of their own scale, integer results exactly.

A GEMM's or reduction's summation order depends on the BLAS kernel the CPU picks (AVX-512,
AVX2, plain), so a float result made on one machine differs from the same computation on
another in its last bits. The difference scales with the largest values of the tensor, not
with each element: an element near zero that is a sum of large terms carries the rounding of
those terms. The portable tolerance is therefore

    |actual - expected| <= atol + rtol * |expected|,   atol = ulps * eps(dtype) * max|expected|

where ``dtype`` is the precision the result was computed in (fp32 for an fp32 router even
when compared in fp64) and ``ulps`` a margin over the measured spread. Integer and boolean
tensors (routing maps, token counts, indices) are compared exactly.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close_at_scale", "scale_atol", "ulps_of_scale"]


def _compute_dtype(expected: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    dtype = expected.dtype if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} has no rounding unit; pass a floating dtype")
    return dtype


def scale_atol(expected: torch.Tensor, *, ulps: float = 8, dtype: torch.dtype | None = None):
    """``ulps * eps(dtype) * max|expected|`` over the finite elements (0.0 when there are none)."""
    eps = torch.finfo(_compute_dtype(expected, dtype)).eps
    finite = expected.detach()[torch.isfinite(expected.detach())]
    if finite.numel() == 0:
        return 0.0
    return float(ulps) * eps * float(finite.abs().max().double())


def ulps_of_scale(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None
) -> float:
    """Largest ``|actual - expected|`` in units of ``eps(dtype) * max|expected|``: the
    measurement from which ``ulps`` is chosen (0.0 for equal tensors or an all-zero scale)."""
    one_ulp = scale_atol(expected, ulps=1, dtype=dtype)
    diff = (actual.detach().double() - expected.detach().double()).abs()
    diff = diff[torch.isfinite(diff)]
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst == 0.0:
        return 0.0
    return worst / one_ulp if one_ulp > 0 else float("inf")


def assert_close_at_scale(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float = 1e-6,
    ulps: float = 8,
    dtype: torch.dtype | None = None,
    name: str = "tensor",
) -> None:
    """Assert ``actual`` matches ``expected`` to rounding at the tensor's own scale.

    Floats: ``|a - e| <= ulps * eps(dtype) * max|e| + rtol * |e|`` elementwise, with NaN/inf
    in the same places. Integer and boolean tensors: equal. Shapes must match either way.
    ``dtype`` is the precision the result was computed in (default: ``expected.dtype``).
    The error names the tensor, the worst element, the max error and the tolerance.
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    if not expected.dtype.is_floating_point and not actual.dtype.is_floating_point:
        if not torch.equal(actual, expected):
            count = int((actual != expected).sum())
            raise AssertionError(
                f"{name}: integer tensors differ in {count} of {expected.numel()} elements "
                "(compared exactly)"
            )
        return
    a, e = actual.detach().double(), expected.detach().double()
    for where in (torch.isnan, torch.isposinf, torch.isneginf):
        if not torch.equal(where(a), where(e)):
            raise AssertionError(f"{name}: NaN/inf in different places than expected")
    atol = scale_atol(expected, ulps=ulps, dtype=dtype)
    finite = torch.isfinite(e)
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    bound = atol + rtol * e.abs()
    bad = err > bound
    if bool(bad.any()):
        worst = int(torch.argmax(torch.where(bad, err - bound, torch.zeros_like(err))))
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), e.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {e.numel()} elements out of tolerance; "
            f"max error {float(err.max()):.3e} "
            f"({ulps_of_scale(a, e, dtype=_compute_dtype(expected, dtype)):.1f} ulp of max|expected|); "
            f"worst at {index}: {float(a.flatten()[worst]):.9g} vs {float(e.flatten()[worst]):.9g}; "
            f"tolerance atol={atol:.3e} ({ulps} ulp of max|expected|={float(e[finite].abs().max()):.3e})"
            f" + rtol={rtol:g}*|expected|"
        )
