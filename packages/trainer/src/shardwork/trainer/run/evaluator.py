"""The run's evaluations: periodic ones (every ``eval.interval`` steps) and the final one.

- A periodic evaluation is cut short by a stop signal between its micro-batch chunks (the
  ``should_stop`` it is given must answer alike on every rank): the checkpoint that follows
  must fit in a scheduler's grace period, and a cut-short result is not needed.
- The final evaluation runs after the final checkpoint is committed. A first signal is
  announced at once ("stopping after this evaluation") and the evaluation finishes, its result
  being the run's final score; a second SIGINT abandons it and the run still ends normally.
- A finished evaluation is recorded in the run's result, written as a ``valid`` metrics line and
  reported against the corpus's bigram baseline when there is one.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.run.metrics_window import mtp_values
from shardwork.trainer.run.signals import StopRequest
from shardwork.trainer.run.step import EvalOutput, evaluate


def eval_due(config: TrainConfig, step: int) -> bool:
    """Whether ``eval.interval`` asks for an evaluation after ``step`` steps."""
    return config.eval.interval is not None and step % config.eval.interval == 0


class Evaluator:
    """Evaluates the run's model on its validation set (see the module docstring).

    ``num_microbatches`` is the evaluation's micro-batch count per data-parallel rank (0: no
    validation set, nothing is evaluated); ``valid_losses`` collects the finished evaluations'
    losses by step; ``writer`` (or None) gets the ``valid`` lines; ``evaluate_fn`` runs one
    evaluation (:func:`shardwork.trainer.run.step.evaluate`'s signature).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        num_microbatches: int,
        valid_losses: dict[int, float],
        writer,
        baseline: float | None,
        say: Callable[[str], None],
        evaluate_fn: Callable[..., EvalOutput | None],
    ) -> None:
        self.config = config
        self.num_microbatches = num_microbatches
        self.valid_losses = valid_losses
        self.writer = writer
        self.baseline = baseline
        self.say = say
        self.evaluate_fn = evaluate_fn

    @classmethod
    def for_run(cls, config, assembly, runtime, valid_set, **kwargs) -> Evaluator:
        """The evaluator of a run: :func:`~.step.evaluate` on ``valid_set`` with its model."""

        def evaluate_fn(*, num_microbatches, should_stop, step):
            return evaluate(
                assembly,
                runtime,
                valid_set,
                num_microbatches=num_microbatches,
                config=config,
                should_stop=should_stop,
                step=step,
            )

        return cls(config, evaluate_fn=evaluate_fn, **kwargs)

    def run(self, at_step: int, should_stop: Callable[[], bool]) -> EvalOutput | None:
        """Evaluate at ``at_step``, record and report the loss; None when cut short."""
        ev = self.evaluate_fn(
            num_microbatches=self.num_microbatches, should_stop=should_stop, step=at_step
        )
        if ev is not None:
            self.valid_losses[at_step] = ev.loss
            if self.writer is not None:
                self.writer.write("valid", at_step, {"loss": ev.loss, **mtp_values(ev.mtp)})
            note = ""
            if self.baseline is not None:
                below = "below" if ev.loss < self.baseline else "above"
                note = f" ({below} bigram {self.baseline:.4f})"
            self.say(f"step {at_step}: validation loss {ev.loss:.4f} nats/token{note}")
        return ev

    def periodic(self, step: int, stop: StopRequest, should_stop: Callable[[], bool]) -> bool:
        """The evaluation after ``step`` if ``eval.interval`` asks for one before the last step;
        True when a signal cut it short (``should_stop``, asked between chunks, said so)."""
        last = self.config.schedule.train_steps
        if not (self.num_microbatches > 0 and step < last and eval_due(self.config, step)):
            return False
        if self.run(step, should_stop) is not None:
            return False
        self.say(f"step {step}: evaluation cut short by {stop.signal_name}")
        return True

    def final_due(self, step: int, stopped_by: str | None) -> bool:
        """Whether the run that ended after ``step`` steps gets a final evaluation: it finished
        (no signal, every step taken) and ``eval.at_end`` or ``eval.interval`` asks for one."""
        finished = stopped_by is None and step == self.config.schedule.train_steps
        if not (self.num_microbatches > 0 and finished):
            return False
        return self.config.eval.at_end or eval_due(self.config, step)

    def final(self, step: int, stop: StopRequest, result) -> None:
        """The evaluation after the last step (``result``: the run's RunResult, whose
        ``stopped_by`` a signal during it sets; ``result.checkpoint`` is named in notices)."""
        saved = (
            f"checkpoint {result.checkpoint} is committed"
            if result.checkpoint
            else "no checkpoint configured"
        )

        def notice() -> bool:
            if stop.signal_name is not None and result.stopped_by is None:
                result.stopped_by = stop.signal_name
                self.say(
                    f"received {stop.signal_name} during the final evaluation: stopping after "
                    f"this evaluation ({saved}; Ctrl-C again to stop now)"
                )
            return False  # every rank runs the whole evaluation: no collective needed here

        try:
            self.run(step, notice)
            notice()
        except KeyboardInterrupt:
            result.stopped_by = "SIGINT"
            self.say(f"second SIGINT: final evaluation abandoned ({saved})")
