"""SwiGLU / GeGLU: reference vs plain formulas; the torch backend's hand-written backward and
the Triton kernels vs the autograd reference (forward + grads, token weights)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.activations import geglu_reference, swiglu_reference
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
# The autograd references every backend is held to.
REFERENCES = {
    "swiglu": lambda x, token_weights=None: swiglu_reference(x, token_weights=token_weights),
    "geglu": lambda x, token_weights=None: geglu_reference(x, token_weights=token_weights),
    "geglu_erf": lambda x, token_weights=None: geglu_reference(
        x, token_weights=token_weights, approximate="none"
    ),
}


@pytest.mark.parametrize("name", list(OPS))
def test_reference_is_the_gated_formula(name):
    _, formula, _ = OPS[name]
    ref = REFERENCES[name]
    x = torch.randn(4, 6, 18, dtype=torch.float64)
    tw = torch.rand(4, 6, dtype=torch.float64)
    gate, up = x[..., :9], x[..., 9:]
    torch.testing.assert_close(ref(x), formula(gate, up))
    torch.testing.assert_close(ref(x, token_weights=tw), formula(gate, up) * tw[..., None])
    torch.testing.assert_close(
        ref(x, token_weights=tw[..., None]), formula(gate, up) * tw[..., None]
    )


def _forward_backward(fn, x, tw, gy):
    """Output and gradients (x, then tw if given) of ``fn(x, token_weights=tw)``."""
    y = fn(x, token_weights=tw)
    inputs = [x] if tw is None else [x, tw]
    return (y, *torch.autograd.grad(y, inputs, gy))


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("weights", [None, "flat", "column"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_torch_backend_equals_reference_bit_for_bit(name, weights, dtype):
    # I = 64 is a whole number of vectors on every x86 kernel (AVX2, AVX-512), so the row
    # slices the hand-written backward writes take the same vectorised path as the reference's
    # contiguous tensors: the two must agree exactly, output and every gradient.
    op = OPS[name][0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 128, generator=gen).to(dtype).requires_grad_(True)
    shape = {"flat": (3, 5), "column": (3, 5, 1)}.get(weights)
    tw = None if shape is None else torch.rand(shape, generator=gen).requires_grad_(True)
    gy = torch.randn(3, 5, 64, generator=gen).to(dtype)
    got = _forward_backward(lambda x_, **k: op(x_, backend="torch", **k), x, tw, gy)
    want = _forward_backward(REFERENCES[name], x, tw, gy)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("weighted", [False, True])
def test_inplace_backward_writes_the_gradient_into_the_input(name, weighted):
    # x is a projection's output (not a leaf): its storage receives dL/dx, bit for bit the
    # reference's gradient; a second backward through the spent graph is refused.
    op = OPS[name][0]
    gen = torch.Generator().manual_seed(5)
    leaf = torch.randn(6, 7, 128, generator=gen, requires_grad=True)
    tw = torch.rand(6, 7, generator=gen, requires_grad=True) if weighted else None
    gy = torch.randn(6, 7, 64, generator=gen)
    x = leaf * 1.5
    seen = {}
    x.register_hook(lambda g: seen.setdefault("grad", g))
    y = op(x, token_weights=tw, inplace_backward=True, backend="torch")
    inputs = [leaf] if tw is None else [leaf, tw]
    grads = torch.autograd.grad(y, inputs, gy, retain_graph=True)
    assert seen["grad"].data_ptr() == x.data_ptr()
    x_ref = leaf.detach() * 1.5
    want = _forward_backward(REFERENCES[name], x_ref.requires_grad_(True), tw, gy)
    assert torch.equal(y, want[0])
    assert torch.equal(grads[0], 1.5 * want[1])
    if weighted:
        assert torch.equal(grads[1], want[2])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, inputs, gy)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize(("lead", "inter"), SHAPES)
def test_torch_backend_matches_reference_at_ragged_widths(name, lead, inter, poison):
    # Widths that leave a scalar tail per row: the row-slice writes may round differently from
    # the reference's vectorised kernel, by an ulp. ``poison`` fills fresh buffers with NaN, so a
    # half of the input gradient left unwritten fails.
    op = OPS[name][0]
    torch.manual_seed(2)
    x = torch.randn(*lead, 2 * inter).requires_grad_(True)
    tw = torch.rand(*lead, requires_grad=True)
    gy = torch.randn(*lead, inter)
    got = _forward_backward(lambda x_, **k: op(x_, backend="torch", **k), x, tw, gy)
    want = _forward_backward(REFERENCES[name], x, tw, gy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6)


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
    y_ref = REFERENCES[name](x, token_weights=tw)
    grads_ref = torch.autograd.grad(y_ref, inputs, gy)
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


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inplace_backward_refuses_a_leaf_that_requires_grad(name, backend, request):
    # The backward would write dL/dx over the user's leaf (as apply_rotary's inplace=True
    # would): refused on every backend, before any work.
    op = OPS[name][0]
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    leaf = torch.randn(4, 16, device=device, requires_grad=True)
    before = leaf.detach().clone()
    with pytest.raises(ValueError, match=re.escape(
        "inplace_backward=True on x, a leaf tensor that requires grad")):  # fmt: skip
        op(leaf, inplace_backward=True, backend=backend)
    assert torch.equal(leaf.detach(), before)
    # A leaf without grad has no backward to overwrite it: accepted.
    assert op(leaf.detach(), inplace_backward=True, backend=backend).shape == (4, 8)


def test_inplace_backward_must_be_a_bool():
    with pytest.raises(TypeError, match=re.escape("inplace_backward='False' must be a bool")):
        fk.swiglu(torch.randn(3, 8), inplace_backward="False")


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
