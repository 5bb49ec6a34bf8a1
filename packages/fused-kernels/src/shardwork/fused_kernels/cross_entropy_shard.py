"""Cross entropy on one block of a vocabulary shard: torch statistics, gradient, and the TP combine.

The math both :func:`~shardwork.fused_kernels.cross_entropy` and
:func:`~shardwork.fused_kernels.linear_cross_entropy` run on a ``[rows, cols]`` block of
logits (a whole vocab shard, or a chunk of one), in float32 (float64 for float64 logits):

- :func:`shard_stats`: per row ``[N, 4]`` = (``m``, ``s``, label logit or 0, Σx) with
  ``lse_shard = m + log s``. The torch path stores ``(logsumexp, 1)``; the Triton kernel
  ``(max, Σexp(x - max))``: :func:`combine_shard_stats` reads both the same way.
- :func:`shard_grad`: ``g·(exp(x - lse) - ε/V - (1-ε)·[v = label])``, written in the logits'
  dtype, into ``out`` (the logits themselves for an in-place backward).
- ``softcap``: the block holds raw logits ``z`` and the loss sees ``x = cap·tanh(z / cap)``
  (Gemma 2's final-logit soft-capping, Hugging Face's operation order); the gradient is then
  ``dz = dx·(1 - tanh²)``.
- :func:`shard_softmax` and :func:`softmax_grad`: the same statistics and gradient for a
  caller that wants both from one block (the fused linear cross entropy's chunks): one
  ``softmax`` over the block gives the probabilities and, from their row maximum ``1/s``, the
  logsumexp; the gradient is then one multiplication of them by a per-row factor. Four passes
  over the block, each a single whole-block op, instead of ~8 ops per 2^18-element sub-block:
  on the 2-core AMD EPYC a ``[1024, 8192]`` float32 block takes 4.6 ms against 23.1 (2
  threads) and 9.4 against 19.9 (1 thread), because each small op of the sub-block loop also
  woke OpenMP's sleeping thread (``OMP_WAIT_POLICY=PASSIVE``, ``benchmarks/openmp_wait.py``).
  The probabilities are a float32 tensor the size of the block, alive until the gradient is
  written.
- :func:`shard_stats` / :func:`shard_grad` work on sub-blocks of ``_BLOCK_ELEMENTS`` so their
  temporaries (``x - lse``, a float32 copy of a low-precision block) stay a bounded size,
  whatever the block. The label's gradient element is computed on its own in float32 (before
  an in-place write can overwrite its logit) and stored last, so the sub-blocks are purely
  elementwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.fused_kernels._checks import acc_dtype

__all__ = ["combine_shard_stats", "shard_grad", "shard_softmax", "shard_stats", "softmax_grad"]

# 8 MiB of float32 per sub-block: each op on it outlasts waking OpenMP's sleeping thread
# (~50 us). Statistics and gradient of a [1024, 8192] block at 2 threads: 23.1 ms with 2^18,
# 12.6 with 2^21 (19.9 and 19.4 at 1 thread).
_BLOCK_ELEMENTS = 1 << 21


def _rows_per_block(cols: int) -> int:
    return max(1, _BLOCK_ELEMENTS // max(cols, 1))


def _capped(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    # Hugging Face's order (divide, tanh, multiply), as models.softcap.soft_cap does.
    return x if softcap is None else torch.tanh(x / softcap) * softcap


def shard_stats(
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    in_shard: torch.Tensor,
    *,
    smoothing: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-row float32 ``[N, 4]``: (logsumexp, 1, label logit or 0, Σx) of this block.

    ``local_labels`` index the block's columns where ``in_shard`` is set (elsewhere ignored).
    """
    n, cols = logits.shape
    acc = acc_dtype(logits)
    stats = torch.zeros(n, 4, dtype=acc, device=logits.device)
    stats[:, 1] = 1.0  # s = 1: slot 0 already holds the whole logsumexp
    step = _rows_per_block(cols)
    for a in range(0, n, step):
        x = _capped(logits[a : a + step].to(acc), softcap)
        # logsumexp of an empty shard (all columns padding) is -inf: it adds exp(-inf) = 0.
        stats[a : a + step, 0] = torch.logsumexp(x, dim=-1)
        if smoothing:
            stats[a : a + step, 3] = x.sum(dim=-1)
    if cols > 0:
        # clamp: an out-of-block label would index out of range; its value is replaced by 0.
        picked = logits.gather(1, local_labels.clamp(0, cols - 1).unsqueeze(-1)).squeeze(-1)
        stats[:, 2] = torch.where(in_shard, _capped(picked.to(acc), softcap), 0.0)
    return stats


def _label_grads(logits, hit_rows, hit_cols, lse, grad_rows, *, smoothing, vocab_total, softcap):
    """The gradient at each hit row's label column, in float32 from the logit itself."""
    z = logits[hit_rows, hit_cols].to(lse.dtype)
    x = _capped(z, softcap)
    g = grad_rows[hit_rows] * (
        (x - lse[hit_rows]).exp() - smoothing / vocab_total - (1 - smoothing)
    )
    if softcap is not None:
        t = torch.tanh(z / softcap)
        g = g * (1 - t * t)
    return g


def _block_grad(block, dst, lse, grad_rows, *, uniform: float, softcap: float | None) -> None:
    """``dst = g·(exp(x - lse) - uniform)`` (times ``1 - tanh²`` when capped) for one block."""
    acc = lse.dtype
    x = block.to(acc)
    t = None
    if softcap is not None:
        t = torch.tanh(x / softcap)
        x = t * softcap
    # Write straight into dst when it already has the arithmetic dtype (in place is safe: each
    # element is read before it is written).
    direct = dst.dtype == acc
    p = torch.sub(x, lse.unsqueeze(-1), out=dst if direct else None)
    p.exp_()
    if uniform:
        p.sub_(uniform)
    p.mul_(grad_rows.unsqueeze(-1))
    if t is not None:
        p.mul_(t.mul_(t).neg_().add_(1.0))
    if not direct:
        dst.copy_(p)


def shard_grad(
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    in_shard: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    smoothing: float,
    vocab_total: int,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of ``Σ grad_rows·loss`` w.r.t. this block, in ``logits.dtype``.

    ``lse [N]`` and ``grad_rows [N]`` are float32 (float64 for float64 logits); ``vocab_total``
    the number of real classes over all shards (the ε/V of label smoothing). ``out``: write
    there (it may be ``logits`` itself).
    """
    n, cols = logits.shape
    grad = torch.empty_like(logits) if out is None else out
    hit_rows = in_shard.nonzero().squeeze(-1)
    hit_cols = local_labels[hit_rows]
    label_grads = _label_grads(
        logits,
        hit_rows,
        hit_cols,
        lse,
        grad_rows,
        smoothing=smoothing,
        vocab_total=vocab_total,
        softcap=softcap,
    )
    uniform = smoothing / vocab_total
    step = _rows_per_block(cols)
    for a in range(0, n, step):
        b = min(n, a + step)
        _block_grad(
            logits[a:b], grad[a:b], lse[a:b], grad_rows[a:b], uniform=uniform, softcap=softcap
        )
    grad[hit_rows, hit_cols] = label_grads.to(grad.dtype)
    return grad


def shard_softmax(
    logits: torch.Tensor, local_labels: torch.Tensor, in_shard: torch.Tensor, *, smoothing: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stats [N, 4], probs [N, cols])`` of a block without soft-capping: the statistics of
    :func:`shard_stats` and ``softmax`` over the block's own columns, in float32 (float64 for
    float64 logits). ``logits`` are left as they are."""
    n, cols = logits.shape
    acc = acc_dtype(logits)
    stats = torch.zeros(n, 4, dtype=acc, device=logits.device)
    stats[:, 1] = 1.0  # s = 1: slot 0 holds the whole logsumexp
    if cols == 0:  # a shard of padding only: exp of no logit sums to 0
        stats[:, 0] = float("-inf")
        return stats, logits.new_empty((n, 0), dtype=acc)
    row_max = logits.amax(dim=-1).to(acc)
    probs = torch.softmax(logits, dim=-1, dtype=acc)
    # At the row's maximum exp(x - m) = 1, so the largest probability is 1/s rounded once:
    # logsumexp = m + log s = m - log(max p), within an ulp of s's rounding.
    stats[:, 0] = row_max - probs.amax(dim=-1).log()
    if smoothing:
        stats[:, 3] = logits.sum(dim=-1, dtype=acc)
    # clamp: an out-of-block label would index out of range; its value is replaced by 0.
    picked = logits.gather(1, local_labels.clamp(0, cols - 1).unsqueeze(-1)).squeeze(-1)
    stats[:, 2] = torch.where(in_shard, picked.to(acc), 0.0)
    return stats, probs


def softmax_grad(
    probs: torch.Tensor,
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    in_shard: torch.Tensor,
    block_lse: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    smoothing: float,
    vocab_total: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`shard_grad` from :func:`shard_softmax`'s ``probs`` (of ``logits``, not
    soft-capped): ``exp(x - lse) = probs · exp(block_lse - lse)``, the block's own softmax
    rescaled to the normaliser over all shards (``block_lse = stats[:, 0]``; the factor is 1
    when the block is the whole vocabulary). Written into ``out`` (``logits`` itself is fine:
    the label logits are read first); ``probs`` is used up."""
    hit_rows = in_shard.nonzero().squeeze(-1)
    hit_cols = local_labels[hit_rows]
    label_grads = _label_grads(logits, hit_rows, hit_cols, lse, grad_rows,
                               smoothing=smoothing, vocab_total=vocab_total, softcap=None)  # fmt: skip
    if probs.shape[1]:
        scale = (grad_rows * (block_lse - lse).exp()).unsqueeze(-1)
        if smoothing:
            # g·(p·c - ε/V) = p·(g·c) - g·ε/V, one pass into out.
            shift = (grad_rows * (-smoothing / vocab_total)).unsqueeze(-1)
            torch.addcmul(shift, probs, scale, out=out)
        else:
            torch.mul(probs, scale, out=out)
    out[hit_rows, hit_cols] = label_grads.to(out.dtype)
    return out


def combine_shard_stats(
    stats: torch.Tensor, tp_group, *, vocab_local: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine per-shard stats ``[N, 4]`` over ``tp_group``: (lse, label logit, Σx), each ``[N]``.

    Two all-reduces when the group has more than one rank (MAX, then one SUM of three columns);
    every rank of the group must call it for the same rows. ``vocab_local`` (this rank's shard
    width): the MAX also carries ``(V_local, -V_local)``, so every rank learns the widest and the
    narrowest shard at no extra collective and all of them raise together, before the SUM, when
    the shards differ (:func:`_check_equal_shards`).
    """
    m = stats[:, 0]
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        # MAX before SUM (every TP rank issues both in this order): the rescale below needs the
        # global max. exp(m - M) * sum exp(x - m) = sum exp(x - M).
        n = m.shape[0]
        extra = 0 if vocab_local is None else 2
        reduced = m.new_empty(n + extra)
        reduced[:n] = m
        if extra:  # fills from Python scalars: no host-device copy
            reduced[n] = vocab_local
            reduced[n + 1] = -vocab_local
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=tp_group)
        if extra:
            _check_equal_shards(reduced[n], -reduced[n + 1], vocab_local)
        global_max = reduced[:n]
        # One SUM for all three: sum exp, the label logit (nonzero on one rank only), sum of logits.
        sums = stats[:, 1:].clone()
        sums[:, 0] *= (m - global_max).exp()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        m = global_max
    else:
        sums = stats[:, 1:]
    # lse = M + log(sum exp(x - M)).
    return m + sums[:, 0].log(), sums[:, 1], sums[:, 2]


def _check_equal_shards(widest: torch.Tensor, narrowest: torch.Tensor, vocab_local: int) -> None:
    """``ValueError`` (CPU, exact) or a device-side assert (elsewhere, no host sync) unless the
    widest and the narrowest vocabulary shard of the group (0-d, all-reduced) are equal: rank r
    owns ids ``[r*V_local, (r+1)*V_local)`` only when every shard has ``V_local`` columns."""
    what = (
        "vocab-parallel cross entropy needs logits.shape[1] (V_local) equal on every rank of "
        "tp_group (pad the vocabulary to a multiple of the TP size)"
    )
    if widest.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(widest == narrowest, what)
    elif widest != narrowest:
        raise ValueError(
            f"logits.shape[1]={vocab_local} on this rank, but the shards of tp_group have "
            f"{int(narrowest)} to {int(widest)} columns; {what}"
        )
