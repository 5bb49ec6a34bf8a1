"""The experts' SwiGLU MLP run group by group (``grouped_swiglu_mlp``) against a float64 loop over
experts written here, the unfused grouped path, and its memory and input contracts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwork.fused_kernels import grouped_swiglu_mlp, onednn_grouped_linear, swiglu

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="this torch build has no oneDNN",
)

# Measured over seeds 0-5 of these shapes: the float32 output and gradients differ from float64 by
# at most 1.3e-6 of the largest |entry| (products of up to 512 terms); 4e-6 leaves ~3x. A row
# given another expert's weights is off by O(1) (the misrouting test below).
RTOL_OF_MAX = 4e-6

# One expert without rows, two below 256 rows (MKL products; on AMD's family 26 the 130-row one
# takes oneDNN, from 128 rows), two from 256 (oneDNN products; with f = 2H, fc2's weight
# gradient too, fc1's stays on MKL before family 26).
COUNTS = [300, 0, 130, 7, 270]
H, F_ = 256, 512


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def _operands(seed: int, counts=COUNTS, hidden=H, ffn=F_):
    g = torch.Generator().manual_seed(seed)
    n, L = sum(counts), len(counts)
    x = torch.randn(n, hidden, generator=g)
    w1 = torch.randn(L, 2 * ffn, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(L, hidden, ffn, generator=g) / ffn**0.5
    probs = torch.rand(n, generator=g)
    dy = torch.randn(n, hidden, generator=g)
    return x, w1, w2, probs, dy


def _float64_loop(x, w1, w2, probs, counts):
    """Expert by expert in float64: ``(silu(gate) · up · p) · W2ᵀ`` with ``[gate | up] = x · W1ᵀ``."""
    out, start = [], 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        gate, up = (x[rows] @ w1[e].t()).chunk(2, dim=-1)
        a = F.silu(gate) * up
        if probs is not None:
            a = a * probs[rows, None]
        out.append(a @ w2[e].t())
    return torch.cat(out)


@pytest.mark.parametrize("with_probs", [True, False])
def test_output_and_every_gradient_equal_a_float64_loop_over_experts(with_probs):
    x, w1, w2, probs, dy = _operands(0)
    probs = probs if with_probs else None
    leaves = [t.requires_grad_() for t in (x, w1, w2, probs) if t is not None]
    y = grouped_swiglu_mlp(x, w1, w2, COUNTS, probs)
    y.backward(dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_probs = ref_leaves[3] if with_probs else None
    ref = _float64_loop(*ref_leaves[:3], ref_probs, COUNTS)
    ref.backward(dy.double())
    assert y.shape == (sum(COUNTS), H) and y.dtype == torch.float32
    assert _rel(y, ref) < RTOL_OF_MAX
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert got.grad.shape == got.shape
        assert _rel(got.grad, want.grad) < RTOL_OF_MAX
    assert not w1.grad[1].any() and not w2.grad[1].any()  # the expert without rows


def test_a_misrouted_group_is_caught_at_this_tolerance():
    x, w1, w2, probs, _ = _operands(1)
    y = grouped_swiglu_mlp(x, w1, w2, COUNTS, probs)
    wrong = [COUNTS[0] - 1, 1, *COUNTS[2:]]  # one row computed with the next expert's weights
    ref = _float64_loop(x.double(), w1.double(), w2.double(), probs.double(), wrong)
    assert _rel(y, ref) > 100 * RTOL_OF_MAX


def test_equals_the_unfused_grouped_path_bit_for_bit():
    x, w1, w2, probs, dy = _operands(2)
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, probs)]
        xl, w1l, w2l, pl = leaves
        if fused:
            y = grouped_swiglu_mlp(xl, w1l, w2l, COUNTS, pl)
        else:
            h = onednn_grouped_linear(xl, w1l, COUNTS)
            h = swiglu(h, token_weights=pl, inplace_backward=True, backend="torch")
            y = onednn_grouped_linear(h, w2l, COUNTS)
        y.backward(dy)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for fused, unfused in zip(*results, strict=True):
        assert torch.equal(fused, unfused)


def test_saves_what_the_unfused_path_saves():
    """Activation memory for backward (beyond the caller's own ``x``, weights and routing
    weights): fc1's ``[N, 2f]``, ``silu(gate)`` and fc2's input ``[N, f]`` each, as the unfused
    path, so one memory estimate holds for both."""
    x, w1, w2, probs, _ = _operands(3)
    leaves = [t.requires_grad_() for t in (x, w1, w2, probs)]
    held = {t.untyped_storage().data_ptr() for t in leaves}

    def saved_bytes(run) -> int:
        storages = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in held:
                storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return sum(storages.values())

    fused = saved_bytes(lambda: grouped_swiglu_mlp(x, w1, w2, COUNTS, probs))
    unfused = saved_bytes(
        lambda: onednn_grouped_linear(
            swiglu(onednn_grouped_linear(x, w1, COUNTS), token_weights=probs, backend="torch"),
            w2,
            COUNTS,
        )
    )
    assert fused == sum(COUNTS) * (2 * F_ + F_ + F_) * 4
    assert unfused == fused


def test_computes_only_the_gradients_asked_for():
    x, w1, w2, probs, dy = _operands(4)
    w2.requires_grad_()  # x, w1 and the routing weights are constants here
    grouped_swiglu_mlp(x, w1, w2, COUNTS, probs).backward(dy)
    assert x.grad is None and w1.grad is None and probs.grad is None
    w2_ref = w2.detach().double().requires_grad_()
    _float64_loop(x.double(), w1.double(), w2_ref, probs.double(), COUNTS).backward(dy.double())
    assert _rel(w2.grad, w2_ref.grad) < RTOL_OF_MAX


def test_backpropagates_once_only():
    x, w1, w2, probs, dy = _operands(5)
    w1.requires_grad_()
    y = grouped_swiglu_mlp(x, w1, w2, COUNTS, probs)
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=torch.float64), r"x_NH is torch.float64 on cpu: float32 CPU tensors only"),
        (dict(counts=[300, 0, 130, 7]), r"must hold 5 non-negative row counts"),
        (dict(counts=[300, 0, 130, 7, 271]), r"summing to x_NH's 707 rows"),
        (dict(w2=(5, H, 7)), r"expected \[N, H\], \[L, 2f, H\] and \[L, H, f\]"),
        (dict(w1=(5, 2 * F_)), r"w1_LFH=\(5, 1024\), .*expected \[N, H\], \[L, 2f, H\]"),
        (dict(probs=(707, 2)), r"probs_N.shape=\(707, 2\): expected \[707\] or \[707, 1\]"),
    ],
)
def test_bad_operands_are_refused_by_name(change, message):
    x, w1, w2, probs, _ = _operands(6)
    if "x" in change:
        x = x.to(change["x"])
    if "w1" in change:
        w1 = torch.randn(change["w1"])
    if "w2" in change:
        w2 = torch.randn(change["w2"])
    if "probs" in change:
        probs = torch.rand(change["probs"])
    with pytest.raises(ValueError, match=message):
        grouped_swiglu_mlp(x, w1, w2, change.get("counts", COUNTS), probs)
