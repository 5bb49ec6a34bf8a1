"""The training loop's components alone (shardwork.trainer.run): step plan, metrics window,
evaluator, checkpoint policy, stop agreement, replica-check interval and the run result's
bookkeeping. Each is checked against expectations written here, not against the loop."""

import contextlib
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from shardwork.parallel_state.testing import run_on_ranks
from shardwork.trainer.run.checkpoint_policy import CheckpointPolicy, interval_save_due
from shardwork.trainer.run.evaluator import Evaluator
from shardwork.trainer.run.metrics_window import MetricsWindow
from shardwork.trainer.run.optimizers import adamw_parts, muon_parts
from shardwork.trainer.run.params_check import replica_check_due
from shardwork.trainer.run.signals import StopRequest, stop_agreed
from shardwork.trainer.run.step import EvalOutput, StepOutput
from shardwork.trainer.run.step_plan import StepPlan, apply_hyperparams
from shardwork.trainer.run.trainer import RunResult

CPU = torch.device("cpu")


class Recorder:
    """A metrics writer / checkpointer stand-in that records its calls in order."""

    def __init__(self):
        self.calls = []

    def write(self, kind, step, values):
        self.calls.append(("write", kind, step, dict(values)))

    def save(self, step):
        self.calls.append(("save", step))
        return f"ckpt/step_{step}"

    def close(self):
        self.calls.append(("close",))


def recording_phase(log):
    @contextlib.contextmanager
    def phase(name, groups):
        log.append(("phase", name, groups))
        yield

    return phase


# ---- step plan -------------------------------------------------------------------------------
def test_apply_hyperparams_scales_each_group_by_its_multipliers():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    optimizer = torch.optim.SGD(
        [
            {"params": [params[0]]},
            {"params": [params[1]], "lr_mult": 0.25, "wd_mult": 0.0},
            {"params": [params[2]], "lr_mult": 3.0},
        ],
        lr=1.0,
    )
    plan = StepPlan(step=4, global_batch_size=8, lr=0.0375, weight_decay=0.125, consumed=32)
    apply_hyperparams(optimizer, plan)
    got = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    assert got == [(0.0375, 0.125), (0.0375 * 0.25, 0.0), (0.0375 * 3.0, 0.125)]


# ---- metrics window --------------------------------------------------------------------------
def _window(clock_values, *, peak=None, scaler=None):
    ticks = iter(clock_values)
    return MetricsWindow(
        flops_per_token=6.0e6,
        world_size=2,
        peak_tflops=peak,
        device=CPU,
        loss_scaler=scaler,
        clock=lambda: next(ticks),
    )


def _out(loss, mtp=None, grad_norm=1.5, moe=None):
    return StepOutput(
        loss=loss, num_tokens=64, grad_norm=grad_norm, update_successful=True, moe=moe, mtp=mtp
    )


def test_metrics_window_logs_means_of_finite_steps_and_throughput():
    rng = random.Random(7)
    losses = [rng.uniform(2, 9) for _ in range(4)]
    mtps = [[rng.uniform(2, 9), rng.uniform(2, 9)] for _ in range(4)]
    losses[2] = float("nan")  # a skipped step: left out of the means, its tokens still count
    window = _window(
        [10.0, 14.0, 20.0, 100.0, 101.0], peak=200.0, scaler=SimpleNamespace(scale=1024.0)
    )
    for loss, mtp in zip(losses, mtps):
        window.add(_out(loss, mtp), tokens=8 * 16)
    plan = StepPlan(step=3, global_batch_size=8, lr=0.01, weight_decay=0.1, consumed=24)
    values = window.values(
        plan, _out(losses[3], mtps[3], moe={"load_balancing": 0.5}), log_now=True
    )
    finite = [0, 1, 3]
    assert values["loss"] == pytest.approx(sum(losses[i] for i in finite) / 3, rel=1e-15)
    for depth in (0, 1):
        mean = sum(mtps[i][depth] for i in finite) / 3
        assert values[f"mtp_loss_{depth + 1}"] == pytest.approx(mean, rel=1e-15)
    tps = 4 * 8 * 16 / (14.0 - 10.0)
    assert values["tokens_per_s"] == tps
    assert values["tflops_per_device"] == pytest.approx(tps * 6.0e6 / 2 / 1e12, rel=1e-15)
    assert values["mfu"] == pytest.approx(tps * 6.0e6 / 2 / 1e12 / 200.0, rel=1e-15)
    assert values["lr"] == 0.01 and values["weight_decay"] == 0.1
    assert values["batch_size"] == 8 and values["consumed_samples"] == 32
    assert values["grad_norm"] == 1.5 and values["loss_scale"] == 1024.0
    assert values["load_balancing"] == 0.5
    # the window starts again: the next logging step averages only what follows
    window.add(_out(losses[1]), tokens=128)
    later = window.values(plan, _out(losses[1], grad_norm=None), log_now=True)
    assert later["loss"] == losses[1] and "mtp_loss_1" not in later
    assert later["tokens_per_s"] == 128 / (100.0 - 20.0)
    assert math.isnan(later["grad_norm"])


def test_metrics_window_between_logging_steps_reports_the_step_itself():
    window = _window([0.0])
    loss = 5.123
    window.add(_out(loss, [4.5]), tokens=100)
    plan = StepPlan(step=0, global_batch_size=4, lr=0.002, weight_decay=0.0, consumed=0)
    assert window.values(plan, _out(loss, [4.5]), log_now=False) == {
        "loss": loss,
        "mtp_loss_1": 4.5,
        "lr": 0.002,
    }
    assert window.tokens == 100  # not reset: the next logging step counts it


def test_metrics_window_with_only_nonfinite_steps_logs_the_step_loss():
    window = _window([0.0, 2.0, 2.0])
    window.add(_out(float("inf")), tokens=10)
    plan = StepPlan(step=0, global_batch_size=1, lr=0.1, weight_decay=0.0, consumed=0)
    values = window.values(plan, _out(float("inf")), log_now=True)
    assert values["loss"] == float("inf") and "mfu" not in values and "loss_scale" not in values


# ---- evaluator -------------------------------------------------------------------------------
def _eval_config(*, interval, train_steps=6, at_end=False):
    return SimpleNamespace(
        eval=SimpleNamespace(interval=interval, at_end=at_end),
        schedule=SimpleNamespace(train_steps=train_steps),
    )


def _evaluator(config, evaluate_fn, *, micro=3, baseline=None):
    said, writer, losses = [], Recorder(), {}
    ev = Evaluator(
        config,
        num_microbatches=micro,
        valid_losses=losses,
        writer=writer,
        baseline=baseline,
        say=said.append,
        evaluate_fn=evaluate_fn,
    )
    return ev, said, writer, losses


def test_periodic_evaluation_decision_table():
    calls = []

    def evaluate_fn(*, num_microbatches, should_stop, step):
        calls.append((step, num_microbatches))
        return EvalOutput(loss=3.0, num_tokens=10)

    cases = [(dict(interval=2), 3, [2, 4]), (dict(interval=None), 3, []), (dict(interval=2), 0, [])]
    stop = StopRequest(enabled=False)
    for kwargs, micro, expected in cases:
        calls.clear()
        ev, *_ = _evaluator(_eval_config(**kwargs), evaluate_fn, micro=micro)
        cut = [ev.periodic(step, stop, lambda: False) for step in range(1, 7)]
        assert cut == [False] * 6
        # step 6 is the last: the final evaluation covers it, not a periodic one
        assert calls == [(s, micro) for s in expected], kwargs


def test_periodic_evaluation_records_writes_and_compares_with_the_baseline():
    rng = random.Random(3)
    loss, mtp = rng.uniform(3, 6), [rng.uniform(3, 6)]

    def evaluate_fn(*, num_microbatches, should_stop, step):
        return EvalOutput(loss=loss, num_tokens=10, mtp=mtp)

    ev, said, writer, losses = _evaluator(_eval_config(interval=2), evaluate_fn, baseline=4.5)
    assert ev.periodic(2, StopRequest(enabled=False), lambda: False) is False
    assert losses == {2: loss}
    assert writer.calls == [("write", "valid", 2, {"loss": loss, "mtp_loss_1": mtp[0]})]
    word = "below" if loss < 4.5 else "above"
    assert said == [f"step 2: validation loss {loss:.4f} nats/token ({word} bigram 4.5000)"]


def test_periodic_evaluation_cut_short_between_micro_batches_reports_nothing():
    stop = StopRequest(enabled=False)
    asked = []

    def evaluate_fn(*, num_microbatches, should_stop, step):
        # the real evaluation asks between chunks and returns None when told to stop
        for chunk in range(1, num_microbatches):
            stop.signal_name = "SIGTERM" if chunk == 2 else stop.signal_name
            asked.append(chunk)
            if should_stop():
                return None
        return EvalOutput(loss=1.0, num_tokens=1)

    ev, said, writer, losses = _evaluator(_eval_config(interval=2), evaluate_fn, micro=4)
    assert ev.periodic(4, stop, lambda: stop.signal_name is not None) is True
    assert asked == [1, 2]
    assert losses == {} and writer.calls == []
    assert said == ["step 4: evaluation cut short by SIGTERM"]


def test_final_evaluation_decision_table():
    ev, *_ = _evaluator(_eval_config(interval=4, train_steps=6), None)
    assert ev.final_due(6, None) is False  # 6 is no multiple of 4 and at_end is off
    ev, *_ = _evaluator(_eval_config(interval=3, train_steps=6), None)
    assert ev.final_due(6, None) is True
    assert ev.final_due(6, "SIGTERM") is False and ev.final_due(5, None) is False
    ev, *_ = _evaluator(_eval_config(interval=None, train_steps=6, at_end=True), None)
    assert ev.final_due(6, None) is True
    ev, *_ = _evaluator(_eval_config(interval=None, at_end=True), None, micro=0)
    assert ev.final_due(6, None) is False


def test_final_evaluation_finishes_after_a_first_signal():
    stop = StopRequest(enabled=False)
    answers = []

    def evaluate_fn(*, num_microbatches, should_stop, step):
        answers.append(should_stop())
        stop.signal_name = "SIGTERM"
        answers.append(should_stop())
        return EvalOutput(loss=2.5, num_tokens=1)

    ev, said, _, losses = _evaluator(_eval_config(interval=None, at_end=True), evaluate_fn)
    result = RunResult(final_step=6, checkpoint="ckpt/step_6")
    ev.final(6, stop, result)
    assert answers == [False, False]  # never cut short: the final score is wanted
    assert losses == {6: 2.5} and result.stopped_by == "SIGTERM"
    assert said == [
        "received SIGTERM during the final evaluation: stopping after this evaluation "
        "(checkpoint ckpt/step_6 is committed; Ctrl-C again to stop now)",
        "step 6: validation loss 2.5000 nats/token",
    ]


def test_final_evaluation_second_sigint_abandons_it():
    def evaluate_fn(*, num_microbatches, should_stop, step):
        raise KeyboardInterrupt

    ev, said, _, losses = _evaluator(_eval_config(interval=None, at_end=True), evaluate_fn)
    result = RunResult(final_step=6)
    ev.final(6, StopRequest(enabled=False), result)
    assert result.stopped_by == "SIGINT" and losses == {}
    assert said == ["second SIGINT: final evaluation abandoned (no checkpoint configured)"]


# ---- checkpoint policy -----------------------------------------------------------------------
def _ckpt_config(*, interval=3, train_steps=7, save_at_end=True, hf_export=None):
    return SimpleNamespace(
        checkpoint=SimpleNamespace(interval=interval, save_at_end=save_at_end, hf_export=hf_export),
        schedule=SimpleNamespace(train_steps=train_steps),
        peft=SimpleNamespace(method="none", export=None),
    )


def test_interval_save_decision_table():
    config = _ckpt_config(interval=3, train_steps=9)
    due = [s for s in range(1, 10) if interval_save_due(config, s, stopping=False)]
    assert due == [3, 6]  # 9 is the last step: the final save covers it
    assert not any(interval_save_due(config, s, stopping=True) for s in range(1, 10))
    none = _ckpt_config(interval=None)
    assert not any(interval_save_due(none, s, stopping=False) for s in range(1, 10))


def test_checkpoint_policy_saves_in_order_through_named_phases():
    log = []
    saver = Recorder()
    saver.calls = log
    policy = CheckpointPolicy(_ckpt_config(), saver, modules=[], phase=recording_phase(log))
    policy.after_step(2, stopping=False)
    policy.after_step(3, stopping=False)
    policy.after_step(6, stopping=True)
    result = RunResult(final_step=7)
    policy.final(7, result)
    assert log == [
        ("phase", "checkpoint save at step 3", ("world",)),
        ("save", 3),
        ("phase", "checkpoint save at step 7", ("world",)),
        ("save", 7),
        ("phase", "checkpoint commit at step 7", ("world",)),
        ("close",),
    ]
    assert result.checkpoint == "ckpt/step_7" and result.hf_export is None


def test_final_checkpoint_on_a_stop_and_without_save_at_end():
    for stopped_by, expected in (("SIGTERM", [("save", 4), ("close",)]), (None, [("close",)])):
        saver = Recorder()
        # a stopped run exports nothing: a folder is configured only where none may be written
        export = "/never/written" if stopped_by else None
        config = _ckpt_config(save_at_end=False, hf_export=export)
        policy = CheckpointPolicy(config, saver, modules=[], phase=recording_phase([]))
        result = RunResult(final_step=4, stopped_by=stopped_by)
        policy.final(4, result)
        assert saver.calls == expected
        assert result.checkpoint == ("ckpt/step_4" if stopped_by else None)
        assert result.hf_export is None


# ---- stop agreement, replica check, run result ------------------------------------------------
def test_stop_agreed_on_one_rank_needs_no_collective():
    log, stop = [], StopRequest(enabled=False)
    runtime = SimpleNamespace(world_size=1, device=CPU)
    assert stop_agreed(stop, 3, runtime=runtime, phase=recording_phase(log)) is False
    stop.signal_name = "SIGINT"
    assert stop_agreed(stop, 4, runtime=runtime, phase=recording_phase(log)) is True
    assert log == []


def _agree_when_rank1_is_signalled():
    log, stop = [], StopRequest(enabled=False)
    runtime = SimpleNamespace(world_size=dist.get_world_size(), device=CPU)
    before = stop_agreed(stop, 1, runtime=runtime, phase=recording_phase(log))
    if dist.get_rank() == 1:
        stop.signal_name = "SIGTERM"
    after = stop_agreed(stop, 2, runtime=runtime, phase=recording_phase(log))
    return before, after, stop.signal_name, log


@pytest.mark.multirank
def test_stop_agreed_over_two_ranks():
    results = run_on_ranks(_agree_when_rank1_is_signalled, 2)
    phases = [
        ("phase", "stop-signal agreement after step 1", ("world",)),
        ("phase", "stop-signal agreement after step 2", ("world",)),
    ]
    assert results == [
        (False, True, "signal on another rank", phases),
        (False, True, "SIGTERM", phases),
    ]


def test_replica_check_interval():
    assert [s for s in range(1, 13) if replica_check_due(5, s)] == [5, 10]
    assert not any(replica_check_due(None, s) for s in range(1, 13))


def test_run_result_records_each_step():
    result = RunResult(final_step=3)
    guard = SimpleNamespace(skipped_steps=1, overflow_skips=2)
    result.record_step(3, _out(4.25, [4.5, 4.75]), tokens=96, guard=guard)
    result.record_step(4, _out(float("nan")), tokens=96, guard=guard)
    assert result.final_step == 5 and result.tokens == 192
    assert result.train_losses[3] == 4.25 and math.isnan(result.train_losses[4])
    assert result.train_mtp_losses == {3: [4.5, 4.75]}
    assert (result.skipped_steps, result.overflow_skips) == (1, 2)


# ---- optimizer param groups -------------------------------------------------------------------
def test_optimizer_param_groups_by_name_and_shape():
    o = SimpleNamespace(lr=0.001, muon_lr=0.02)
    matrix, vector = torch.randn(4, 4), torch.randn(4)
    _, adamw_group = adamw_parts(o)
    assert adamw_group("decoder.layers.0.mlp.linear_fc1.weight", matrix) == {"wd_mult": 1.0}
    assert adamw_group("decoder.final_norm.weight", vector) == {"wd_mult": 0.0}
    _, muon_group = muon_parts(o, groups=None)
    hidden = {"use_muon": True, "wd_mult": 1.0, "lr_mult": 0.02 / 0.001}
    assert muon_group("decoder.layers.0.mlp.linear_fc1.weight", matrix) == hidden
    qkv = muon_group("decoder.layers.0.self_attention.linear_qkv.weight", matrix)
    assert qkv == {**hidden, "fused_blocks": 3}
    assert muon_group("embedding.word_embeddings.weight", matrix) == {
        "use_muon": False,
        "wd_mult": 1.0,
    }
    assert muon_group("decoder.final_norm.weight", vector) == {"use_muon": False, "wd_mult": 0.0}
