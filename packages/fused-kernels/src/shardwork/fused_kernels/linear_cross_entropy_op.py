"""Fused linear cross entropy: the output projection and the loss in chunks, never the logits.

``linear_cross_entropy(hidden [N, H], weight [V_local, H], labels [N])`` is
``Σ_i w_i · CE(cap(h_i · Wᵀ), label_i)`` with the vocabulary split over ``tp_group`` as in
:func:`~shardwork.fused_kernels.cross_entropy` (rank r owns ids ``[r·V_local, (r+1)·V_local)``),
without the ``[N, V]`` logits or their gradient ever existing: at most one chunk of
``_CHUNK_ELEMENTS`` logits is alive at a time (on the torch backend, with its float32 softmax
while the chunk's loss and gradient are computed).

- ``grad_in_forward=True`` (3 GEMMs, as many as the unfused path): token chunks; per chunk
  ``z = h_c·Wᵀ``, its statistics (combined over TP: two all-reduces per chunk), the loss, then
  — when a gradient is wanted — ``dz`` written over ``z``, ``dh_c = dz·W`` (each token row once,
  complete) and ``dW += dzᵀ·h_c``. Backward only scales the saved ``dh``/``dW`` by the incoming
  scalar gradient (in place: one backward per forward). Holds ``dh`` and ``dW`` from forward to
  backward; ``dW`` accumulates in float32 for low-precision weights (twice a bf16 weight's size).
  The logits' gradient is formed before the incoming gradient (e.g. an fp16 loss scale) is
  known: for float16, whose small gradients need that scale, use ``grad_in_forward=False``.
- ``grad_in_forward=False`` (4 GEMMs): the forward computes only the loss and keeps ``lse [N]``;
  backward recomputes the logits by *vocabulary* chunks (all tokens × a slice of the shard), so
  each ``dW`` row block is one GEMM written once in the weight's dtype, and ``dh`` accumulates
  over chunks in float32. Holds only what the inputs already hold plus ``lse``.
- Chunking changes only the order of summation: a token's loss is computed from its whole row
  of logits, as in the unfused path; ``dW`` (eager) or ``dh`` (recompute) are sums over chunks.
- ``hidden`` is this rank's copy of the tokens inside the TP region (replicated, or gathered
  along the sequence under sequence parallelism); the returned ``dh`` is this rank's partial,
  which the caller's copy/gather function sums over TP as for any column-parallel linear.
- ``vocab_size``: real classes over the whole group; weight rows past it (vocabulary padding at
  the end) get no logit and a zero gradient. ``softcap``: Gemma 2's final-logit soft-capping,
  applied to each chunk inside the loss. Per-chunk math (statistics and gradient of a block):
  :mod:`~shardwork.fused_kernels.cross_entropy_shard` or the Triton kernels of
  :mod:`~shardwork.fused_kernels.triton_cross_entropy`; the GEMMs are torch's, or oneDNN's for
  float32 CPU tensors where :func:`~shardwork.fused_kernels.cpu_gemm.onednn_preferred`.
- Chunk boundaries depend only on ``N`` and ``V_local``, which every TP rank shares, so the
  per-chunk collectives pair up; the vocabulary pass of the backward has no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwork.fused_kernels._checks import (
    acc_dtype,
    check_bool,
    check_float,
    check_fraction,
    check_int,
    check_labels,
    check_positive,
    check_same_device,
)
from shardwork.fused_kernels.backend import resolve_backend
from shardwork.fused_kernels.cpu_gemm import (
    onednn_mm_nt,
    onednn_preferred,
    weight_grad_mm,
    weight_grad_on_onednn,
)
from shardwork.fused_kernels.cross_entropy_shard import (
    combine_shard_stats,
    shard_grad,
    shard_softmax,
    shard_stats,
    softmax_grad,
)

__all__ = ["linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum")
_CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB in float32


@dataclass(frozen=True)
class _Setup:
    """What the autograd function needs besides tensors (fixed per call)."""

    tp_group: object
    vocab_start: int  # first global id of this rank's shard
    num_valid: int  # real (unpadded) rows of this rank's weight shard
    vocab_total: int  # real classes over the group: the V of label smoothing's ε/V
    smoothing: float
    softcap: float | None
    impl: str
    onednn: bool  # the logits and dh products on oneDNN (cpu_gemm.onednn_preferred)
    eager: bool  # gradients computed in the forward (grad_in_forward and a gradient is wanted)
    need_dh: bool
    need_dw: bool


def _block_fns(impl: str):
    """(stats, grad) of a logits block for the chosen backend."""
    if impl == "triton":
        from shardwork.fused_kernels import triton_cross_entropy

        return triton_cross_entropy.stats, triton_cross_entropy.grad
    return shard_stats, shard_grad


def _accumulate(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
    """``dst = a @ b`` (first chunk) or ``dst += a @ b``; a low-precision product is rounded once
    per chunk, then summed in ``dst``."""
    if dst.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=dst)
        else:
            dst.addmm_(a, b)
    elif first:
        dst.copy_(torch.mm(a, b))
    else:
        dst.add_(torch.mm(a, b))


def _accumulate_weight_grad(dst, dz, h, *, first: bool, onednn: bool) -> None:
    """``dst = dzᵀ·h`` (first chunk) or ``dst += dzᵀ·h``, for ``dz [rows, V]``, ``h [rows, H]``.

    Where the chunk's products take oneDNN (``onednn``), the CPU's weight gradient there too
    (:func:`~shardwork.fused_kernels.cpu_gemm.weight_grad_on_onednn`), but only while ``H <=
    rows``: oneDNN writes a fresh ``[V, H]`` result (then copied or added into ``dst``), which
    stays no larger than the chunk's ``[rows, V]`` logits block, so the chunk's peak memory is
    unchanged. Otherwise torch's product in place (:func:`_accumulate`)."""
    rows, width = h.shape
    on_onednn = onednn and dst.dtype == dz.dtype and width <= rows
    if on_onednn and weight_grad_on_onednn(rows, dz.shape[1], width):
        if first:
            weight_grad_mm(dz, h, out=dst)
        else:
            dst.add_(weight_grad_mm(dz, h))
        return
    _accumulate(dst, dz.t(), h, first=first)


def _chunk_loss(stats, valid, setup: _Setup):
    """``(lse, loss)`` of one token chunk from its block's statistics (collective over TP)."""
    smoothing = setup.smoothing
    lse, target, total = combine_shard_stats(stats, setup.tp_group)
    loss = lse - (1.0 - smoothing) * target
    if smoothing:
        loss = loss - smoothing * total / setup.vocab_total
    return lse, torch.where(valid, loss, 0.0)


def _chunk(z, labels, in_shard, valid, grad_rows, setup: _Setup, want_grad: bool):
    """``(lse, loss, dz)`` of one token chunk's logits block ``z``; ``dz`` (None unless
    ``want_grad``) overwrites ``z``: the chunk's logits are not needed once it exists.

    For a gradient, the torch backend takes the statistics and the gradient from one softmax of
    the block (:func:`~shardwork.fused_kernels.cross_entropy_shard.shard_softmax`, whose float32
    probabilities live only inside this call, beside the block); the loss alone (recompute
    schedule, no grad), soft-capped logits and Triton take separate passes, with no block-sized
    temporary."""
    smoothing, vocab_total = setup.smoothing, setup.vocab_total
    stats_fn, grad_fn = _block_fns(setup.impl)
    one_softmax = want_grad and setup.impl == "torch" and setup.softcap is None
    if one_softmax:
        stats, probs = shard_softmax(z, labels, in_shard, smoothing=smoothing > 0)
    else:
        stats = stats_fn(z, labels, in_shard, smoothing=smoothing > 0, softcap=setup.softcap)
    lse, loss = _chunk_loss(stats, valid, setup)
    if not want_grad:
        return lse, loss, None
    if one_softmax:
        dz = softmax_grad(probs, z, labels, in_shard, stats[:, 0], lse, grad_rows,
                          smoothing=smoothing, vocab_total=vocab_total, out=z)  # fmt: skip
    else:
        dz = grad_fn(z, labels, in_shard, lse, grad_rows, smoothing=smoothing,
                     vocab_total=vocab_total, softcap=setup.softcap, out=z)  # fmt: skip
    return lse, loss, dz


def _token_pass(hidden, weight, local_labels, in_shard, valid, grad_rows, setup: _Setup):
    """Token-chunked forward: per-token losses and lse ``[N]``, and (eager) ``dh`` and ``dW``."""
    n = hidden.shape[0]
    acc = acc_dtype(hidden)
    w_valid = weight[: setup.num_valid]
    losses = torch.empty(n, dtype=acc, device=hidden.device)
    lse_all = torch.empty(n, dtype=acc, device=hidden.device)
    dh = torch.empty_like(hidden) if setup.eager and setup.need_dh else None
    dw = None
    if setup.eager and setup.need_dw:
        dw = torch.empty(weight.shape, dtype=acc_dtype(weight), device=weight.device)
        # Padding rows get no gradient; the real rows are written by the first chunk (or stay 0
        # when there are no tokens).
        (dw[setup.num_valid :] if n else dw).zero_()
    # Rows per chunk from V_local (not num_valid, which differs on the rank holding the padding):
    # every TP rank must cut the same chunks, since each chunk runs collectives.
    step = max(1, _CHUNK_ELEMENTS // max(weight.shape[0], 1))
    buf = None if setup.onednn else hidden.new_empty(min(step, n) * setup.num_valid)
    for a in range(0, n, step):
        b = min(n, a + step)
        if buf is None:
            z = onednn_mm_nt(hidden[a:b], w_valid)
        else:
            z = torch.mm(
                hidden[a:b], w_valid.t(), out=buf[: (b - a) * setup.num_valid].view(b - a, -1)
            )
        lse, loss, dz = _chunk(z, local_labels[a:b], in_shard[a:b], valid[a:b], grad_rows[a:b],
                               setup, want_grad=dh is not None or dw is not None)  # fmt: skip
        losses[a:b], lse_all[a:b] = loss, lse
        if dz is not None:
            if dh is not None and setup.onednn:
                dh[a:b] = onednn_mm_nt(dz, w_valid.t())
            elif dh is not None:
                torch.mm(dz, w_valid, out=dh[a:b])
            if dw is not None:
                _accumulate_weight_grad(dw[: setup.num_valid], dz, hidden[a:b], first=a == 0,
                                        onednn=setup.onednn)  # fmt: skip
        # Free this chunk's logits before the next chunk's product allocates its own.
        del z, dz
    return losses, lse_all, dh, dw


def _vocab_pass(hidden, weight, local_labels, in_shard, lse, grad_rows, setup: _Setup):
    """Backward by vocabulary chunks from the saved ``lse``: ``(dh, dW)`` (None where not needed)."""
    n, h = hidden.shape
    w_valid = weight[: setup.num_valid]
    dw = torch.zeros_like(weight) if setup.need_dw else None  # padding rows stay 0
    dh_acc = None
    if setup.need_dh:
        dh_acc = torch.empty(n, h, dtype=acc_dtype(hidden), device=hidden.device)
        if setup.num_valid == 0:  # no vocabulary chunk writes it
            dh_acc.zero_()
    _, grad_fn = _block_fns(setup.impl)
    step = max(1, _CHUNK_ELEMENTS // max(n, 1))
    buf = None if setup.onednn else hidden.new_empty(n * min(step, setup.num_valid))
    for c0 in range(0, setup.num_valid, step):
        c1 = min(setup.num_valid, c0 + step)
        w_c = w_valid[c0:c1]
        if buf is None:
            z = onednn_mm_nt(hidden, w_c)
        else:
            z = torch.mm(hidden, w_c.t(), out=buf[: n * (c1 - c0)].view(n, -1))
        labels_c = local_labels - c0
        in_chunk = in_shard & (labels_c >= 0) & (labels_c < c1 - c0)
        dz = grad_fn(z, labels_c, in_chunk, lse, grad_rows, smoothing=setup.smoothing,
                     vocab_total=setup.vocab_total, softcap=setup.softcap, out=z)  # fmt: skip
        if dw is not None:
            _accumulate_weight_grad(dw[c0:c1], dz, hidden, first=True, onednn=setup.onednn)
        if dh_acc is not None:
            _accumulate(dh_acc, dz, w_c, first=c0 == 0)
    dh = None if dh_acc is None else dh_acc.to(hidden.dtype)
    return dh, dw


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, setup: _Setup):
        valid = row_weights != 0
        local_labels = labels - setup.vocab_start
        in_shard = valid & (local_labels >= 0) & (local_labels < setup.num_valid)
        losses, lse, dh, dw = _token_pass(
            hidden, weight, local_labels, in_shard, valid, row_weights, setup
        )
        ctx.setup, ctx.weight_dtype, ctx.used = setup, weight.dtype, False
        if setup.eager:
            ctx.save_for_backward(dh, dw)
        elif setup.need_dh or setup.need_dw:
            ctx.save_for_backward(hidden, weight, local_labels, in_shard, lse, row_weights)
        return (losses * row_weights).sum()

    @staticmethod
    def backward(ctx, grad_total):
        setup = ctx.setup
        if not setup.eager:
            hidden, weight, local_labels, in_shard, lse, row_weights = ctx.saved_tensors
            grad_rows = row_weights * grad_total.to(row_weights.dtype)
            dh, dw = _vocab_pass(hidden, weight, local_labels, in_shard, lse, grad_rows, setup)
            return dh, dw, None, None, None
        if ctx.used:
            raise RuntimeError(
                "linear_cross_entropy(grad_in_forward=True) allows one backward per forward (its "
                "gradients are scaled in place); use grad_in_forward=False to backpropagate twice"
            )
        ctx.used = True
        dh, dw = ctx.saved_tensors
        # Scale in place: a scaled copy would be a second dW-sized buffer.
        if dh is not None:
            dh = dh.mul_(grad_total.to(dh.dtype))
        if dw is not None:
            dw = dw.mul_(grad_total.to(dw.dtype)).to(ctx.weight_dtype)
        return dh, dw, None, None, None


def _check_inputs(hidden, weight, labels, token_weights) -> None:
    """Dtypes, shapes and devices of :func:`linear_cross_entropy`'s tensors."""
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"hidden.shape={tuple(hidden.shape)} must be 2-D [N, H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight.shape={tuple(weight.shape)} must be [V_local, H] with H = "
            f"hidden.shape[1] = {hidden.shape[1]}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight.dtype={weight.dtype} must equal hidden.dtype={hidden.dtype} (cast the weight "
            "to the activation dtype, as the output layer does)"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"labels must be an int64/int32 tensor, got {getattr(labels, 'dtype', type(labels))}"
        )
    if tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(f"labels.shape={tuple(labels.shape)} must be ({hidden.shape[0]},) = [N]")
    if token_weights is not None:
        check_float("token_weights", token_weights)
        if tuple(token_weights.shape) != (hidden.shape[0],):
            raise ValueError(
                f"token_weights.shape={tuple(token_weights.shape)} must be "
                f"({hidden.shape[0]},) = [N]"
            )
    check_same_device(hidden=hidden, weight=weight, labels=labels, token_weights=token_weights)


def _check_options(reduction, ignore_index, label_smoothing, softcap, grad_in_forward) -> None:
    """The non-tensor arguments of :func:`linear_cross_entropy`: types first, then values."""
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"reduction={reduction!r}; valid: {', '.join(_REDUCTIONS)} (per-token losses need the "
            "logits: use cross_entropy on the output layer's logits)"
        )
    check_int("ignore_index", ignore_index)
    check_fraction("label_smoothing", label_smoothing)
    if softcap is not None:
        check_positive("softcap", softcap)
    check_bool("grad_in_forward", grad_in_forward)


def _check_labels(labels, ignore_index, vocab_total, vocab_size, world) -> None:
    """Every label is ``ignore_index`` or a real class ``[0, vocab_total)`` (exact on CPU)."""
    if vocab_size is not None:
        classes = f"vocab_size={vocab_size}"
    elif world > 1:
        classes = f"V_local={vocab_total // world} x {world} ranks of tp_group"
    else:
        classes = f"weight.shape[0]={vocab_total}"
    check_labels(labels, ignore_index=ignore_index, num_classes=vocab_total, classes=classes)


def _vocab_layout(weight, tp_group, vocab_size) -> tuple[int, int, int]:
    """``(vocab_start, num_valid, vocab_total)`` of this rank's shard."""
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    local = weight.shape[0]
    total = local * world if vocab_size is None else vocab_size
    if isinstance(total, bool) or not isinstance(total, int) or not 1 <= total <= local * world:
        raise ValueError(
            f"vocab_size={vocab_size!r} must be an int in [1, {local * world}] (the rows of "
            f"weight over the {world} rank(s) of tp_group)"
        )
    start = rank * local
    return start, min(local, max(0, total - start)), total


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    tp_group=None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    grad_in_forward: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Cross entropy of ``hidden [N, H] · weightᵀ`` (vocab sharded over ``tp_group``) against
    ``labels [N]``, without materialising the logits (see the module docstring).

    ``token_weights [N]`` (constants, e.g. a loss mask) multiply each token's loss. ``"sum"``
    returns ``Σ w_i·loss_i``; ``"mean"`` divides it by ``Σ w_i`` over non-ignored tokens (the
    count of non-ignored tokens without weights; NaN if there are none, as torch does). The
    result is a 0-d float32 tensor (float64 for float64 inputs), equal on every rank of
    ``tp_group``. ``vocab_size``: real classes over the group (default ``V_local·tp``); labels
    must be below it or ``ignore_index`` (checked before any work: ValueError naming the first
    bad label on CPU tensors, a device-side assert elsewhere). Weight shards must have equal
    ``V_local`` on every rank (chunk boundaries, and so the collectives, depend on it; not
    checked). ``softcap``: logits become ``cap·tanh(z / cap)``.
    """
    _check_inputs(hidden, weight, labels, token_weights)
    _check_options(reduction, ignore_index, label_smoothing, softcap, grad_in_forward)
    vocab_start, num_valid, vocab_total = _vocab_layout(weight, tp_group, vocab_size)
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    _check_labels(labels, ignore_index, vocab_total, vocab_size, world)
    impl = resolve_backend("linear_cross_entropy", backend, hidden.device, dtype=hidden.dtype)
    labels = labels.long()
    acc = acc_dtype(hidden)
    row_weights = (labels != ignore_index).to(acc)
    if token_weights is not None:
        row_weights = row_weights * token_weights.detach().to(acc)
    grad_on = torch.is_grad_enabled()
    need_dh = grad_on and hidden.requires_grad
    need_dw = grad_on and weight.requires_grad
    setup = _Setup(
        tp_group=tp_group,
        vocab_start=vocab_start,
        num_valid=num_valid,
        vocab_total=vocab_total,
        smoothing=float(label_smoothing),
        softcap=None if softcap is None else float(softcap),
        impl=impl,
        onednn=impl == "torch" and onednn_preferred(backend, hidden, weight),
        eager=bool(grad_in_forward) and (need_dh or need_dw),
        need_dh=need_dh,
        need_dw=need_dw,
    )
    total = _LinearCrossEntropy.apply(hidden, weight, labels, row_weights, setup)
    if reduction == "sum":
        return total
    # Non-ignored tokens only; 0/0 = NaN when there are none, as torch does.
    return total / row_weights.sum()
