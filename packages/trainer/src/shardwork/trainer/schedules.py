"""Learning-rate, weight-decay and batch-size schedules as pure functions of the step.

``step`` is the 0-based index of the optimizer step about to be taken.

- Warmup (every LR schedule): ``lr = peak · (step + 1) / W`` for ``step < W``
  (the first step already learns, unlike a warmup that starts at 0).
- After warmup, with ``D = lr_decay_steps`` (default: train_steps) and
  progress ``t = (step − W) / (D − W)`` clipped to [0, 1]:
  constant ``peak``; linear ``min + (peak − min)(1 − t)``;
  cosine ``min + (peak − min)·½(1 + cos πt)``;
  inverse_sqrt ``max(min, peak·√max(W,1) / √(step + 1))``;
  WSD: ``peak`` until ``D − S`` (``S = wsd_decay_steps``, default 20 % of
  ``D − W``), then with ``u = (step − (D − S)) / S``: linear ``1 − u``,
  cosine ``½(1 + cos πu)``, exponential ``2·0.5^u − 1``, minus_sqrt
  ``1 − √u`` as the fraction of ``peak − min`` above ``min``.
  From step ``D`` on every decaying schedule stays at ``min``.
- Weight decay moves from ``start`` to ``end`` over the run with
  ``t = step / train_steps``: linear ``start + (end − start)t``, cosine
  ``start + (end − start)·½(1 − cos πt)``.
- Batch size: ``global_batch_size`` until the first ``(step, size)`` of the
  ramp, then the size of the last entry whose step is ≤ the current one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardwork.trainer.config.sections import OptimizerSection, ScheduleConfig


def learning_rate(step: int, schedule: ScheduleConfig, optimizer: OptimizerSection) -> float:
    """Learning rate of optimizer step ``step``."""
    peak, low = optimizer.lr, optimizer.min_lr
    warmup = schedule.warmup_steps
    if step < warmup:
        # (step + 1): the first step already learns instead of taking a zero-lr step.
        return peak * (step + 1) / warmup
    kind = schedule.lr_schedule
    if kind == "constant":
        return peak
    if kind == "inverse_sqrt":
        # sqrt(max(W, 1)) makes it equal peak at step + 1 = W, where warmup ends.
        return max(low, peak * math.sqrt(max(warmup, 1)) / math.sqrt(step + 1))
    decay_end = (
        schedule.lr_decay_steps if schedule.lr_decay_steps is not None else schedule.train_steps
    )
    if step >= decay_end:
        return low
    if kind == "wsd":
        # WSD: warmup-stable-decay (MiniCPM, Hu et al., 2024).
        length = schedule.wsd_decay_steps
        if length is None:
            length = max(1, round(0.2 * (decay_end - warmup)))
        start = decay_end - length
        if step < start:
            return peak
        u = (step - start) / length
        style = schedule.wsd_decay_style
        if style == "linear":
            coeff = 1.0 - u
        elif style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * u))
        elif style == "exponential":
            # 2 * 0.5**u - 1 falls from 1 at u = 0 to 0 at u = 1.
            coeff = 2.0 * 0.5**u - 1.0
        elif style == "minus_sqrt":
            coeff = 1.0 - math.sqrt(u)
        else:
            raise ValueError(
                f"schedule.wsd_decay_style={style!r}; valid: linear, cosine, exponential, minus_sqrt"
            )
        return low + (peak - low) * coeff
    # max(..., 1): no division by zero when decay ends where warmup does.
    t = (step - warmup) / max(decay_end - warmup, 1)
    if kind == "linear":
        return low + (peak - low) * (1.0 - t)
    if kind == "cosine":
        return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(
        f"schedule.lr_schedule={kind!r}; valid: constant, linear, cosine, inverse_sqrt, wsd"
    )


def weight_decay(step: int, optimizer: OptimizerSection, *, train_steps: int) -> float:
    """Weight decay of optimizer step ``step``."""
    start = optimizer.weight_decay
    if optimizer.weight_decay_schedule == "constant" or optimizer.weight_decay_end is None:
        return start
    end = optimizer.weight_decay_end
    t = min(max(step / max(train_steps, 1), 0.0), 1.0)
    if optimizer.weight_decay_schedule == "linear":
        return start + (end - start) * t
    if optimizer.weight_decay_schedule == "cosine":
        return start + (end - start) * 0.5 * (1.0 - math.cos(math.pi * t))
    raise ValueError(
        f"optimizer.weight_decay_schedule={optimizer.weight_decay_schedule!r}; "
        "valid: constant, linear, cosine"
    )


def batch_size(step: int, *, global_batch_size: int, ramp: Sequence[tuple[int, int]]) -> int:
    """Global batch size of optimizer step ``step``."""
    size = global_batch_size
    for start, value in ramp:
        if step >= start:
            size = value
        else:
            break
    return size


def consumed_samples(step: int, *, global_batch_size: int, ramp: Sequence[tuple[int, int]]) -> int:
    """Samples consumed by steps ``0 .. step-1``."""
    total = 0
    bounds = [(0, global_batch_size), *[(s, v) for s, v in ramp if s > 0]]
    # A ramp entry at step 0 replaces the configured size from the first step.
    if ramp and ramp[0][0] == 0:
        bounds[0] = (0, ramp[0][1])
    for i, (start, value) in enumerate(bounds):
        stop = bounds[i + 1][0] if i + 1 < len(bounds) else step
        stop = min(stop, step)
        if stop > start:
            total += (stop - start) * value
    return total
