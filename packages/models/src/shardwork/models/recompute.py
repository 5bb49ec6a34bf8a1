"""Activation recompute that replays dropout exactly: gradients bit-equal to no recompute.

torch's non-reentrant checkpoint restores torch's global RNG before recomputing, but not the
model's :class:`~shardwork.models.rng.RNGTracker` streams. :func:`checkpoint` snapshots the
tracker before the first run and, during the recompute, swaps the snapshot in and the
then-current streams back out afterwards (also when torch stops the recompute early), so
the recompute draws the same masks and the tracker continues where the forward left it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from shardwork.models.rng import RNGTracker

__all__ = ["checkpoint"]


def checkpoint(fn: Callable[..., Any], tracker: RNGTracker, *args: torch.Tensor) -> Any:
    """``fn(*args)`` without keeping its activations; recomputed in backward with the same RNG."""
    saved = tracker.get_states()
    calls = [0]

    def run(*inputs: torch.Tensor) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inputs)
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            return fn(*inputs)
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True
    )
