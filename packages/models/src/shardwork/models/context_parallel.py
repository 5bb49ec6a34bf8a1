"""Context parallelism: load-balanced sequence chunks, global positions and attention masks.

- The sequence is cut into ``2·cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and
  ``2cp-1-i`` (concatenated), so every rank gets the same amount of causal-attention work.
  :func:`slice_for_context_parallel` cuts a batch tensor that way (the data pipeline calls it
  for ids, labels and loss masks).
- :func:`local_positions` gives the global positions of a rank's tokens: RoPE and the causal
  mask use them (SDPA's ``is_causal`` would be wrong for these non-square blocks).
- Keys/values are all-gathered over the cp group with a differentiable gather whose backward
  reduce-scatters (every rank's queries contribute gradient to every key).
- :func:`attention_mask` builds the boolean ``[sq, sk]`` mask (True = attend) from query and key
  positions and, for packed sequences, document ids; a sliding window bounds ``q - k`` on the
  same global positions, so it holds across chunk boundaries.
"""

from __future__ import annotations

import torch

__all__ = [
    "attention_mask",
    "document_ids",
    "gathered_positions",
    "local_positions",
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


def gathered_positions(
    local_len: int, *, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of keys after an all-gather over cp (rank order)."""
    return torch.cat(
        [
            local_positions(local_len, cp_rank=r, cp_size=cp_size, device=device)
            for r in range(cp_size)
        ]
    )


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index ``[total]`` of every token of a packed sequence."""
    cu = cu_seqlens.to(torch.int64)
    if int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens[-1]={int(cu[-1])} must equal the packed sequence length {total}"
        )
    # right=True: a token at a document's end offset cu[i+1] already belongs to document i+1.
    return torch.bucketize(torch.arange(total, device=cu.device), cu[1:], right=True)


def attention_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal (and same-document) boolean mask ``[sq, sk]``; True where a query may attend.

    ``window``: a sliding window, keys with ``q - k < window`` only (Hugging Face's rule). As
    positions are global, the window cuts across context-parallel chunk boundaries correctly.
    """
    # [sq, 1] - [1, sk] -> [sq, sk]: distance back from each query to each key, on global
    # positions (valid for any chunk layout).
    back = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
    mask = back >= 0
    if window is not None:
        mask = mask & (back < window)
    if q_doc is not None:
        mask = mask & (k_doc.unsqueeze(0) == q_doc.unsqueeze(1))
    return mask
