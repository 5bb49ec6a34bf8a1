"""Which steps without an update are failures: the trainer's NaN/Inf guard.

A step can end without an update for two reasons:

- a dynamic fp16 loss scaler's overflow (the scaled gradients overflowed fp16, the scale drops
  and the step is skipped). That is how a dynamic scaler finds its scale: starting at 65,536 it
  overflows a few times in the first steps. While the scale can still drop (it is above its
  ``min_scale``, asked *before* the step), such a skip is counted apart and never stops the run;
- anything else: a non-finite loss (the forward pass does not see the loss scale), non-finite
  gradients with the scale at its floor, with a constant scale, or in bf16/fp32/fp64. These
  obey ``reliability.on_nan`` and ``reliability.max_consecutive_skips`` as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable


class NonFiniteLossError(RuntimeError):
    """Training stopped on a NaN/Inf loss or gradient (reliability.on_nan='stop')."""


class NonFiniteGuard:
    """Counts failed and overflow-skipped steps; raises :class:`NonFiniteLossError` to stop.

    Call :meth:`before_step` before each step and :meth:`after_step` with its outcome.
    """

    def __init__(self, reliability, loss_scaler, say: Callable[[str], None]) -> None:
        self.on_nan = reliability.on_nan
        self.max_consecutive_skips = reliability.max_consecutive_skips
        self.scaler = loss_scaler
        self.say = say
        self.consecutive_skips = 0
        self.skipped_steps = 0
        """Steps skipped as failures (not counting loss-scaler overflows)."""
        self.overflow_skips = 0
        """Steps skipped because the dynamic loss scaler overflowed and lowered its scale."""
        self._could_back_off = False
        self._settled_said = False

    def before_step(self) -> None:
        # Asked before the step: the step's own overflow may lower the scale to its floor, and what
        # counts is whether it could still drop when that overflow happened.
        self._could_back_off = bool(getattr(self.scaler, "can_back_off", False))

    def after_step(self, index: int, loss: float, update_successful: bool) -> None:
        """Classify the step of 0-based ``index`` (as the loop counts it before the step); raise
        when the run must stop. Messages name it step ``index + 1``: numbered from 1, as the
        step log lines and checkpoints number steps (step N's line follows the N-th step)."""
        step = index + 1
        if math.isfinite(loss) and update_successful:
            self.consecutive_skips = 0
            if self.overflow_skips and not self._settled_said:
                self._settled_said = True
                self.say(
                    f"step {step}: fp16 loss scale settled at {self.scaler.scale:g} after "
                    f"{self.overflow_skips} overflow-skipped step(s) (normal for a dynamic scaler)"
                )
            return
        # A finite loss but no update while the scale could drop: the dynamic scaler's overflow.
        if math.isfinite(loss) and self._could_back_off:
            self.overflow_skips += 1
            return
        what = f"loss {loss}" if not math.isfinite(loss) else "non-finite gradients"
        if self.scaler is not None and math.isfinite(loss):
            what += f" at the loss scale's floor ({self.scaler.scale:g})"
        if self.on_nan == "stop":
            raise NonFiniteLossError(
                f"step {step}: {what} (the optimizer did not update). Stopping because "
                "reliability.on_nan='stop'; lower optimizer.lr, enable clipping or set "
                "reliability.on_nan='skip'"
            )
        self.consecutive_skips += 1
        self.skipped_steps += 1
        self.say(f"step {step}: {what}: step skipped (no update)")
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteLossError(
                f"step {step}: {self.consecutive_skips} consecutive steps had {what}; "
                f"stopping (reliability.max_consecutive_skips={self.max_consecutive_skips})"
            )
