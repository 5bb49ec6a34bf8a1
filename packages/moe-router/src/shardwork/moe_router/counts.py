"""Per-expert token counts of a routing result, for the load-balancing losses, the expert-bias
counters and the tracker.

Legend: T tokens, E experts, K top_k; token t of a micro-batch of ``batch`` sequences belongs
to sequence ``t % batch`` (row-major [S, B]).
"""

from __future__ import annotations

import torch

__all__ = ["index_counts", "routed_token_counts"]


def index_counts(top_TK, num_experts: int, batch: int, valid_T) -> torch.Tensor:
    """Per-sequence token counts [batch * E] (int64) from the K chosen indices per token.

    Column b*E + i counts tokens of sequence b (token t = s*batch + b) routed to expert i;
    padding tokens (``valid_T`` False) are not counted. Equals the column sums of the
    [S, batch*E] reshaped routing map, without building it.
    """
    T, K = top_TK.shape
    flat = top_TK
    if batch > 1:
        seq_of = torch.arange(T, device=top_TK.device) % batch
        flat = top_TK + (seq_of * num_experts).unsqueeze(-1)
    if valid_T is None:
        ones = torch.ones((), dtype=torch.int64, device=top_TK.device).expand(T * K)
    else:
        ones = valid_T.to(torch.int64).unsqueeze(-1).expand(T, K).reshape(-1)
    counts = torch.zeros(batch * num_experts, dtype=torch.int64, device=top_TK.device)
    return counts.scatter_add_(0, flat.reshape(-1), ones)


def routed_token_counts(
    top_TK: torch.Tensor | None,
    map_TE: torch.Tensor,
    num_experts: int,
    padding_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Tokens routed to each expert [E], padding left out: from the K indices per token when
    the routing has them (cheaper than a dense [T, E] sum), else from the bool map."""
    if top_TK is not None:
        valid = None if padding_mask is None else ~padding_mask
        return index_counts(top_TK, num_experts, 1, valid)
    counted = map_TE if padding_mask is None else map_TE & ~padding_mask.unsqueeze(-1)
    return counted.sum(dim=0)
