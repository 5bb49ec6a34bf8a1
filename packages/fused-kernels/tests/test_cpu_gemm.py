"""oneDNN CPU products (``cpu_gemm``) against float64 products written here, and where they run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from shardwork.fused_kernels import (
    cpu_gemm,
    linear,
    linear_cross_entropy,
    onednn_grouped_linear,
    onednn_linear,
    onednn_preferred,
)

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="this torch build has no oneDNN",
)

# Measured: the float32 products here (K <= 256 terms, oneDNN and MKL) differ from float64 by at
# most 5.4e-7 of the largest |entry|; 2e-6 leaves ~3.7x. A misrouted row is O(1).
RTOL_OF_MAX = 2e-6


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture
def amd(monkeypatch):
    """Pretend the CPU is not Intel's, so ``auto`` takes oneDNN on any machine (whatever
    ``SHARDWORK_CPU_GEMM`` the shell running the tests set)."""
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.delenv(cpu_gemm.CPU_GEMM_ENV, raising=False)


def test_linear_forward_and_gradients_equal_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 37, generator=g).requires_grad_()
    w = torch.randn(29, 37, generator=g).requires_grad_()
    b = torch.randn(29, generator=g).requires_grad_()
    dy = torch.randn(5, 3, 29, generator=g)
    y = onednn_linear(x, w, b)
    y.backward(dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = x64 @ w64.t() + b64
    y64.backward(dy.double())
    assert y.shape == (5, 3, 29) and y.dtype == torch.float32
    assert _rel(y, y64) < RTOL_OF_MAX
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert got.shape == ref.shape
        assert _rel(got, ref) < RTOL_OF_MAX


def test_linear_computes_only_the_gradients_asked_for():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 16, generator=g)
    w = torch.randn(8, 16, generator=g).requires_grad_()  # a trained weight, a constant input
    onednn_linear(x, w).sum().backward()
    assert _rel(w.grad, torch.ones(11, 8).double().t() @ x.double()) < RTOL_OF_MAX
    frozen = torch.randn(8, 16, generator=g)  # a frozen (LoRA base) weight
    xg = torch.randn(11, 16, generator=g).requires_grad_()
    onednn_linear(xg, frozen).sum().backward()
    assert _rel(xg.grad, torch.ones(11, 8).double() @ frozen.double()) < RTOL_OF_MAX


def test_grouped_linear_equals_per_group_float64_products():
    g = torch.Generator().manual_seed(2)
    # Groups of >= 256 rows take oneDNN, smaller ones MKL in place; an empty group too.
    counts = [257, 0, 5, 300]
    x = torch.randn(562, 256, generator=g).requires_grad_()
    w = torch.randn(4, 13, 256, generator=g).requires_grad_()
    dy = torch.randn(562, 13, generator=g)
    y = onednn_grouped_linear(x, w, counts)
    y.backward(dy)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    groups = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    y64 = torch.einsum("ni,noi->no", x64, w64[groups])
    y64.backward(dy.double())
    assert _rel(y, y64) < RTOL_OF_MAX
    assert _rel(x.grad, x64.grad) < RTOL_OF_MAX
    assert _rel(w.grad, w64.grad) < RTOL_OF_MAX
    assert torch.equal(w.grad[1], torch.zeros(13, 256))  # the empty group's weight gradient
    # The tolerance sees a misrouted row: one row moved from group 3 to group 2.
    wrong = onednn_grouped_linear(x.detach(), w.detach(), [257, 0, 6, 299])
    assert _rel(wrong, y64) > 1e-2


@pytest.fixture
def onednn_calls(monkeypatch):
    """Counts the products that reach oneDNN through ``cpu_gemm.onednn_mm_nt``."""
    calls = []

    def counted(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")

    monkeypatch.setattr(cpu_gemm, "onednn_mm_nt", counted)
    return calls


CPUS = {  # name -> (vendor, family) as /proc/cpuinfo gives them
    "zen4": ("AuthenticAMD", 25),
    "zen5": ("AuthenticAMD", 26),
    "later amd": ("AuthenticAMD", 27),
    "intel": ("GenuineIntel", 6),  # reaches weight_grad_mm only with SHARDWORK_CPU_GEMM=onednn
    "unreadable": ("", None),
}
# (rows, out, in) -> on oneDNN before AMD's family 26 (a weight at least twice as wide as tall,
# rows and both widths >= 256), and from it (rows and both widths >= 128, any shape).
WEIGHT_GRAD_CASES = {
    "wide": ((300, 256, 512), True, True),
    "just under twice as wide": ((300, 256, 511), False, True),
    "255 rows": ((255, 256, 512), False, True),
    "out 255": ((300, 255, 600), False, True),
    "tall (fc1)": ((300, 512, 256), False, True),
    "128 rows, out 128, in 128": ((128, 128, 128), False, True),
    "127 rows": ((127, 256, 512), False, False),
    "out 127": ((300, 127, 600), False, False),
    "in 127": ((300, 256, 127), False, False),
}


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("case", WEIGHT_GRAD_CASES)
def test_weight_grad_takes_onednn_by_shape_and_cpu(case, cpu, onednn_calls, monkeypatch):
    vendor, family = CPUS[cpu]
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_gemm, "cpu_family", lambda: family)
    (rows, out, inp), before_zen5, from_zen5 = WEIGHT_GRAD_CASES[case]
    on_onednn = from_zen5 if cpu in ("zen5", "later amd") else before_zen5
    g = torch.Generator().manual_seed(4)
    dy, x = torch.randn(rows, out, generator=g), torch.randn(rows, inp, generator=g)
    ref = dy.double().t() @ x.double()
    fresh = cpu_gemm.weight_grad_mm(dy, x)
    stacked = torch.randn(3, out, inp, generator=g)
    written = cpu_gemm.weight_grad_mm(dy, x, stacked[1])
    assert len(onednn_calls) == (2 if on_onednn else 0)
    assert fresh.shape == (out, inp) and written.data_ptr() == stacked[1].data_ptr()
    assert _rel(fresh, ref) < RTOL_OF_MAX and _rel(stacked[1], ref) < RTOL_OF_MAX
    # The tolerance sees one token's row left out of the sum.
    assert _rel(cpu_gemm.weight_grad_mm(dy[1:], x[1:]), ref) > 1e-3


# (rows, inner width) of a group's product -> on oneDNN before AMD's family 26 (both >= 256),
# and from it (both >= 128).
GROUP_CASES = {
    "256 x 256": ((256, 256), True, True),
    "255 rows": ((255, 256), False, True),
    "width 255": ((256, 255), False, True),
    "128 x 128": ((128, 128), False, True),
    "127 rows": ((127, 256), False, False),
    "width 127": ((256, 127), False, False),
}


@pytest.mark.parametrize("cpu", ["zen4", "zen5"])
@pytest.mark.parametrize("case", GROUP_CASES)
def test_group_product_takes_onednn_from_the_cpus_group_size(case, cpu, onednn_calls, monkeypatch):
    vendor, family = CPUS[cpu]
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_gemm, "cpu_family", lambda: family)
    (rows, width), before_zen5, from_zen5 = GROUP_CASES[case]
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(rows, width, generator=g), torch.randn(96, width, generator=g)
    stacked = torch.randn(rows + 5, 96, generator=g)
    fresh = cpu_gemm.group_mm_nt(a, b)
    written = cpu_gemm.group_mm_nt(a, b, stacked[2 : rows + 2])
    assert len(onednn_calls) == (2 if (from_zen5 if cpu == "zen5" else before_zen5) else 0)
    ref = a.double() @ b.double().t()
    assert _rel(fresh, ref) < RTOL_OF_MAX and _rel(written, ref) < RTOL_OF_MAX
    assert written.data_ptr() == stacked[2].data_ptr()


def test_cpu_vendor_and_family_are_the_first_processors():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    family = re.search(r"^cpu family\s*:\s*(\d+)", text, re.M)
    assert cpu_gemm.cpu_vendor() == (vendor.group(1) if vendor else "")
    assert cpu_gemm.cpu_family() == (int(family.group(1)) if family else None)


def test_linear_weight_gradient_of_a_wide_weight_runs_on_onednn(onednn_calls):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 150, 768, generator=g).requires_grad_()  # 300 rows
    w = torch.randn(256, 768, generator=g).requires_grad_()  # fc2-shaped: in = 3 x out
    dy = torch.randn(2, 150, 256, generator=g)
    onednn_linear(x, w).backward(dy)
    # Through onednn_mm_nt: the input gradient (b = wᵀ) and the weight gradient (b = xᵀ).
    assert [b for _, b in onednn_calls] == [(768, 256), (768, 300)]
    ref = dy.double().reshape(300, 256).t() @ x.detach().double().reshape(300, 768)
    assert _rel(w.grad, ref) < RTOL_OF_MAX


def test_grouped_linear_refuses_counts_that_do_not_cover_the_rows():
    x, w = torch.randn(6, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"counts=\[2, 3\] must have 2 entries .* 6 rows"):
        onednn_grouped_linear(x, w, [2, 3])


@pytest.mark.parametrize("backend", [None, "torch"])
def test_linear_names_mismatched_shapes(backend, amd):
    # Before: oneDNN's "could not create a primitive descriptor" (auto) or torch's mat1/mat2
    # message, neither naming the argument.
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=re.escape(
        "weight.shape=(3, 7) must be [out, in] with in = x.shape[-1] = 8 (x.shape=(4, 8))")):  # fmt: skip
        linear(x, torch.randn(3, 7), backend=backend)
    with pytest.raises(ValueError, match=re.escape(
        "bias.shape=(4,) must be (3,) = [out] of weight.shape=(3, 8)")):  # fmt: skip
        linear(x, torch.randn(3, 8), torch.randn(4), backend=backend)
    with pytest.raises(ValueError, match=re.escape("weight.shape=(3, 7) must be [out, in]")):
        onednn_linear(x, torch.randn(3, 7))
    # Matching shapes, with and without a bias: accepted.
    w, b = torch.randn(3, 8), torch.randn(3)
    torch.testing.assert_close(linear(x, w, b, backend=backend), F.linear(x, w, b))
    assert linear(x, w, backend=backend).shape == (4, 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_onednn_refuses_other_dtypes_by_name(dtype):
    x, w = torch.randn(4, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
    with pytest.raises(ValueError, match=r"^x \(Tensor, torch\.\w+, cpu\) cannot run on oneDNN"):
        onednn_linear(x, w)


def test_auto_takes_onednn_only_off_intel_and_for_float32(amd, monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert onednn_preferred("auto", x, w)
    assert onednn_preferred(None, x, w)  # the process default is "auto"
    assert not onednn_preferred("torch", x, w)  # the MKL reference, by name
    assert not onednn_preferred("triton", x, w)
    assert not onednn_preferred("auto", x.double(), w.double())
    assert not onednn_preferred("auto", x.bfloat16(), w.bfloat16())
    with FlopCounterMode(display=False):  # the counter must see aten.mm
        assert not onednn_preferred("auto", x, w)
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "GenuineIntel")
    assert not onednn_preferred("auto", x, w)
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "")
    assert not onednn_preferred("auto", x, w)
    with pytest.raises(ValueError, match=r"backend='mkl' is not a backend; valid: auto, torch"):
        onednn_preferred("mkl", x, w)


def test_cpu_gemm_variable_overrides_the_vendor_rule(amd, monkeypatch):
    """``SHARDWORK_CPU_GEMM``: ``mkl`` keeps torch's product on a non-Intel CPU, ``onednn``
    takes oneDNN on an Intel one; ``auto`` (or unset) is the vendor rule; a named backend
    still wins; float64 still stays on torch."""
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    expected = {  # (CPU vendor, variable) -> oneDNN
        ("AuthenticAMD", None): True,
        ("AuthenticAMD", "auto"): True,
        ("AuthenticAMD", "mkl"): False,
        ("AuthenticAMD", "onednn"): True,
        ("GenuineIntel", None): False,
        ("GenuineIntel", "auto"): False,
        ("GenuineIntel", "mkl"): False,
        ("GenuineIntel", "onednn"): True,
        ("", "onednn"): True,
    }
    got, products = {}, {}
    for vendor, choice in expected:
        monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda v=vendor: v)
        if choice is None:
            monkeypatch.delenv(cpu_gemm.CPU_GEMM_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, choice)
        got[vendor, choice] = onednn_preferred("auto", x, w)
        assert not onednn_preferred("torch", x, w)
        assert not onednn_preferred("auto", x.double(), w.double())
        y = linear(x.requires_grad_(), w)
        products[vendor, choice] = (type(y.grad_fn).__name__, y.detach())
    assert got == expected
    # The product really runs where the answer says: oneDNN's node and bits, or F.linear's.
    onednn_bits, mkl_bits = onednn_linear(x, w).detach(), F.linear(x, w).detach()
    for key, takes_onednn in expected.items():
        node, y = products[key]
        if takes_onednn:
            assert node == "_OneDnnLinearBackward" and torch.equal(y, onednn_bits), key
        else:
            assert node == type(F.linear(x, w).grad_fn).__name__, key
            assert torch.equal(y, mkl_bits), key


def test_a_bad_cpu_gemm_variable_is_named(amd, monkeypatch):
    from shardwork.fused_kernels import environment_problems

    x, w = torch.randn(4, 8), torch.randn(3, 8)
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "blas")
    message = "SHARDWORK_CPU_GEMM='blas' is not a choice; valid: auto, mkl, onednn (unset: auto)"
    assert environment_problems() == [message]
    with pytest.raises(ValueError) as info:
        onednn_preferred("auto", x, w)
    assert str(info.value) == message
    assert not onednn_preferred("torch", x, w)  # a named backend never reads it
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "onednn")
    assert environment_problems() == []
    monkeypatch.setattr(cpu_gemm, "_onednn_built", lambda: False)
    assert environment_problems() == [
        "SHARDWORK_CPU_GEMM='onednn', but this torch build has no oneDNN; valid here: auto, mkl"
    ]


def test_linear_runs_where_onednn_preferred_says(amd):
    x = torch.randn(6, 8).requires_grad_()
    w = torch.randn(5, 8).requires_grad_()
    auto, plain = linear(x, w, backend="auto"), linear(x, w, backend="torch")
    assert type(auto.grad_fn).__name__ == "_OneDnnLinearBackward"
    assert type(plain.grad_fn).__name__ == type(F.linear(x, w).grad_fn).__name__
    assert _rel(auto, x.double() @ w.double().t()) < RTOL_OF_MAX


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_linear_cross_entropy_on_onednn_equals_the_mkl_reference(amd, grad_in_forward):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 48, generator=g).requires_grad_()
    weight = (0.2 * torch.randn(101, 48, generator=g)).requires_grad_()
    labels = torch.randint(0, 101, (37,), generator=g)
    labels[[4, 20]] = -100
    results = {}
    for backend in ("auto", "torch"):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss = linear_cross_entropy(h, w, labels, backend=backend, grad_in_forward=grad_in_forward)
        loss.backward()
        results[backend] = (loss.detach(), h.grad, w.grad)
    ref = F.cross_entropy((hidden.double() @ weight.double().t()), labels)
    for got in (results["auto"][0], results["torch"][0]):
        assert abs(got.item() - ref.item()) < 1e-5 * abs(ref.item())
    for got, other in zip(results["auto"][1:], results["torch"][1:], strict=True):
        assert _rel(got, other.double()) < RTOL_OF_MAX


# (grad_in_forward, logits per chunk): two token chunks of 300 rows (the first written, the second
# added), or two vocabulary chunks of 260 rows of dW; 600 tokens, vocabulary 520, hidden 128.
LCE_CHUNKS = {"token chunks": (True, 300 * 520), "vocabulary chunks": (False, 600 * 260)}
# Measured over seeds 6-11 of this test: gradients within 1.46e-6 of float64's largest |entry|
# (600 tokens, softmax and two products); 5e-6 leaves 3.4x. A chunk left out is O(0.1).
LCE_RTOL_OF_MAX = 5e-6


@pytest.mark.parametrize("family", [25, 26])
@pytest.mark.parametrize("chunks", LCE_CHUNKS)
def test_linear_cross_entropy_weight_gradient_takes_onednn_from_zen5(
    chunks, family, amd, monkeypatch
):
    from shardwork.fused_kernels import linear_cross_entropy_op

    grad_in_forward, chunk_elements = LCE_CHUNKS[chunks]
    monkeypatch.setattr(cpu_gemm, "cpu_family", lambda: family)
    monkeypatch.setattr(linear_cross_entropy_op, "_CHUNK_ELEMENTS", chunk_elements)
    calls = []

    def counted(dy, x, out=None):
        calls.append(tuple(dy.shape))
        return cpu_gemm.weight_grad_mm(dy, x, out)

    monkeypatch.setattr(linear_cross_entropy_op, "weight_grad_mm", counted)
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(600, 128, generator=g).requires_grad_()
    weight = (0.2 * torch.randn(520, 128, generator=g)).requires_grad_()
    labels = torch.randint(0, 520, (600,), generator=g)
    labels[::7] = -100
    loss = linear_cross_entropy(hidden, weight, labels, grad_in_forward=grad_in_forward)
    loss.backward()
    # oneDNN's weight gradient on family 26 only (family 25: 520 x 128 is tall, MKL's).
    expected = {True: [(300, 520)] * 2, False: [(600, 260)] * 2}[grad_in_forward]
    assert calls == (expected if family == 26 else [])
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    F.cross_entropy(h64 @ w64.t(), labels).backward()
    assert _rel(weight.grad, w64.grad) < LCE_RTOL_OF_MAX
    assert _rel(hidden.grad, h64.grad) < LCE_RTOL_OF_MAX


class _OneDnnOperands(TorchDispatchMode):
    """Records shape and strides of the second operand (``b``, the weight) of every oneDNN
    linear the code under it runs."""

    def __init__(self):
        super().__init__()
        self.weights: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.mkldnn._linear_pointwise.default:
            self.weights.append((tuple(args[1].shape), args[1].stride()))
        return func(*args, **(kwargs or {}))


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row- or column-major dense: the layouts oneDNN's linear reads fast."""
    rows, cols = shape
    return stride in ((cols, 1), (1, rows))


def _strided_weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    """``[40, 200]`` weights whose strides are neither row- nor column-major dense."""
    return {
        "column slice": torch.randn(40, 300, generator=g)[:, :200],
        "transposed column slice": torch.randn(200, 60, generator=g)[:, :40].t(),
        "every other row": torch.randn(80, 200, generator=g)[::2],
    }


@pytest.mark.parametrize("kind", ["column slice", "transposed column slice", "every other row"])
def test_strided_weights_reach_onednn_dense(kind):
    # Any other strides send oneDNN to a reference kernel ~1,400x slower (cpu_gemm_strides.py);
    # the product's values must be the strided operand's.
    g = torch.Generator().manual_seed(6)
    w = _strided_weights(g)[kind].requires_grad_()
    assert not _dense(tuple(w.shape), w.stride())
    x = torch.randn(33, 200, generator=g).requires_grad_()
    dy = torch.randn(33, 40, generator=g)
    with _OneDnnOperands() as seen:
        y = onednn_linear(x, w)
        y.backward(dy)
        z = cpu_gemm.onednn_mm_nt(x.detach(), w.detach())
    # forward, input gradient (b = wᵀ), then onednn_mm_nt; the weight gradient is MKL's here.
    assert len(seen.weights) == 3 and all(_dense(*op) for op in seen.weights), seen.weights
    x64, w64 = x.detach().double(), w.detach().double()
    assert _rel(y, x64 @ w64.t()) < RTOL_OF_MAX and _rel(z, x64 @ w64.t()) < RTOL_OF_MAX
    assert _rel(x.grad, dy.double() @ w64) < RTOL_OF_MAX
    assert _rel(w.grad, dy.double().t() @ x64) < RTOL_OF_MAX


def test_weight_gradient_of_a_column_sliced_input_reaches_onednn_dense():
    # A wide (fc2-shaped) weight's gradient runs on oneDNN with xᵀ as its operand: a view of
    # the slice, whose rows are 700 apart.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(270, 700, generator=g)[:, 100:].requires_grad_()
    w = torch.randn(256, 600, generator=g).requires_grad_()
    dy = torch.randn(270, 256, generator=g)
    with _OneDnnOperands() as seen:
        onednn_linear(x, w).backward(dy)
    assert [shape for shape, _ in seen.weights] == [(256, 600), (600, 256), (600, 270)]
    assert all(_dense(*op) for op in seen.weights), seen.weights
    assert _rel(w.grad, dy.double().t() @ x.detach().double()) < RTOL_OF_MAX


@pytest.mark.parametrize(
    "compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
def test_compiled_linear_computes_on_onednn_as_eager_does(compiler, amd, monkeypatch):
    """Under torch.compile the products go through the custom op to oneDNN (before, a traced
    linear fell back to MKL's aten.mm: 0.75x eager's step on a Zen 5 host); one graph, no
    break, and the same values as the eager oneDNN path."""
    import torch._dynamo

    calls = []
    direct = cpu_gemm._onednn_linear_2d

    def counted(a, b, bias):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return direct(a, b, bias)

    monkeypatch.setattr(cpu_gemm, "_onednn_linear_2d", counted)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 100, 512, generator=g)  # 300 rows
    w = torch.randn(256, 600, generator=g)[:, :512]  # a column slice: made dense inside
    b = torch.randn(256, generator=g)
    dy = torch.randn(3, 100, 256, generator=g)

    def step(fn):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs)
        y.backward(dy)
        return y.detach(), xs.grad, ws.grad, bs.grad

    torch._dynamo.reset()
    frames = []

    def count_frames(gm, example_inputs):
        frames.append(gm)
        return torch._dynamo.lookup_backend(compiler)(gm, example_inputs)

    def auto_linear(x, w, b):  # as the models call it: their kernel backend named
        return linear(x, w, b, backend="auto")

    compiled = step(torch.compile(auto_linear, backend=count_frames, fullgraph=True))
    assert len(frames) == 1
    # forward, input gradient, and the weight gradient (wide weight: oneDNN on every CPU rule),
    # the two gradients in either order
    assert calls[0] == ((300, 512), (256, 512))
    assert sorted(calls[1:]) == [((256, 300), (512, 300)), ((300, 256), (512, 256))]
    eager = step(auto_linear)
    x64, w64 = x.double().reshape(300, 512), w.double()
    refs = (x64 @ w64.t() + b.double(), dy.double().reshape(300, 256) @ w64,
            dy.double().reshape(300, 256).t() @ x64, dy.double().sum((0, 1)))  # fmt: skip
    # The products are oneDNN's on both paths: equal bit for bit; the bias gradient is a sum
    # the compiler may reorder.
    assert all(torch.equal(got, want) for got, want in zip(compiled[:3], eager[:3], strict=True))
    for got, ref in zip(compiled, refs, strict=True):
        assert _rel(got.reshape(ref.shape), ref) < RTOL_OF_MAX
