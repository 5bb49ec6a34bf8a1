"""linear_cross_entropy against logits materialised in the test and ``F.cross_entropy``.

Every reference here computes ``z = hidden @ weight[:vocab]ᵀ`` (soft-capped as Gemma 2 does),
then ``F.cross_entropy(reduction="none")`` times the token weights, and lets autograd give
``d hidden`` and ``d weight``. Chunks are forced small so that every test crosses several token
chunks (a ragged last one) and, for ``grad_in_forward=False``, several vocabulary chunks.

Tolerances: float64 to 8 ulp of each tensor's max (exact up to summation order). float32: the
fused path was measured within 12.5 ulp of max|expected| of the materialised float32 path (loss,
``dh``, ``dW``; 4 seeds, 300 tokens × 1000 classes, softcap and smoothing on and off, both
gradient modes; the torch backend's softmax path 11.0; the materialised path itself is 11.2 ulp
from float64), so 16 ulp; a planted bug (ε/V over the padded instead of the real vocabulary) is
shown to fail it. The torch backend computes an uncapped block's statistics and gradient from one
softmax and a capped block's in separate passes; the cases below cover both.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardwork.fused_kernels as fk
from shardwork.fused_kernels import linear_cross_entropy_op as lce_module
from shardwork.fused_kernels.launches import count_launches

assert_close_at_scale = pytest.importorskip(
    "shardwork.parallel_state.testing"
).assert_close_at_scale

FP32_ULPS = 16


def _data(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.4
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[: max(1, n // 5)]] = -100
    token_weights = torch.rand(n, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), labels, token_weights


def _reference(hidden, weight, labels, token_weights, *, vocab, softcap, smoothing, reduction):
    """Loss, d hidden and d weight from materialised logits and F.cross_entropy."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    z = h @ w[:vocab].t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    per_token = F.cross_entropy(
        z.to(torch.promote_types(z.dtype, torch.float32)),
        labels,
        reduction="none",
        label_smoothing=smoothing,
    )
    weights = token_weights.to(per_token.dtype)
    loss = (per_token * weights).sum()
    if reduction == "mean":
        loss = loss / weights[labels != -100].sum()
    loss.backward(torch.tensor(1.7, dtype=loss.dtype))
    return loss.detach(), h.grad, w.grad


def _fused(hidden, weight, labels, token_weights, **kwargs):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fk.linear_cross_entropy(h, w, labels, token_weights=token_weights, **kwargs)
    loss.backward(torch.tensor(1.7, dtype=loss.dtype))
    return loss.detach(), h.grad, w.grad


def _compare(ours, ref, *, ulps, dtype):
    for name, a, e in zip(("loss", "d hidden", "d weight"), ours, ref):
        assert_close_at_scale(a, e, rtol=0, ulps=ulps, dtype=dtype, name=name)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_float64_equals_materialised_logits(
    grad_in_forward, softcap, smoothing, reduction, monkeypatch, poison
):
    """``poison``: fresh buffers start NaN, so a gradient row or chunk left unwritten fails."""
    n, h, v, vocab = 23, 12, 40, 37  # 3 padding rows at the end of the vocabulary
    # 4 tokens per forward chunk (6 chunks, the last ragged); 7 columns per backward chunk.
    monkeypatch.setattr(lce_module, "_CHUNK_ELEMENTS", 4 * v + 3)
    data = _data(n, h, v, torch.float64)
    data[2][data[2] >= vocab] = 5  # labels must be real classes
    kwargs = dict(softcap=softcap, smoothing=smoothing, reduction=reduction)
    ref = _reference(*data, vocab=vocab, **kwargs)
    ours = _fused(*data, vocab_size=vocab, softcap=softcap, label_smoothing=smoothing,
                  reduction=reduction, grad_in_forward=grad_in_forward, backend="torch")  # fmt: skip
    _compare(ours, ref, ulps=8, dtype=torch.float64)
    assert bool((ours[2][vocab:] == 0).all())  # padding rows get no gradient


@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_float32_within_measured_tolerance_of_materialised_path(
    grad_in_forward, softcap, monkeypatch
):
    monkeypatch.setattr(lce_module, "_CHUNK_ELEMENTS", 13 * 300)
    hidden, weight, labels, token_weights = _data(200, 48, 300, torch.float32, seed=3)
    labels, token_weights = labels.clamp(max=289), token_weights.float()
    kwargs = dict(softcap=softcap, smoothing=0.1, reduction="sum")
    ref = _reference(hidden, weight, labels, token_weights, vocab=290, **kwargs)
    ours = _fused(hidden, weight, labels, token_weights, vocab_size=290,
                  softcap=softcap, label_smoothing=0.1, reduction="sum",
                  grad_in_forward=grad_in_forward)  # fmt: skip
    _compare(ours, ref, ulps=FP32_ULPS, dtype=torch.float32)


def test_planted_padded_vocab_in_smoothing_fails_the_float32_tolerance(monkeypatch):
    """ε/V over the padded vocabulary instead of the real one: a plausible bug, caught."""
    hidden, weight, labels, token_weights = _data(200, 48, 300, torch.float32, seed=3)
    labels = labels.clamp(max=289)
    ref = _reference(hidden, weight, labels, token_weights.float(), vocab=290, softcap=None,
                     smoothing=0.1, reduction="sum")  # fmt: skip
    real_layout = lce_module._vocab_layout

    def padded_total(weight, tp_group, vocab_size):
        start, valid, _ = real_layout(weight, tp_group, vocab_size)
        return start, valid, weight.shape[0]

    monkeypatch.setattr(lce_module, "_vocab_layout", padded_total)
    ours = _fused(hidden, weight, labels, token_weights.float(), vocab_size=290,
                  label_smoothing=0.1, reduction="sum")  # fmt: skip
    with pytest.raises(AssertionError, match="loss"):
        _compare(ours, ref, ulps=FP32_ULPS, dtype=torch.float32)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_no_tensor_as_large_as_the_logits_is_created(grad_in_forward, monkeypatch):
    n, h, v = 64, 8, 512  # logits 32768 elements; weight 4096, hidden 512
    monkeypatch.setattr(lce_module, "_CHUNK_ELEMENTS", 2048)
    hidden, weight, labels, _ = _data(n, h, v, torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with _LargestTensor() as seen:
        loss = fk.linear_cross_entropy(hidden, weight, labels, grad_in_forward=grad_in_forward)
        loss.backward()
    assert seen.largest == v * h  # d weight is the largest tensor: no [n, v] buffer exists
    with _LargestTensor() as seen:
        F.cross_entropy(hidden.detach() @ weight.detach().t(), labels)
    assert seen.largest == n * v  # the probe sees the materialised path's logits


def test_no_gradient_work_without_grad(monkeypatch):
    hidden, weight, labels, _ = _data(16, 8, 30, torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    calls = []
    for name in ("shard_grad", "softmax_grad"):  # the capped and the uncapped block's gradient
        real = getattr(lce_module, name)
        spy = lambda *a, real=real, **k: calls.append(1) or real(*a, **k)  # noqa: E731
        monkeypatch.setattr(lce_module, name, spy)
    with torch.no_grad():
        loss = fk.linear_cross_entropy(hidden, weight, labels)
    assert calls == [] and loss.grad_fn is None
    fk.linear_cross_entropy(hidden, weight, labels).backward()
    assert calls == [1]  # the spy sees the gradient when one is wanted
    ref = F.cross_entropy(hidden.detach() @ weight.detach().t(), labels)
    assert_close_at_scale(loss, ref, rtol=0, ulps=FP32_ULPS, dtype=torch.float32, name="loss")


def test_grad_in_forward_refuses_a_second_backward():
    hidden, weight, labels, _ = _data(6, 4, 10, torch.float32)
    hidden.requires_grad_(True)
    loss = fk.linear_cross_entropy(hidden, weight, labels, reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()
    again = fk.linear_cross_entropy(hidden, weight, labels, reduction="sum", grad_in_forward=False)
    first = torch.autograd.grad(again, hidden, retain_graph=True)[0]
    torch.testing.assert_close(torch.autograd.grad(again, hidden)[0], first, rtol=0, atol=0)


def test_bad_inputs_name_the_field():
    hidden, weight, labels, _ = _data(4, 6, 10, torch.float32)
    with pytest.raises(ValueError, match=r"weight.shape=\(10, 5\)"):
        fk.linear_cross_entropy(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match=r"weight\.dtype=torch\.float64"):
        fk.linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="reduction='none'"):
        fk.linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match=r"vocab_size=11 must be an int in \[1, 10\]"):
        fk.linear_cross_entropy(hidden, weight, labels, vocab_size=11)
    with pytest.raises(ValueError, match="softcap=0"):
        fk.linear_cross_entropy(hidden, weight, labels, softcap=0)
    with pytest.raises(ValueError, match=r"token_weights.shape=\(3,\)"):
        fk.linear_cross_entropy(hidden, weight, labels, token_weights=torch.ones(3))
    with pytest.raises(ValueError, match=r"labels.shape=\(3,\)"):
        fk.linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(fk.BackendUnavailableError, match="linear_cross_entropy"):
        fk.linear_cross_entropy(hidden, weight, labels, backend="te")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_labels_past_the_real_vocabulary_are_refused(backend, request):
    # Before this check such a label's logit was taken as 0: loss = logsumexp, silently.
    if backend == "triton" and request.getfixturevalue("triton_device").type != "cpu":
        pytest.skip("the exact check (ValueError) runs on CPU tensors")
    hidden, weight, _, _ = _data(4, 6, 10, torch.float32)

    def loss_of(labels, **kwargs):
        return fk.linear_cross_entropy(
            hidden, weight, torch.tensor(labels), backend=backend, **kwargs
        )

    with pytest.raises(ValueError, match=re.escape(
        "labels[1]=10 is out of range; valid: ignore_index=-100 or 0 <= label < 10 "
        "(weight.shape[0]=10)")):  # fmt: skip
        loss_of([1, 10, -1, 99])
    with pytest.raises(ValueError, match=re.escape(
        "labels[1]=9 is out of range; valid: ignore_index=-100 or 0 <= label < 9 "
        "(vocab_size=9)")):  # fmt: skip
        loss_of([1, 9, 2, 3], vocab_size=9)
    with pytest.raises(ValueError, match=re.escape("labels[0]=-1 is out of range")):
        loss_of([-1, 2, 3, 4])


@pytest.mark.parametrize("ignore_index", [-100, -1])
def test_last_real_class_and_ignore_index_are_accepted(ignore_index):
    hidden, weight, _, _ = _data(4, 6, 10, torch.float64)
    labels = torch.tensor([8, ignore_index, 0, 8])  # vocab_size 9: row 9 is padding
    ours = fk.linear_cross_entropy(hidden, weight, labels, vocab_size=9, ignore_index=ignore_index)
    logits = hidden @ weight[:9].t()
    torch.testing.assert_close(ours, F.cross_entropy(logits, labels, ignore_index=ignore_index))


def test_option_types_are_named():
    hidden, weight, labels, _ = _data(4, 6, 10, torch.float32)
    cases = [
        (
            {"label_smoothing": "0.1"},
            "label_smoothing='0.1' must be a number (int or float), not str",
        ),
        ({"softcap": "30"}, "softcap='30' must be a number (int or float), not str"),
        ({"ignore_index": None}, "ignore_index=None must be an int, not NoneType"),
        ({"grad_in_forward": "no"}, "grad_in_forward='no' must be a bool (True or False), not str"),
    ]
    for kwargs, message in cases:
        with pytest.raises(TypeError, match=re.escape(message)):
            fk.linear_cross_entropy(hidden, weight, labels, **kwargs)
    with pytest.raises(ValueError, match=re.escape("softcap=inf must be a finite number > 0")):
        fk.linear_cross_entropy(hidden, weight, labels, softcap=float("inf"))


# Triton: 7 tokens in chunks of 3 rows (ragged), a vocabulary of 37 classes with 2 rows of
# padding (not a power of two, so the kernels mask their last block), hidden 12.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_triton_matches_materialised_path(dtype, grad_in_forward, triton_device, monkeypatch):
    n, h, v, vocab = 7, 12, 39, 37
    monkeypatch.setattr(lce_module, "_CHUNK_ELEMENTS", 3 * v)
    hidden, weight, labels, token_weights = _data(n, h, v, dtype, seed=5)
    labels = labels.clamp(max=vocab - 1)
    to = dict(device=triton_device)
    hidden, weight, labels = hidden.to(**to), weight.to(**to), labels.to(**to)
    token_weights = token_weights.float().to(**to)
    with count_launches() as launches:
        ours = _fused(hidden, weight, labels, token_weights, vocab_size=vocab, softcap=4.0,
                      label_smoothing=0.1, reduction="sum", grad_in_forward=grad_in_forward,
                      backend="triton")  # fmt: skip
    # One per chunk: 3 token chunks; the backward pass of grad_in_forward=False cuts the 37
    # classes into 3 chunks of 16 columns.
    assert launches["cross_entropy_stats"] == 3 and launches["cross_entropy_grad"] == 3
    ref = _reference(hidden, weight, labels, token_weights, vocab=vocab, softcap=4.0,
                     smoothing=0.1, reduction="sum")  # fmt: skip
    # float16: the GEMMs round to float16 in both paths, at different points of the sums.
    _compare(ours, ref, ulps=FP32_ULPS if dtype == torch.float32 else 4, dtype=dtype)


def _tensor_parallel(
    world_vocab, backend, grad_in_forward, softcap, smoothing, dtype, plant_local_softmax=False
):
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from shardwork.parallel_state import ParallelConfig, init_process_groups

    padded, vocab = world_vocab
    groups = init_process_groups(ParallelConfig(tp=dist.get_world_size()))
    tp = groups.size("tp")
    default_chunk, lce_module._CHUNK_ELEMENTS = lce_module._CHUNK_ELEMENTS, 5 * padded // tp
    combine = lce_module.combine_shard_stats
    if plant_local_softmax:  # planted bug: each rank normalises over its own shard only
        lce_module.combine_shard_stats = lambda stats, tp_group: combine(stats, None)
    try:  # 5 tokens per chunk on every rank; the pooled worker gets its default back
        return _tensor_parallel_loss(groups, padded, vocab, backend, grad_in_forward, softcap,
                                     smoothing, dtype)  # fmt: skip
    finally:
        lce_module._CHUNK_ELEMENTS = default_chunk
        lce_module.combine_shard_stats = combine


def _tensor_parallel_loss(groups, padded, vocab, backend, grad_in_forward, softcap, smoothing,
                          dtype):  # fmt: skip
    rank, tp = groups.rank("tp"), groups.size("tp")
    hidden, weight, labels, token_weights = _data(19, 10, padded, dtype, seed=11)
    labels = labels.clamp(max=vocab - 1)
    shard = weight.chunk(tp, dim=0)[rank]
    h = hidden.clone().requires_grad_(True)
    w = shard.clone().requires_grad_(True)
    loss = fk.linear_cross_entropy(h, w, labels, token_weights=token_weights.to(dtype),
                                   tp_group=groups.tp, vocab_size=vocab, softcap=softcap,
                                   label_smoothing=smoothing, reduction="sum",
                                   grad_in_forward=grad_in_forward, backend=backend)  # fmt: skip
    loss.backward(torch.tensor(1.7, dtype=loss.dtype))
    return loss.detach(), h.grad, w.grad


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("world", "vocab", "backend", "grad_in_forward", "softcap", "smoothing", "dtype"),
    [
        (2, (48, 45), "torch", True, None, 0.1, torch.float64),
        (2, (48, 45), "torch", True, None, 0.0, torch.float64),
        (2, (48, 45), "torch", False, 3.0, 0.0, torch.float64),
        (4, (48, 45), "torch", True, 3.0, 0.1, torch.float64),
        (4, (48, 45), "torch", False, None, 0.1, torch.float64),
        # the last rank holds only padding (vocab 34 of 48: ranks own 12 rows each)
        (4, (48, 34), "torch", True, None, 0.1, torch.float64),
        (4, (48, 34), "torch", False, 3.0, 0.1, torch.float64),
        (2, (48, 45), "triton", True, 3.0, 0.1, torch.float32),
        (2, (48, 45), "triton", False, None, 0.0, torch.float32),
    ],
)
def test_vocab_parallel_equals_single_rank_materialised(
    world, vocab, backend, grad_in_forward, softcap, smoothing, dtype
):
    """Every rank's loss is the world-1 loss; the ranks' ``d hidden`` partials sum (as the
    caller's TP region does) to the world-1 ``d hidden``; the weight shards' gradients
    concatenate to the world-1 ``d weight``."""
    if backend == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            # gloo ranks hold CPU tensors, which only Triton's interpreter runs; the CUDA
            # machine's interpreter fails under its numpy 2.5, and the CUDA kernel itself is
            # compared with the materialised path in test_triton_matches_materialised_path
            pytest.skip("Triton on gloo ranks needs the CPU interpreter (a CPU-only host)")
    args = (vocab, backend, grad_in_forward, softcap, smoothing, dtype)
    _check_against_single_rank(world, args)


@pytest.mark.multirank
def test_planted_shard_local_softmax_fails_the_vocab_parallel_check():
    with pytest.raises(AssertionError, match="loss"):
        _check_against_single_rank(2, ((48, 45), "torch", True, None, 0.1, torch.float64, True))


def _check_against_single_rank(world, args):
    run_on_ranks = pytest.importorskip("shardwork.parallel_state.testing").run_on_ranks
    results = run_on_ranks(_tensor_parallel, world, args=args)
    vocab, _, _, softcap, smoothing, dtype = args[:6]
    padded, real = vocab
    hidden, weight, labels, token_weights = _data(19, 10, padded, dtype, seed=11)
    ref = _reference(hidden, weight, labels.clamp(max=real - 1), token_weights.to(dtype),
                     vocab=real, softcap=softcap, smoothing=smoothing, reduction="sum")  # fmt: skip
    ulps = 8 if dtype == torch.float64 else FP32_ULPS
    for loss, _, _ in results:
        assert_close_at_scale(loss, ref[0], rtol=0, ulps=ulps, dtype=dtype, name="loss")
    d_hidden = sum(r[1] for r in results)
    assert_close_at_scale(d_hidden, ref[1], rtol=0, ulps=ulps, dtype=dtype, name="d hidden")
    d_weight = torch.cat([r[2] for r in results])
    assert_close_at_scale(d_weight, ref[2], rtol=0, ulps=ulps, dtype=dtype, name="d weight")


def _vocab_parallel_label_check():
    """Every rank: the error for label 45 of a 45-class vocabulary padded to 48 over the TP
    group (checked before the first collective), then the loss at labels 44 and -100."""
    import torch.distributed as dist

    from shardwork.parallel_state import ParallelConfig, init_process_groups

    groups = init_process_groups(ParallelConfig(tp=dist.get_world_size()))
    hidden, weight, _, _ = _data(3, 10, 48, torch.float64, seed=11)
    shard = weight.chunk(groups.size("tp"), dim=0)[groups.rank("tp")]
    kwargs = dict(tp_group=groups.tp, vocab_size=45, reduction="sum")
    try:
        fk.linear_cross_entropy(hidden, shard, torch.tensor([3, 45, 0]), **kwargs)
        error = None
    except ValueError as e:
        error = str(e)
    return error, fk.linear_cross_entropy(hidden, shard, torch.tensor([44, -100, 0]), **kwargs)


@pytest.mark.multirank
def test_vocab_parallel_labels_are_checked_against_vocab_size():
    run_on_ranks = pytest.importorskip("shardwork.parallel_state.testing").run_on_ranks
    results = run_on_ranks(_vocab_parallel_label_check, 2)
    hidden, weight, _, _ = _data(3, 10, 48, torch.float64, seed=11)
    labels = torch.tensor([44, -100, 0])
    ref = F.cross_entropy(hidden @ weight[:45].t(), labels, reduction="sum")
    for error, loss in results:
        assert error == (
            "labels[1]=45 is out of range; valid: ignore_index=-100 or 0 <= label < 45 "
            "(vocab_size=45)"
        )
        torch.testing.assert_close(loss, ref)
