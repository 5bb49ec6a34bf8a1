"""Local gradient statistics for one optimizer step: ``[non-finite pieces, Σg², zeros]``.

Shared by the ZeRO and the layer-wise optimizers (:mod:`step_flow` all-reduces the 3-vector).
One ``torch._foreach_norm`` over every local gradient piece gives both the norm and the
non-finite check: a piece holds a NaN/Inf exactly when its float64 norm is not finite (a
float32 gradient cannot overflow when squared in float64), so no separate ``isfinite`` pass
runs. Pieces replicated across TP ranks (or a weight shared across stages) are checked for
non-finite values but left out of Σg² and of the zero count on all but one rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["grad_stats"]


def grad_stats(
    grads: Sequence[torch.Tensor], counted: Sequence[bool], *, count_zeros: bool
) -> torch.Tensor:
    """float64 ``[pieces with a non-finite value, Σ g² over counted pieces, zeros in counted
    pieces]``. ``grads``: this rank's master gradient pieces (float32 or narrower, any device:
    a float64 piece with values near 1e154 may overflow its squared norm and count as non-finite);
    ``counted[i]``: whether piece i counts towards the norm and zeros on this rank. The zero
    count is 0 unless ``count_zeros`` (it costs a pass over the gradients)."""
    if not grads:
        return torch.zeros(3, dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float64))
    mask = torch.tensor(list(counted), dtype=torch.bool, device=norms.device)
    zeros = torch.zeros((), dtype=torch.float64, device=norms.device)
    if count_zeros:
        for g, c in zip(grads, counted):
            if c:
                zeros += (g == 0).sum()
    return torch.stack(
        [(~torch.isfinite(norms)).sum().double(), norms.square().masked_fill(~mask, 0).sum(), zeros]
    )
