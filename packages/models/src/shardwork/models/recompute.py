"""Activation recompute that replays a forward exactly: gradients and side effects as without it.

- torch's non-reentrant checkpoint restores torch's global RNG before recomputing, but not the
  model's :class:`~shardwork.models.rng.RNGTracker` streams. :func:`checkpoint` snapshots the
  tracker before the first run and, during the recompute, swaps the snapshot in and the
  then-current streams back out afterwards (also when torch stops the recompute early), so
  the recompute draws the same masks and the tracker continues where the forward left it.
- Modules with side effects (the MoE router: logged aux losses, token counts, the global aux
  loss's running counts) must act once per real forward and must compute, in the recompute,
  exactly what they computed in the first run. A model-owned :class:`RecomputeReplay` is the
  channel: during a checkpointed function's first run a module ``record`` s the state it
  needs (e.g. counters before its update), and during that call's recompute it reads
  ``recomputing`` and gets the same values back from ``replay`` in the same order. Each
  :func:`checkpoint` call keeps its own record list, so several micro-batches in flight
  (1F1B: forwards of later micro-batches before earlier backwards) never mix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from shardwork.models.rng import RNGTracker

__all__ = ["RecomputeReplay", "checkpoint"]


class RecomputeReplay:
    """Per-model channel between a checkpointed forward and its recompute (see module doc).

    Outside :func:`checkpoint` both ``recording`` and ``recomputing`` are False and modules
    behave normally.
    """

    def __init__(self) -> None:
        self._log: list[Any] | None = None
        self._replaying = False
        self._position = 0

    @property
    def recording(self) -> bool:
        """True inside the first run of a checkpointed function."""
        return self._log is not None and not self._replaying

    @property
    def recomputing(self) -> bool:
        """True while a checkpointed function is recomputed inside backward."""
        return self._log is not None and self._replaying

    def record(self, value: Any) -> None:
        """Keep ``value`` for this call's recompute (only while ``recording``)."""
        if not self.recording:
            raise RuntimeError("RecomputeReplay.record outside a checkpointed first run")
        self._log.append(value)

    def replay(self) -> Any:
        """The next value recorded by the first run (only while ``recomputing``)."""
        if not self.recomputing:
            raise RuntimeError("RecomputeReplay.replay outside a recompute")
        if self._position >= len(self._log):
            raise RuntimeError(
                "the recompute asked for more recorded values than its first run recorded: "
                "the checkpointed function took a different path"
            )
        value = self._log[self._position]
        self._position += 1
        return value

    def _enter(self, log: list[Any], replaying: bool) -> tuple[Any, ...]:
        previous = (self._log, self._replaying, self._position)
        self._log, self._replaying, self._position = log, replaying, 0
        return previous

    def _exit(self, previous: tuple[Any, ...]) -> None:
        self._log, self._replaying, self._position = previous


def checkpoint(
    fn: Callable[..., Any],
    tracker: RNGTracker,
    *args: torch.Tensor,
    replay: RecomputeReplay | None = None,
) -> Any:
    """``fn(*args)`` without keeping its activations; recomputed in backward with the same RNG.

    ``replay``: the model's :class:`RecomputeReplay`, through which modules inside ``fn``
    hand state from the first run to the recompute (None: no module needs it).
    """
    # Snapshot before the first run: the recompute must start from the streams' state at this
    # point, not from wherever later layers have advanced them by the time backward runs.
    saved = tracker.get_states()
    calls = [0]
    log: list[Any] = []

    def run(*inputs: torch.Tensor) -> Any:
        calls[0] += 1
        first = calls[0] == 1
        previous = replay._enter(log, replaying=not first) if replay is not None else None
        try:
            if first:
                return fn(*inputs)
            # Swap the snapshot in for the recompute, then restore the streams' current state so
            # later forwards (other micro-batches under 1F1B) continue their own sequence.
            current = tracker.get_states()
            tracker.set_states(saved)
            try:
                return fn(*inputs)
            finally:
                tracker.set_states(current)
        finally:
            if replay is not None:
                replay._exit(previous)

    # preserve_rng_state restores torch's global RNG; the tracker's streams are handled above.
    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True
    )
