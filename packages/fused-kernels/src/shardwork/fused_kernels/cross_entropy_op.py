"""Cross entropy from logits, optionally vocab-parallel over a tensor-parallel group.

- ``logits [N, V_local]`` hold this rank's vocab shard; shards are equal and in
  rank order over ``tp_group`` (rank r owns ids ``[r*V_local, (r+1)*V_local)``).
- Per token the backend computes four float32 statistics of its shard — max,
  sum of ``exp(x - max)``, the label's logit (0 when the label is elsewhere) and
  the sum of logits (for label smoothing) — then one MAX and one SUM all-reduce
  combine them. Nothing logits-sized is materialised in float32: the torch
  backend works in row chunks, the Triton backend streams the vocab.
- Loss per token: ``lse - (1-ε)·x_label - ε·mean_v(x_v)``, i.e. torch's
  ``F.cross_entropy(label_smoothing=ε)``; 0 at ``ignore_index`` tokens.
- Backward recomputes ``softmax`` from the saved logits and ``lse``:
  ``dlogits = g · (softmax - (1-ε)·onehot - ε/V)``, written in the logits' dtype —
  into the logits' own storage with ``inplace_backward=True`` (each chunk is read
  before it is overwritten); no collective (the loss is replicated over the TP group).
- Reductions are plain torch ops on the per-token losses, so their gradients are
  right by construction: ``"mean"`` divides by the number of non-ignored tokens
  (NaN if there are none, as torch does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.fused_kernels import te_ops
from shardwork.fused_kernels._checks import acc_dtype, check_float, check_same_device
from shardwork.fused_kernels.backend import resolve_backend

__all__ = ["cross_entropy", "cross_entropy_stats_torch"]

_REDUCTIONS = ("mean", "sum", "none")
_CHUNK_ELEMENTS = 1 << 24  # float32 scratch of the torch backend: 64 MiB per chunk


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(vocab, 1))


def cross_entropy_stats_torch(
    logits: torch.Tensor, local_labels: torch.Tensor, in_shard: torch.Tensor, *, smoothing: bool
) -> torch.Tensor:
    """Per-row float32 ``[N, 4]``: (max, sum exp(x - max), label logit or 0, sum of x) of this shard."""
    n, vocab = logits.shape
    stats = torch.zeros(n, 4, dtype=acc_dtype(logits), device=logits.device)
    step = _rows_per_chunk(vocab)
    for a in range(0, n, step):
        # Upcast one row chunk at a time: the float32 scratch stays bounded by _CHUNK_ELEMENTS.
        xf = logits[a : a + step].to(stats.dtype)
        m = xf.max(dim=-1).values
        stats[a : a + step, 0] = m
        stats[a : a + step, 1] = (xf - m.unsqueeze(-1)).exp_().sum(dim=-1)
        if smoothing:
            stats[a : a + step, 3] = xf.sum(dim=-1)
    # clamp: an out-of-shard label would index out of range; its value is replaced by 0 below.
    picked = logits.gather(1, local_labels.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    stats[:, 2] = torch.where(in_shard, picked.to(stats.dtype), 0.0)
    return stats


def _grad_torch(logits, local_labels, in_shard, lse, grad_rows, *, smoothing, vocab_total, out):
    n, vocab = logits.shape
    grad = torch.empty_like(logits) if out is None else out
    step = _rows_per_chunk(vocab)
    rows = torch.arange(n, device=logits.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        # softmax recomputed from the saved logits and lse: exp(x - lse).
        p = (logits[a:b].to(lse.dtype) - lse[a:b].unsqueeze(-1)).exp_()
        if smoothing:
            # Smoothed target (1-e)*onehot + e/V, V the whole vocab over all TP ranks.
            p -= smoothing / vocab_total
        hit = in_shard[a:b]
        p[rows[a:b][hit] - a, local_labels[a:b][hit]] -= 1.0 - smoothing
        p *= grad_rows[a:b].unsqueeze(-1)
        grad[a:b] = p.to(logits.dtype)
    return grad


def _combine(stats: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine per-shard stats over ``tp_group``: (lse, label logit, sum of logits), each ``[N]``."""
    m = stats[:, 0]
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        # MAX before SUM (every TP rank issues both in this order): the rescale below needs the
        # global max. exp(m - M) * sum exp(x - m) = sum exp(x - M).
        global_max = m.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        # One SUM for all three: sum exp, the label logit (nonzero on one rank only), sum of logits.
        sums = stats[:, 1:].clone()
        sums[:, 0] *= (m - global_max).exp()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        m = global_max
    else:
        sums = stats[:, 1:]
    # lse = M + log(sum exp(x - M)).
    return m + sums[:, 0].log(), sums[:, 1], sums[:, 2]


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
            stats = cross_entropy_stats_torch(
                logits, local_labels, in_shard, smoothing=smoothing > 0
            )
        lse, target, total = _combine(stats, tp_group)
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
            grad = _grad_torch(logits, local_labels, in_shard, lse, grad_rows, **kwargs)
        return grad, None, None, None, None, None, None


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
    when nothing else reads them, e.g. straight out of the output layer).
    ``backend="te"`` is Transformer Engine's ``parallel_cross_entropy``.
    """
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
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    check_same_device(logits=logits, labels=labels)
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
