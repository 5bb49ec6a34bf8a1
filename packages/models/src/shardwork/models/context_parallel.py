"""Context parallelism: load-balanced sequence chunks, global positions and key/value exchange.

- The sequence is cut into ``2·cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and
  ``2cp-1-i`` (concatenated), so every rank gets the same amount of causal-attention work.
  :func:`slice_for_context_parallel` cuts a batch tensor that way (the data pipeline calls it
  for ids, labels and loss masks).
- :func:`local_positions` gives the global positions of a rank's tokens (RoPE and learned
  position embeddings use them).
- :func:`gather_in_position_order` all-gathers keys/values over the cp group with a
  differentiable gather whose backward reduce-scatters (every rank's queries contribute
  gradient to every key) and puts the chunks back in position order, so that each query
  segment of a :class:`~shardwork.models.block_mask.BlockMask` reads one contiguous slice of
  keys. The gathered keys are linear in ``s``; attention never builds an ``[s_local, s]`` mask.
- :func:`document_ids` gives the document index of every token of a packed sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.parallel_state import gather_from_sequence_region, group_size

__all__ = [
    "document_ids",
    "gather_in_position_order",
    "local_positions",
    "position_order",
    "slice_for_context_parallel",
]


def slice_for_context_parallel(
    x: torch.Tensor, *, cp_rank: int, cp_size: int, dim: int = 1
) -> torch.Tensor:
    """This cp rank's two load-balanced chunks of ``x`` along ``dim`` (the sequence dim)."""
    if cp_size == 1:
        return x
    seq = x.shape[dim]
    if seq % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq} (dim {dim}) is not divisible by 2*cp={2 * cp_size}: "
            "context parallelism needs 2·cp equal chunks"
        )
    chunks = x.chunk(2 * cp_size, dim=dim)
    # Chunk i (cheap, early positions) pairs with chunk 2cp-1-i (expensive, late positions):
    # under a causal mask every rank then does the same attention work.
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=dim)


def local_positions(
    local_len: int, *, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions ``[local_len]`` of the tokens a cp rank holds."""
    if cp_size == 1:
        return torch.arange(local_len, device=device)
    chunk = local_len // 2
    # local_len = 2 chunks: positions of chunk cp_rank, then of chunk 2cp-1-cp_rank.
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat((first, second))


def position_order(gathered: torch.Tensor, *, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Rank-order all-gathered chunks ``[r0c0, r0c(2cp-1), r1c1, ...]`` back in position order."""
    if cp_size == 1:
        return gathered
    chunks = gathered.chunk(2 * cp_size, dim=dim)
    # Global chunk c is rank c's first half when c < cp, else rank 2cp-1-c's second half.
    order = [2 * c if c < cp_size else 2 * (2 * cp_size - 1 - c) + 1 for c in range(2 * cp_size)]
    return torch.cat([chunks[i] for i in order], dim=dim)


def gather_in_position_order(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, dim: int = 0
) -> torch.Tensor:
    """All-gather this cp rank's two chunks of ``x`` (sequence ``dim``) into the whole sequence
    in position order; backward reduce-scatters the gradient (every rank's queries read every
    key)."""
    gathered = gather_from_sequence_region(x, group, dim=dim, grad_is_partial=True)
    return position_order(gathered, cp_size=group_size(group), dim=dim)


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index ``[total]`` of every token of a packed sequence."""
    cu = cu_seqlens.to(torch.int64)
    if int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens[-1]={int(cu[-1])} must equal the packed sequence length {total}"
        )
    # right=True: a token at a document's end offset cu[i+1] already belongs to document i+1.
    return torch.bucketize(torch.arange(total, device=cu.device), cu[1:], right=True)
