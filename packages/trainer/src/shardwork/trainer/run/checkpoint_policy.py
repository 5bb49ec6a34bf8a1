"""When the training loop checkpoints: interval saves, and the final save before the final
evaluation.

- Interval saves (``checkpoint.interval``) happen after a step that is a multiple of the
  interval, except after the last step (the final save covers it) and on a stop (the stop's own
  save follows at once: saving twice would waste the scheduler's grace period).
- The final save runs when the run stopped on a signal or ``checkpoint.save_at_end`` is on; then
  the checkpoint is committed (an async save's commit is waited for) and, for a run that
  finished, the Hugging Face export is written. All of it precedes the final evaluation, so a
  signal during that evaluation cannot lose the checkpoint.
Every save, commit and export is a collective over the world, in this order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.config.validate_peft import lora_config_of
from shardwork.trainer.run.hf import export_adapters, export_hf


def interval_save_due(config: TrainConfig, step: int, *, stopping: bool) -> bool:
    """Whether ``checkpoint.interval`` asks for a save after ``step`` steps (see module)."""
    interval = config.checkpoint.interval
    return (
        interval is not None
        and step % interval == 0
        and step < config.schedule.train_steps
        and not stopping
    )


class CheckpointPolicy:
    """Drives a :class:`~.checkpointing.Checkpointer` from the loop (see the module docstring).

    ``phase(name, group_names)`` opens the block a collective's failure is named by
    (:func:`~.collectives.collective_phase`); ``modules`` are this rank's model chunks (export).
    """

    def __init__(self, config: TrainConfig, checkpointer, modules, phase: Callable) -> None:
        self.config = config
        self.checkpointer = checkpointer
        self.modules = modules
        self.phase = phase

    def after_step(self, step: int, *, stopping: bool) -> None:
        """The interval save after ``step`` steps, when due."""
        if interval_save_due(self.config, step, stopping=stopping):
            with self.phase(f"checkpoint save at step {step}", ("world",)):
                self.checkpointer.save(step)

    def final(self, step: int, result) -> None:
        """The end-of-run (or stop) checkpoint, committed, and the Hugging Face export; sets
        ``result.checkpoint``, ``result.hf_export`` and ``result.peft_export`` (``result``: the
        run's RunResult)."""
        c = self.config.checkpoint
        if result.stopped_by is not None or c.save_at_end:
            with self.phase(f"checkpoint save at step {step}", ("world",)):
                result.checkpoint = self.checkpointer.save(step)
        with self.phase(f"checkpoint commit at step {step}", ("world",)):
            self.checkpointer.close()  # waits for an async save's commit
        if c.hf_export is not None and result.stopped_by is None:
            with self.phase("Hugging Face export", ("world",)):
                export_hf(self.modules, c.hf_export, c.hf_init)
            result.hf_export = c.hf_export
        lora, target = lora_config_of(self.config), self.config.peft.export
        if lora is not None and target is not None and result.stopped_by is None:
            with self.phase("PEFT adapter export", ("world",)):
                export_adapters(self.modules, target, lora, c.hf_init)
            result.peft_export = target
