"""SIGTERM / SIGINT during evaluation: a periodic evaluation is cut short and the run stops with
a checkpoint; the final checkpoint is committed before the final evaluation, a first signal
there is announced at once, a second SIGINT abandons it and the run still exits cleanly.

The signal is sent from inside the evaluation's schedule call (a wrapper around
``run_schedule``), so it arrives at a known evaluation micro-batch: no timers.
"""

import os
import signal

import pytest

import shardwork.trainer.run.step as step_module
from shardwork.dist_checkpoint import is_committed
from shardwork.trainer.cli import train_main
from shardwork.trainer.config.load import config_to_toml
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config

REAL_SCHEDULE = step_module.run_schedule
EVAL_MICRO = 4
"""eval.steps = 2 global batches of 8 sequences in micro-batches of 4."""


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _config(run_dir, *, steps, **sections):
    sections.setdefault("eval", {"interval": 2, "steps": 2, "at_end": False})
    return tiny_config(run_dir, schedule={"train_steps": steps, "warmup_steps": 1}, **sections)


def _signal_during_eval(monkeypatch, signum, *, at_call: int, times: int = 1, on_send=None):
    """Send ``signum`` (``times`` times) while evaluation micro-batch ``at_call`` (0-based,
    counted over the whole run) runs; returns the list of evaluation calls made."""
    real, calls = REAL_SCHEDULE, []

    def schedule(*args, forward_only, **kwargs):
        if forward_only:
            calls.append(kwargs["num_microbatches"])
            if len(calls) == at_call + 1:
                if on_send is not None:
                    on_send()
                for _ in range(times):
                    os.kill(os.getpid(), signum)
        return real(*args, forward_only=forward_only, **kwargs)

    monkeypatch.setattr(step_module, "run_schedule", schedule)
    return calls


def test_signal_cuts_a_periodic_evaluation_short_and_checkpoints(tmp_path, monkeypatch, capsys):
    reference = train(_config(tmp_path / "ref", steps=4))
    assert sorted(reference.valid_losses) == [2, 4]
    capsys.readouterr()

    calls = _signal_during_eval(monkeypatch, signal.SIGTERM, at_call=1)
    result = train(_config(tmp_path / "a", steps=4))
    err = capsys.readouterr().err
    assert "step 2: evaluation cut short by SIGTERM\n" in err
    assert "received SIGTERM: saving a checkpoint at step 2 and exiting\n" in err
    # one micro-batch per check without pipelining: micro-batches 0 and 1 ran, 2 and 3 did not
    assert calls == [1, 1]
    assert result.stopped_by == "SIGTERM"
    assert result.final_step == 2 and sorted(result.train_losses) == [0, 1]
    assert result.valid_losses == {}  # a cut-short evaluation reports nothing
    ckpt = tmp_path / "a" / "checkpoints" / "step_000000002"
    assert result.checkpoint == str(ckpt) and is_committed(ckpt)

    monkeypatch.setattr(step_module, "run_schedule", REAL_SCHEDULE)
    resumed = train(_config(tmp_path / "b", steps=4, checkpoint={"resume": str(ckpt)}))
    assert sorted(resumed.train_losses) == [2, 3]
    for step in (2, 3):
        assert resumed.train_losses[step] == reference.train_losses[step], step
    assert resumed.valid_losses[4] == reference.valid_losses[4]


def test_first_signal_in_the_final_evaluation_lets_it_finish(tmp_path, monkeypatch, capsys):
    final = {"interval": None, "steps": 2, "at_end": True}
    ckpt = tmp_path / "checkpoints" / "step_000000003"
    committed_at_signal = []
    calls = _signal_during_eval(
        monkeypatch,
        signal.SIGINT,
        at_call=0,
        on_send=lambda: committed_at_signal.append(is_committed(ckpt)),
    )
    config = _config(tmp_path, steps=3, eval=final, checkpoint={"save_at_end": True})
    result = train(config)
    assert committed_at_signal == [True]  # the checkpoint was on disk before the evaluation
    assert calls == [1] * EVAL_MICRO  # the evaluation ran to its end
    assert result.stopped_by == "SIGINT"
    assert set(result.valid_losses) == {3}
    assert result.checkpoint == str(ckpt) and is_committed(ckpt)
    err = capsys.readouterr().err
    assert "received SIGINT during the final evaluation: stopping after this evaluation" in err


def test_second_sigint_abandons_the_final_evaluation_cleanly(tmp_path, monkeypatch, capsys):
    final = {"interval": None, "steps": 2, "at_end": True}
    config = _config(tmp_path, steps=3, eval=final, checkpoint={"save_at_end": True})
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config))
    before = signal.getsignal(signal.SIGINT)
    calls = _signal_during_eval(monkeypatch, signal.SIGINT, at_call=1, times=2)

    assert train_main(["--config", str(path)]) == 0
    assert calls == [1, 1]  # abandoned inside micro-batch 1
    err = capsys.readouterr().err
    assert "second SIGINT: final evaluation abandoned" in err
    assert "Traceback" not in err and "final validation loss" not in err
    ckpt = tmp_path / "checkpoints" / "step_000000003"
    assert is_committed(ckpt)
    assert signal.getsignal(signal.SIGINT) is before

    # the committed checkpoint resumes: one more step from step 3
    monkeypatch.setattr(step_module, "run_schedule", REAL_SCHEDULE)
    more = _config(tmp_path / "more", steps=4, eval=final, checkpoint={"resume": str(ckpt)})
    assert sorted(train(more).train_losses) == [3]


def test_second_sigint_during_training_exits_130_without_traceback(tmp_path, monkeypatch, capsys):
    import shardwork.trainer.run.trainer as trainer_module

    config = _config(tmp_path, steps=100_000, eval={"interval": None, "at_end": False})
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config))
    real_step, calls = trainer_module.train_step, []

    def step_then_two_sigints(*args, **kwargs):
        out = real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(trainer_module, "train_step", step_then_two_sigints)
    assert train_main(["--config", str(path)]) == 130
    err = capsys.readouterr().err
    assert "shardwork-train: interrupted by a second SIGINT" in err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("checkpoints/step_*"))


def test_sigint_with_save_on_signal_off_names_that_setting(tmp_path, monkeypatch, capsys):
    """checkpoint.save_on_signal = false: one SIGINT ends the run (Python's own handler); the
    line says so instead of blaming a second SIGINT that was never sent."""
    import shardwork.trainer.run.trainer as trainer_module

    config = _config(
        tmp_path,
        steps=100_000,
        eval={"interval": None, "at_end": False},
        checkpoint={"save_on_signal": False},
    )
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config))
    real_step, calls = trainer_module.train_step, []

    def step_then_one_sigint(*args, **kwargs):
        out = real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(trainer_module, "train_step", step_then_one_sigint)
    assert train_main(["--config", str(path)]) == 130
    err = capsys.readouterr().err
    assert "shardwork-train: interrupted by SIGINT (checkpoint.save_on_signal=false" in err
    assert "second SIGINT" not in err
    assert "Traceback" not in err
    assert len(calls) == 2  # stopped in the step it was sent, not after a clean stop
    assert not list(tmp_path.glob("checkpoints/step_*"))
