"""RMSNorm / LayerNorm: reference vs torch.nn.functional, Triton vs reference (forward + grads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.launches import count_launches

# (rows, hidden): 70 rows at hidden 100 -> BLOCK_M 32: 3 forward programs, the last partial,
# and 2 persistent backward programs (one walks two row blocks); a single row; a 3-D input.
SHAPES = [(70, 100), (1, 100), (3, 5, 24)]


def _grads(y, inputs, seed=1):
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y)
    return y, torch.autograd.grad(y, inputs, gy)


def test_reference_matches_torch_functional():
    x = torch.randn(6, 40, dtype=torch.float64)
    w, b = torch.randn(40, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    torch.testing.assert_close(
        fk.rms_norm(x, w, eps=1e-6, backend="torch"), F.rms_norm(x, (40,), w, eps=1e-6)
    )
    torch.testing.assert_close(
        fk.layer_norm(x, w, b, eps=1e-5, backend="torch"), F.layer_norm(x, (40,), w, b, eps=1e-5)
    )
    torch.testing.assert_close(
        fk.rms_norm(x, w, zero_centered_gamma=True, backend="torch"),
        F.rms_norm(x, (40,), w + 1, eps=1e-6),
    )


def test_reference_bf16_input_uses_fp32_statistics():
    x = (torch.randn(4, 256) * 30 + 5).to(torch.bfloat16)
    w = torch.randn(256)
    y = fk.layer_norm(x, w, backend="torch")
    assert y.dtype == torch.bfloat16
    expect = F.layer_norm(x.double(), (256,), w.double(), eps=1e-5)
    torch.testing.assert_close(y.double(), expect, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(kind, dtype, shape, triton_device, tol, poison):
    torch.manual_seed(0)
    dev = triton_device
    hidden = shape[-1]
    x = torch.randn(shape, device=dev).to(dtype).requires_grad_(True)
    w = (torch.rand(hidden, device=dev) + 0.5).requires_grad_(True)  # fp32 weight beside fp16 x
    b = torch.randn(hidden, device=dev, requires_grad=True)
    zc = dtype == torch.float32  # exercise both gamma conventions

    def run(backend):
        if kind == "rms":
            y = fk.rms_norm(x, w, eps=1e-6, zero_centered_gamma=zc, backend=backend)
            return _grads(y, [x, w])
        y = fk.layer_norm(x, w, b, zero_centered_gamma=zc, backend=backend)
        return _grads(y, [x, w, b])

    with count_launches() as launches:
        y, grads = run("triton")
    assert launches[f"{kind}_norm_fwd"] == 1 and launches[f"{kind}_norm_bwd"] == 1
    y_ref, grads_ref = run("torch")
    assert y.dtype == dtype and not y.isnan().any()
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(dtype))
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == g_ref.dtype
        torch.testing.assert_close(g.float(), g_ref.float(), **tol(dtype))


def test_triton_layer_norm_without_bias(triton_device, tol, poison):
    x = torch.randn(9, 33, device=triton_device, requires_grad=True)
    w = torch.randn(33, device=triton_device, requires_grad=True)
    y, g = _grads(fk.layer_norm(x, w, backend="triton"), [x, w])
    y_ref, g_ref = _grads(fk.layer_norm(x, w, backend="torch"), [x, w])
    torch.testing.assert_close(y, y_ref, **tol(torch.float32))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **tol(torch.float32))


def test_bad_inputs_name_the_field():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="last dim must be 6"):
        fk.rms_norm(x, torch.randn(6))
    with pytest.raises(ValueError, match=r"bias.shape=\(7,\)"):
        fk.layer_norm(x, torch.randn(8), torch.randn(7))
    with pytest.raises(ValueError, match="eps=0"):
        fk.rms_norm(x, torch.randn(8), eps=0)
    with pytest.raises(ValueError, match=r"x\.dtype=torch\.int64"):
        fk.rms_norm(torch.ones(3, 8, dtype=torch.long), torch.randn(8))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_triton_bf16_on_gpu(kind, cuda_device, tol):
    x = torch.randn(300, 1000, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, device=cuda_device, requires_grad=True)
    f = fk.rms_norm if kind == "rms" else fk.layer_norm
    y, g = _grads(f(x, w, backend="triton"), [x, w])
    y_ref, g_ref = _grads(f(x, w, backend="torch"), [x, w])
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(torch.bfloat16))
    torch.testing.assert_close(g[0].float(), g_ref[0].float(), **tol(torch.bfloat16))
    torch.testing.assert_close(g[1], g_ref[1], atol=0.5, rtol=2e-2)  # sum over 300 bf16 rows
