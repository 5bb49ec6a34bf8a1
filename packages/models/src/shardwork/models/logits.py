"""Turn vocab-split, sequence-first logits into ordinary ``[b, s, vocab]`` logits.

Used for evaluation, sampling and comparisons with Hugging Face: all-gathers the vocab shards
over the TP group (not differentiable through padding) and drops the padded columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.parallel_state import group_size

__all__ = ["gather_logits"]


def gather_logits(logits: torch.Tensor, *, tp_group, vocab_size: int) -> torch.Tensor:
    """``[s, b, V_pad/tp]`` on each TP rank -> ``[b, s, vocab_size]`` (same on every TP rank)."""
    tp = group_size(tp_group)
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        # all_gather (not the differentiable gather): these logits are for evaluation and sampling.
        dist.all_gather(parts, logits.contiguous(), group=tp_group)
        logits = torch.cat(parts, dim=-1)
    # Drop the vocab padding columns (padded_vocab_size divides by tp), then [s, b, V] -> [b, s, V].
    return logits[..., :vocab_size].transpose(0, 1)
