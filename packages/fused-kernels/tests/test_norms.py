"""RMSNorm / LayerNorm: reference vs torch.nn.functional; the torch backend's closed-form
RMSNorm backward and the Triton kernels vs the autograd reference (forward + grads)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.launches import count_launches
from shardwork.fused_kernels.norms import layer_norm_reference, rms_norm_reference

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
        rms_norm_reference(x, w, eps=1e-6), F.rms_norm(x, (40,), w, eps=1e-6)
    )
    torch.testing.assert_close(
        layer_norm_reference(x, w, b, eps=1e-5), F.layer_norm(x, (40,), w, b, eps=1e-5)
    )
    torch.testing.assert_close(
        rms_norm_reference(x, w, eps=1e-6, zero_centered_gamma=True),
        F.rms_norm(x, (40,), w + 1, eps=1e-6),
    )


def _rms_outputs(fn, x, w, zc, seed=1):
    y = fn(x, w, eps=1e-6, zero_centered_gamma=zc)
    return _grads(y, [x, w], seed)


def _max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: the error at the tensor's own scale."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("shape", [(256, 4, 512), (70, 100), (1024, 64)])
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_backend_rms_norm_matches_reference(shape, zc, dtype):
    # Forward and the weight gradient are the reference's operations: equal bit for bit. The
    # input gradient's closed form sums in another order: measured <= 1.2e-7 (fp32) and
    # <= 2e-16 (fp64) of max |dx|; bounded at 8 ulp of the dtype.
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen, dtype=dtype) * 3).requires_grad_(True)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).requires_grad_(True)

    def fast(*a, **k):
        return fk.rms_norm(*a, **k, backend="torch")

    y, (dx, dw) = _rms_outputs(fast, x, w, zc)
    y_ref, (dx_ref, dw_ref) = _rms_outputs(rms_norm_reference, x, w, zc)
    assert torch.equal(y, y_ref) and torch.equal(dw, dw_ref)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    bound = 8 * torch.finfo(dtype).eps
    assert _max_relative(dx, dx_ref) <= bound
    # The bound is tight enough to catch a wrong backward: dropping the projection term that
    # normalisation removes (dx = dy · w · rstd) misses by orders of magnitude more.
    with torch.no_grad():
        xf = x.detach()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
        wrong = gy * ((w + 1.0) if zc else w) * rstd
    assert _max_relative(wrong, dx_ref) > 1e4 * bound


def test_torch_backend_rms_norm_bf16_keeps_dtypes():
    # bf16 activations beside an fp32 weight: outputs and gradients in their own dtypes, within
    # one bf16 rounding of the reference (the fp32 intermediates differ by an ulp at most).
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (torch.rand(256, generator=gen) + 0.5).requires_grad_(True)
    y, (dx, dw) = _rms_outputs(lambda *a, **k: fk.rms_norm(*a, **k, backend="torch"), x, w, False)
    y_ref, (dx_ref, dw_ref) = _rms_outputs(rms_norm_reference, x, w, False)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert torch.equal(y, y_ref) and torch.equal(dw, dw_ref)
    assert _max_relative(dx, dx_ref) <= torch.finfo(torch.bfloat16).eps


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
    if kind == "rms":
        y_ref = rms_norm_reference(x, w, eps=1e-6, zero_centered_gamma=zc)
        y_ref, grads_ref = _grads(y_ref, [x, w])
    else:
        y_ref, grads_ref = _grads(layer_norm_reference(x, w, b, zero_centered_gamma=zc), [x, w, b])
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


@pytest.mark.parametrize("op", [fk.rms_norm, fk.layer_norm])
def test_number_arguments_are_checked_by_name(op):
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(
        TypeError, match=re.escape("eps='1e-5' must be a number (int or float), not str")
    ):
        op(x, w, eps="1e-5")
    with pytest.raises(TypeError, match=re.escape("eps=True must be a number")):
        op(x, w, eps=True)
    with pytest.raises(ValueError, match=re.escape("eps=inf must be a finite number > 0")):
        op(x, w, eps=float("inf"))
    with pytest.raises(TypeError, match=re.escape("zero_centered_gamma=1 must be a bool")):
        op(x, w, zero_centered_gamma=1)
    # An int eps is a number: accepted.
    torch.testing.assert_close(op(x, w, eps=1), op(x, w, eps=1.0))


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
