"""What one training step is given by the schedules: batch size, LR, weight decay, data offset.

The schedules (:mod:`shardwork.trainer.schedules`) are pure functions of the step index, so the
plan of a step is too; :func:`apply_hyperparams` writes it onto the optimizer's param groups,
each scaled by its ``lr_mult`` / ``wd_mult`` (see :mod:`.optimizers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.schedules import batch_size, consumed_samples, learning_rate, weight_decay


@dataclass(frozen=True)
class StepPlan:
    """The schedule's values for one step (0-based ``step``)."""

    step: int
    global_batch_size: int
    lr: float
    weight_decay: float
    consumed: int
    """Samples consumed by the steps before this one: where this step's batch starts."""


def plan_step(step: int, config: TrainConfig, *, data_offset: int = 0) -> StepPlan:
    """The batch size, learning rate, weight decay and data offset of ``step``.

    ``data_offset``: samples the steps before this run's first consumed beyond (or, negative,
    short of) what this schedule says they would: non-zero after a resume whose batch sizes
    differ from the checkpoint's run (see ``Checkpointer.data_offset``)."""
    s, o = config.schedule, config.optimizer
    ramp = s.batch_size_ramp
    return StepPlan(
        step=step,
        global_batch_size=batch_size(step, global_batch_size=s.global_batch_size, ramp=ramp),
        lr=learning_rate(step, s, o),
        weight_decay=weight_decay(step, o, train_steps=s.train_steps),
        consumed=consumed_samples(step, global_batch_size=s.global_batch_size, ramp=ramp)
        + data_offset,
    )


def apply_hyperparams(optimizer, plan: StepPlan) -> None:
    """Set every param group's ``lr`` and ``weight_decay`` for the planned step."""
    for group in optimizer.param_groups:
        group["lr"] = plan.lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = plan.weight_decay * group.get("wd_mult", 1.0)
