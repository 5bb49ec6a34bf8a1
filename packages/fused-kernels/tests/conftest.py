"""Test setup for shardwork-fused-kernels.

- Without CUDA, ``TRITON_INTERPRET=1`` is set here, before anything imports Triton, so the
  Triton kernels run on CPU tensors through Triton's interpreter.
- ``poison``: while active, ``torch.empty``/``torch.empty_like`` return NaN-filled
  (float) or sentinel-filled (integer/bool) tensors, so any output element a kernel
  forgets to write shows up.
- ``tol``: per-dtype (atol, rtol) used by every comparison with the reference.
- ``triton_device``: where Triton kernels run (cuda if present, else cpu + interpreter).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (5e-5, 5e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}

_real_empty = torch.empty
_real_empty_like = torch.empty_like


def _fill(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(77)


@pytest.fixture
def poison(monkeypatch):
    """Make freshly allocated tensors NaN (or a sentinel) so unwritten outputs are caught."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _fill(_real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _fill(_real_empty_like(*a, **k)))
    yield


@pytest.fixture
def tol():
    """``tol(dtype) -> dict(atol=, rtol=)`` for ``torch.testing.assert_close``."""

    def get(dtype: torch.dtype) -> dict:
        atol, rtol = TOLERANCES[dtype]
        return {"atol": atol, "rtol": rtol}

    return get


@pytest.fixture
def triton_device():
    pytest.importorskip("triton")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")
