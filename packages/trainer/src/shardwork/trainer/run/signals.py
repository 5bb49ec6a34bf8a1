"""SIGTERM / SIGINT -> finish the current step, checkpoint, exit cleanly.

- The handler only records the signal; the loop asks :meth:`StopRequest.agreed`
  once per step, which all-reduces the flag over the world (MAX), so every
  rank stops after the *same* step even if only some received the signal
  (a scheduler may signal one node first).
- A second SIGINT while stopping restores Python's default behaviour and
  raises KeyboardInterrupt at once, so Ctrl-C twice always gets out.
- Handlers are installed only in the main thread and restored on exit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist


class StopRequest:
    """Records SIGTERM/SIGINT; use as a context manager around the training loop."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        # Already stopping and Ctrl-C again: give up the clean stop and let Python interrupt.
        if self.signal_name is not None and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        # signal.signal may only be called from the main thread (ValueError elsewhere).
        if self.enabled and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def agreed(self, *, group=None, device: torch.device | None = None) -> bool:
        """True on every rank if any rank received a signal (a collective over ``group``)."""
        flag = self.signal_name is not None
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            t = torch.tensor([1.0 if flag else 0.0], device=device or "cpu")
            # MAX: one rank's signal stops every rank after this same step.
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            flag = bool(t.item() > 0)
            if flag and self.signal_name is None:
                self.signal_name = "signal on another rank"
        return flag


def stop_agreed(stop: StopRequest, step: int, *, runtime, phase: Callable) -> bool:
    """Whether any rank received a signal by the end of ``step``: with several ranks an
    agreement over the world (named as a collective phase by ``phase(name, group_names)``, see
    :func:`~.collectives.collective_phase`), so every rank stops after the same step."""
    if runtime.world_size > 1:
        with phase(f"stop-signal agreement after step {step}", ("world",)):
            return stop.agreed(device=runtime.device)
    return stop.signal_name is not None
