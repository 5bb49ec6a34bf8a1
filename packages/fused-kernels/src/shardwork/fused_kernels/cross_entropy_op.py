"""Cross entropy from logits, optionally vocab-parallel over a tensor-parallel group.

- ``logits [N, V_local]`` hold this rank's vocab shard; shards are equal and in
  rank order over ``tp_group`` (rank r owns ids ``[r*V_local, (r+1)*V_local)``). Equal
  widths are checked inside the MAX all-reduce below, which also carries ``(V_local,
  -V_local)``: no collective of its own, so the check comes after the shard statistics (no
  write, and every rank raises together, before the SUM). Not checked on ``backend="te"``.
- Checked before any work: each label is ``ignore_index`` or in ``[0, V_local·tp)``
  (``ValueError`` naming the first bad one on CPU tensors; a device-side assert,
  ``torch._assert_async``, elsewhere, so no host sync); ``inplace_backward=True`` is refused
  on a leaf that requires grad (its values would be overwritten by backward).
- Per token the backend computes float32 statistics of its shard (its logsumexp, or max and
  sum of ``exp(x - max)``; the label's logit, 0 when the label is elsewhere; the sum of logits
  for label smoothing), then one MAX and one SUM all-reduce combine them
  (:mod:`~shardwork.fused_kernels.cross_entropy_shard`). Nothing logits-sized is materialised
  in float32: the torch backend works on cache-sized row blocks (one pass over memory), the
  Triton backend streams the vocab.
- Loss per token: ``lse - (1-ε)·x_label - ε·mean_v(x_v)``, i.e. torch's
  ``F.cross_entropy(label_smoothing=ε)``; 0 at ``ignore_index`` tokens.
- Backward recomputes ``softmax`` from the saved logits and ``lse``:
  ``dlogits = g · (softmax - (1-ε)·onehot - ε/V)``, written in the logits' dtype —
  into the logits' own storage with ``inplace_backward=True`` (each block is read
  before it is overwritten); no collective (the loss is replicated over the TP group).
- Reductions are plain torch ops on the per-token losses, so their gradients are
  right by construction: ``"mean"`` divides by the number of non-ignored tokens
  (NaN if there are none, as torch does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.fused_kernels import te_ops
from shardwork.fused_kernels._checks import (
    check_bool,
    check_float,
    check_fraction,
    check_int,
    check_labels,
    check_not_leaf_overwrite,
    check_same_device,
)
from shardwork.fused_kernels.backend import resolve_backend
from shardwork.fused_kernels.cross_entropy_shard import combine_shard_stats, shard_grad, shard_stats

__all__ = ["cross_entropy", "cross_entropy_stats_torch"]

_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_stats_torch(
    logits: torch.Tensor, local_labels: torch.Tensor, in_shard: torch.Tensor, *, smoothing: bool
) -> torch.Tensor:
    """Per-row float32 ``[N, 4]`` statistics of this shard: (m, s, label logit or 0, Σx) with
    ``logsumexp = m + log s`` (see :func:`~shardwork.fused_kernels.cross_entropy_shard.shard_stats`)."""
    return shard_stats(logits, local_labels, in_shard, smoothing=smoothing)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp_group, ignore_index, smoothing, impl, inplace_backward):
        vocab = logits.shape[1]
        world = 1 if tp_group is None else dist.get_world_size(tp_group)
        rank = 0 if tp_group is None else dist.get_rank(tp_group)
        vocab_total = vocab * world
        valid = labels != ignore_index
        # Labels are global vocab ids; rank r owns [r*V_local, (r+1)*V_local).
        local_labels = labels - rank * vocab
        in_shard = valid & (local_labels >= 0) & (local_labels < vocab)
        if impl == "triton":
            from shardwork.fused_kernels import triton_cross_entropy

            stats = triton_cross_entropy.stats(
                logits, local_labels, in_shard, smoothing=smoothing > 0
            )
        else:
            stats = shard_stats(logits, local_labels, in_shard, smoothing=smoothing > 0)
        # vocab_local: the MAX all-reduce also compares the shards' widths (equal on every rank).
        lse, target, total = combine_shard_stats(stats, tp_group, vocab_local=vocab)
        loss = lse - (1.0 - smoothing) * target
        if smoothing:
            loss = loss - smoothing * total / vocab_total
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(logits, local_labels, in_shard, valid, lse)
        ctx.impl, ctx.smoothing, ctx.vocab_total = impl, smoothing, vocab_total
        ctx.inplace_backward = inplace_backward
        ctx.mark_non_differentiable(valid)
        return loss, valid

    @staticmethod
    def backward(ctx, grad_loss, _grad_valid):
        logits, local_labels, in_shard, valid, lse = ctx.saved_tensors
        # Ignored tokens get no gradient.
        grad_rows = torch.where(valid, grad_loss.to(lse.dtype), 0.0)
        out = logits if ctx.inplace_backward else None
        kwargs = {"smoothing": ctx.smoothing, "vocab_total": ctx.vocab_total, "out": out}
        if ctx.impl == "triton":
            from shardwork.fused_kernels import triton_cross_entropy

            grad = triton_cross_entropy.grad(
                logits, local_labels, in_shard, lse, grad_rows, **kwargs
            )
        else:
            grad = shard_grad(logits, local_labels, in_shard, lse, grad_rows, **kwargs)
        return grad, None, None, None, None, None, None


def _check_inputs(logits, labels, tp_group, ignore_index, label_smoothing, reduction,
                  inplace_backward) -> None:  # fmt: skip
    """Every mistake of :func:`cross_entropy`'s arguments, before any work or collective."""
    check_float("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)} must be 2-D [N, V_local]")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"labels must be an int64/int32 tensor, got {getattr(labels, 'dtype', type(labels))}"
        )
    if tuple(labels.shape) != (logits.shape[0],):
        raise ValueError(f"labels.shape={tuple(labels.shape)} must be ({logits.shape[0]},) = [N]")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; valid: {', '.join(_REDUCTIONS)}")
    check_int("ignore_index", ignore_index)
    check_fraction("label_smoothing", label_smoothing)
    check_bool("inplace_backward", inplace_backward)
    check_not_leaf_overwrite("inplace_backward", "logits", logits, inplace_backward)
    check_same_device(logits=logits, labels=labels)
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    vocab_local = logits.shape[1]
    classes = f"logits.shape[1]={vocab_local}"
    if world > 1:
        classes = f"V_local={vocab_local} x {world} ranks of tp_group"
    check_labels(
        labels, ignore_index=ignore_index, num_classes=vocab_local * world, classes=classes
    )


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    inplace_backward: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Cross entropy of ``logits [N, V_local]`` (vocab sharded over ``tp_group``) against ``labels [N]``.

    ``reduction="none"`` returns float32 (float64 for float64 logits) per-token losses ``[N]`` (0 where
    ``labels == ignore_index``); ``"sum"`` their sum; ``"mean"`` their sum over
    the number of non-ignored tokens. Every rank of ``tp_group`` gets the same
    value. ``inplace_backward=True`` writes the logits gradient into the logits' own
    storage (no second logits-sized buffer; the logits are garbage afterwards — use it
    when nothing else reads them, e.g. straight out of the output layer; refused on a leaf
    that requires grad). ``labels``: each ``ignore_index`` or in ``[0, V_local·tp)`` (ValueError
    on CPU; a device-side assert on other devices). Vocab shards must be equal over
    ``tp_group`` (ValueError from the MAX all-reduce on every rank; device-side assert on GPU).
    ``backend="te"`` is Transformer Engine's ``parallel_cross_entropy``.
    """
    _check_inputs(logits, labels, tp_group, ignore_index, label_smoothing, reduction,
                  inplace_backward)  # fmt: skip
    chosen = resolve_backend("cross_entropy", backend, logits.device, dtype=logits.dtype)
    labels = labels.long()
    if chosen == "te":
        losses = te_ops.cross_entropy(
            logits,
            labels,
            tp_group=tp_group,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            inplace=inplace_backward,
        )
        valid = labels != ignore_index
    else:
        losses, valid = _CrossEntropy.apply(
            logits,
            labels,
            tp_group,
            ignore_index,
            float(label_smoothing),
            chosen,
            bool(inplace_backward),
        )
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    # Non-ignored tokens only; 0/0 = NaN when there are none, as torch does.
    return losses.sum() / valid.sum()
