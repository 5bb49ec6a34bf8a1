"""SwiGLU / GeGLU: reference vs plain formulas, Triton vs reference (forward + grads, token weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.launches import count_launches

# (leading dims, I): I=1030 spans two 1024-wide column blocks (second partial) with
# 3 rows in 2 row programs (second partial); I=37 with 40 rows spans 3 row programs of
# 16; a single token.
SHAPES = [((3,), 1030), ((5, 8), 37), ((1,), 24)]

OPS = {
    "swiglu": (fk.swiglu, lambda g, u: F.silu(g) * u, "swiglu"),
    "geglu": (fk.geglu, lambda g, u: F.gelu(g, approximate="tanh") * u, "geglu_tanh"),
    "geglu_erf": (
        lambda x, **k: fk.geglu(x, approximate="none", **k),
        lambda g, u: F.gelu(g) * u,
        "geglu_erf",
    ),
}


@pytest.mark.parametrize("name", list(OPS))
def test_reference_is_the_gated_formula(name):
    op, formula, _ = OPS[name]
    x = torch.randn(4, 6, 18, dtype=torch.float64)
    tw = torch.rand(4, 6, dtype=torch.float64)
    gate, up = x[..., :9], x[..., 9:]
    torch.testing.assert_close(op(x, backend="torch"), formula(gate, up))
    torch.testing.assert_close(
        op(x, token_weights=tw, backend="torch"), formula(gate, up) * tw[..., None]
    )
    torch.testing.assert_close(
        op(x, token_weights=tw[..., None], backend="torch"), formula(gate, up) * tw[..., None]
    )


# the erf GeGLU shares every code path but the activation: one dtype and two shapes suffice
CASES = [
    (name, dtype, lead, inter)
    for name in OPS
    for dtype in (torch.float32, torch.float16)
    for lead, inter in SHAPES
    if name != "geglu_erf" or (dtype == torch.float32 and lead != (3,))
]


@pytest.mark.parametrize(("name", "dtype", "lead", "inter"), CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_triton_matches_reference(name, dtype, lead, inter, weighted, triton_device, tol, poison):
    op, _, kernel = OPS[name]
    torch.manual_seed(0)
    x = torch.randn(*lead, 2 * inter, device=triton_device).to(dtype).requires_grad_(True)
    tw = torch.rand(*lead, 1, device=triton_device, requires_grad=True) if weighted else None
    inputs = [x] if tw is None else [x, tw]
    gy = torch.randn(*lead, inter, device=triton_device).to(dtype)

    def run(backend):
        y = op(x, token_weights=tw, backend=backend)
        return y, torch.autograd.grad(y, inputs, gy)

    with count_launches() as launches:
        y, grads = run("triton")
    assert launches[f"{kernel}_fwd"] == 1 and launches[f"{kernel}_bwd"] == 1
    y_ref, grads_ref = run("torch")
    assert y.shape == (*lead, inter) and y.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(dtype))
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape
        torch.testing.assert_close(g.float(), g_ref.float(), **tol(dtype))


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="last dim must be even"):
        fk.swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"token_weights.shape=\(4,\)"):
        fk.swiglu(torch.randn(3, 8), token_weights=torch.rand(4))
    with pytest.raises(ValueError, match="approximate='fast'"):
        fk.geglu(torch.randn(3, 8), approximate="fast")


@pytest.mark.gpu
def test_triton_bf16_on_gpu(cuda_device, tol):
    x = torch.randn(4096, 2 * 1408, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    tw = torch.rand(4096, device=cuda_device, requires_grad=True)
    gy = torch.randn(4096, 1408, device=cuda_device, dtype=torch.bfloat16)
    out = {}
    for backend in ("triton", "torch"):
        y = fk.swiglu(x, token_weights=tw, backend=backend)
        out[backend] = (y, *torch.autograd.grad(y, [x, tw], gy))
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a.float(), b.float(), **tol(torch.bfloat16))
