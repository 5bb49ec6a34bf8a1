"""The training run: set up, resume, loop, evaluate, checkpoint, report.

The loop is deliberately plain; everything heavy lives in the packages:
``train_step`` drives shardwork.models.pipeline's schedule and
finalize_model_grads and shardwork.dist_optimizer's step; checkpoints go
through shardwork.dist_checkpoint. Per step it:

1. sets the learning rate and weight decay of the step on the optimizer,
2. runs forward/backward over the step's global batch (size from the
   batch-size schedule), finalises gradients and steps,
3. handles a non-finite loss or gradient (skip the step or stop; a dynamic fp16 loss
   scaler's overflow while its scale can still drop is no failure, see :mod:`.nonfinite`),
4. logs (every ``logging.interval``; the main LM loss, each MTP depth's loss
   ``mtp_loss_<k>`` and each MoE aux-loss type as separate metrics), evaluates (every ``eval.interval``),
   checks data-parallel replicas (every ``reliability.check_dp_params_interval``),
   checkpoints (every ``checkpoint.interval``),
5. stops cleanly, with a checkpoint, when any rank received SIGTERM/SIGINT.

With ``checkpoint.hf_init`` the model starts from a Hugging Face folder, and with
``checkpoint.hf_export`` a finished run also writes one (:mod:`.hf`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardwork.trainer.config.load import config_to_toml
from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.data.baseline import bigram_entropy, nats_to_bits
from shardwork.trainer.data.builder import build_blend, build_eval_set, split_components
from shardwork.trainer.observe.metrics import MetricsWriter
from shardwork.trainer.observe.progress import Progress, format_duration
from shardwork.trainer.observe.throughput import memory_gib, peak_tflops
from shardwork.trainer.run.checkpointing import Checkpointer
from shardwork.trainer.run.collectives import collective_phase
from shardwork.trainer.run.hf import export_hf, will_resume
from shardwork.trainer.run.nonfinite import NonFiniteGuard
from shardwork.trainer.run.nonfinite import NonFiniteLossError as NonFiniteLossError  # re-export
from shardwork.trainer.run.params_check import check_dp_replicas
from shardwork.trainer.run.rng import derived_seed, rank_role, seed_everything
from shardwork.trainer.run.setup import build_assembly, init_runtime
from shardwork.trainer.run.signals import StopRequest
from shardwork.trainer.run.step import evaluate, train_step
from shardwork.trainer.schedules import (
    batch_size,
    consumed_samples,
    learning_rate,
    weight_decay,
)


@dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    final_step: int
    train_losses: dict[int, float] = field(default_factory=dict)
    """Global mean loss of every step taken in this process, by step index."""
    train_mtp_losses: dict[int, list[float]] = field(default_factory=dict)
    """Models with MTP: per-depth global mean MTP loss of every step (depth 1 first)."""
    valid_losses: dict[int, float] = field(default_factory=dict)
    bigram_nats: float | None = None
    checkpoint: str | None = None
    hf_export: str | None = None
    """The Hugging Face folder written at the end (checkpoint.hf_export), if any."""
    run_dir: str | None = None
    stopped_by: str | None = None
    skipped_steps: int = 0
    """Steps skipped for a NaN/Inf loss or gradient (reliability.on_nan='skip')."""
    overflow_skips: int = 0
    """fp16: steps skipped while the dynamic loss scaler lowered its scale (not failures)."""
    seconds: float = 0.0
    """Wall time of the whole run (set-up, loop, evaluation, checkpoints)."""
    loop_seconds: float = 0.0
    """Wall time of the training loop alone."""
    tokens: int = 0
    """Tokens trained on in this process's loop."""


def _train_samples(config: TrainConfig) -> int:
    s = config.schedule
    return consumed_samples(
        s.train_steps, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp
    )


def build_train_set(config: TrainConfig, components):
    """The run's training set: the ``train`` split's blend, sized for every step's samples
    (batch-size ramp included), shuffled with the run's seed as ``data.shuffle`` says."""
    return build_blend(
        components,
        size=_train_samples(config),
        seq_length=config.data.seq_length,
        seed=config.seed,
        shuffle=config.data.shuffle,
    )


def _baseline(components, runtime) -> float | None:
    """Bigram entropy (nats/token) of the training corpus, computed on the logging rank."""
    if not runtime.is_logging_rank or not components:
        return None
    import numpy as np

    from shardwork.trainer.data.indexed import IndexedDataset

    parts = []
    for c in components:
        ds = IndexedDataset(c.prefix)
        parts += [ds[int(d)] for d in range(len(ds))]
    if sum(p.size for p in parts) > 200_000_000:
        return None  # too large to count here; the baseline is for small corpora
    return bigram_entropy(np.concatenate(parts))


def reads_data(groups) -> bool:
    """Whether this rank reads samples: the first pipeline stage (input ids) and the last
    (labels; and input ids for multi-token prediction). Middle stages only receive
    activations, so they never open the dataset files."""
    return groups.is_first_pp_stage or groups.is_last_pp_stage


def _datasets(config: TrainConfig, groups):
    """``(components by split, train set, valid set, evaluation micro-batches per dp rank)``;
    empty / None / 0 on a rank that does not :func:`reads_data`."""
    if not reads_data(groups):
        return {"train": [], "valid": [], "test": []}, None, None, 0
    comps = split_components(config.data)
    seq = config.data.seq_length
    train_set = build_train_set(config, comps["train"])
    dp, mbs = groups.size("dp"), config.schedule.micro_batch_size
    gbs = config.schedule.global_batch_size
    eval_samples = None if config.eval.steps is None else config.eval.steps * gbs
    valid_set = build_eval_set(comps["valid"], seq_length=seq, num_samples=eval_samples)
    if valid_set is None:
        return comps, train_set, None, 0
    # Whole global batches, so every layout evaluates the same samples (a split smaller than
    # one global batch: as many micro-batches as fit on each data-parallel rank).
    usable = len(valid_set) // gbs * gbs or len(valid_set)
    eval_micro = max(1, usable // (mbs * dp))
    return comps, train_set, valid_set, eval_micro


def _eval_micro_batches_of_first_stage(count: int, runtime) -> int:
    """The first stage's evaluation micro-batch count on every pipeline stage (one broadcast
    over the pp group at start-up): middle stages run the same schedule without the data
    it is derived from (the validation set's size)."""
    groups = runtime.groups
    if groups.size("pp") == 1:
        return count
    value = torch.tensor([count], dtype=torch.int64, device=runtime.device)
    dist.broadcast(value, src=groups.members["pp"][0], group=groups.pp)
    return int(value.item())


class Trainer:
    """One training run for a resolved, validated :class:`TrainConfig`."""

    def __init__(self, config: TrainConfig, *, stream=None) -> None:
        self.config = config
        self.stream = stream or sys.stderr

    def say(self, text: str) -> None:
        """Print a message on the logging rank (through the progress bar when there is one;
        ``logging.progress = "none"`` silences progress lines, never messages)."""
        if self.runtime.is_logging_rank:
            progress = getattr(self, "progress", None)
            if progress is not None and progress.mode != "none":
                progress.write(text)
            else:
                print(text, file=self.stream, flush=True)

    def run(self) -> RunResult:
        config = self.config
        t_start = time.perf_counter()
        with collective_phase(
            "start-up (process-group rendezvous)",
            None,
            ("world",),
            timeout_minutes=config.parallel.timeout_minutes,
        ):
            self.runtime = runtime = init_runtime(config)
        try:
            return self._run(config, runtime, t_start)
        finally:
            if runtime.owns_distributed and dist.is_initialized():
                dist.destroy_process_group()

    def _run(self, config: TrainConfig, runtime, t_start: float) -> RunResult:
        groups = runtime.groups
        run_dir = Path(config.logging.run_dir)
        seed_everything(derived_seed(config.seed, 0, rank_role(groups)), runtime.device)

        seq = config.data.seq_length
        comps, train_set, valid_set, eval_micro = _datasets(config, groups)
        with self._phase("start-up (evaluation size broadcast)", ("pp",)):
            eval_micro = _eval_micro_batches_of_first_stage(eval_micro, runtime)

        hf_init = config.checkpoint.hf_init
        if hf_init is not None and will_resume(config):
            self.say(f"checkpoint.hf_init={hf_init!r} not read: the run resumes a checkpoint")
            hf_init = None
        with self._phase("start-up (model and optimizer build)", ("world",)):
            assembly = build_assembly(config, runtime, hf_init=hf_init)
        if hf_init is not None:
            self.say(f"imported the Hugging Face checkpoint {hf_init} at this layout")
        # Resume before anything is written: a bad checkpoint stops the run with the run
        # directory (config.toml, metrics) untouched.
        checkpointer = Checkpointer(config, runtime, assembly)
        with self._phase("start-up (checkpoint resume)", ("world",)):
            start_step = checkpointer.maybe_resume(say=self.say)
        result = RunResult(final_step=start_step, run_dir=str(run_dir))
        writer = None
        if runtime.is_logging_rank or config.logging.per_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            writer = MetricsWriter(
                run_dir,
                rank=None if runtime.is_logging_rank else runtime.rank,
                tensorboard=config.logging.tensorboard and runtime.is_logging_rank,
            )
            if runtime.is_logging_rank:
                (run_dir / "config.toml").write_text(config_to_toml(config))
                if writer.notice is not None:
                    self.say(f"notice: {writer.notice}")

        baseline = _baseline(comps["train"] + comps["valid"], runtime)
        result.bigram_nats = baseline
        flops_per_token = _flops_per_token(assembly.model_config, seq)
        peak, peak_source = peak_tflops(runtime.device, override=config.logging.peak_tflops)
        if runtime.is_logging_rank:
            tokens_total = _train_samples(config) * seq
            self.say(
                f"shardwork-train: {assembly.num_params / 1e6:.2f} M parameters, "
                f"{runtime.world_size} rank(s) {_layout_text(groups)} on {runtime.device.type}, "
                f"{config.schedule.train_steps} steps × {config.schedule.global_batch_size} × "
                f"{seq} tokens ({tokens_total / 1e6:.2f} M tokens)"
            )
            self.say(
                f"{flops_per_token / 1e6:.2f} MFLOP per token (shardwork.models.calculator); "
                + (
                    f"MFU against {peak:.4g} TFLOP/s per device ({peak_source})"
                    if peak is not None
                    else f"no MFU: {peak_source} (set logging.peak_tflops to report it)"
                )
            )
            if baseline is not None:
                self.say(
                    f"corpus bigram-entropy baseline: {baseline:.4f} nats/token "
                    f"({nats_to_bits(baseline):.4f} bits/token); the validation loss should end below it"
                )
                if writer is not None:
                    writer.write("event", start_step, {"bigram_nats": baseline})
        self.progress = (
            Progress(
                total_steps=config.schedule.train_steps,
                start_step=start_step,
                mode=config.logging.progress,
                stream=self.stream,
            )
            if runtime.is_logging_rank
            else None
        )
        s, o, r = config.schedule, config.optimizer, config.reliability
        guard = NonFiniteGuard(r, getattr(assembly.optimizer, "loss_scaler", None), self.say)
        window_tokens, window_t0 = 0, time.perf_counter()
        window_losses: list[float] = []
        window_mtp: list[list[float]] = []
        step = start_step
        stop = StopRequest(enabled=config.checkpoint.save_on_signal)

        def evaluate_run(at_step: int, should_stop):
            """Evaluate at ``at_step``, record and report the loss; None when cut short."""
            ev = evaluate(
                assembly,
                runtime,
                valid_set,
                num_microbatches=eval_micro,
                config=config,
                should_stop=should_stop,
                step=at_step,
            )
            if ev is not None:
                result.valid_losses[at_step] = ev.loss
                if writer is not None:
                    writer.write("valid", at_step, {"loss": ev.loss, **mtp_values(ev.mtp)})
                note = ""
                if baseline is not None:
                    below = "below" if ev.loss < baseline else "above"
                    note = f" ({below} bigram {baseline:.4f})"
                self.say(f"step {at_step}: validation loss {ev.loss:.4f} nats/token{note}")
            return ev

        loop_t0 = time.perf_counter()
        with stop:
            while step < s.train_steps:
                gbs = batch_size(
                    step, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp
                )
                lr = learning_rate(step, s, o)
                wd = weight_decay(step, o, train_steps=s.train_steps)
                for group in assembly.optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_mult", 1.0)
                    group["weight_decay"] = wd * group.get("wd_mult", 1.0)
                consumed = consumed_samples(
                    step, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp
                )
                guard.before_step()
                out = train_step(
                    assembly,
                    runtime,
                    train_set,
                    consumed=consumed,
                    global_batch_size=gbs,
                    config=config,
                    step=step,
                )
                guard.after_step(step, out.loss, out.update_successful)
                result.skipped_steps = guard.skipped_steps
                result.overflow_skips = guard.overflow_skips
                result.train_losses[step] = out.loss
                if out.mtp is not None:
                    result.train_mtp_losses[step] = out.mtp
                if math.isfinite(out.loss):
                    window_losses.append(out.loss)
                    if out.mtp is not None:
                        window_mtp.append(out.mtp)
                step += 1
                result.final_step = step
                window_tokens += gbs * seq
                result.tokens += gbs * seq

                log_now = step % config.logging.interval == 0 or step == s.train_steps
                values = {"loss": out.loss, **mtp_values(out.mtp), "lr": lr}
                if log_now:
                    # the logged losses are means over the steps since the last log line
                    if window_losses:
                        values["loss"] = sum(window_losses) / len(window_losses)
                    if window_mtp:
                        values.update(mtp_values([sum(d) / len(d) for d in zip(*window_mtp)]))
                    window_losses, window_mtp = [], []
                    elapsed = time.perf_counter() - window_t0
                    tps = window_tokens / max(elapsed, 1e-9)
                    window_tokens, window_t0 = 0, time.perf_counter()
                    values.update(
                        grad_norm=out.grad_norm if out.grad_norm is not None else float("nan"),
                        weight_decay=wd,
                        batch_size=gbs,
                        tokens_per_s=tps,
                        memory_gib=memory_gib(runtime.device),
                        consumed_samples=consumed + gbs,
                    )
                    if guard.scaler is not None:
                        values["loss_scale"] = guard.scaler.scale
                    if out.moe:
                        values.update(out.moe)
                    achieved = tps * flops_per_token / runtime.world_size / 1e12
                    values["tflops_per_device"] = achieved
                    if peak is not None:
                        values["mfu"] = achieved / peak
                    if writer is not None:
                        writer.write("train", step, values)
                if self.progress is not None:
                    self.progress.update(step, values, log_line=log_now)

                if (
                    r.check_dp_params_interval is not None
                    and step % r.check_dp_params_interval == 0
                ):
                    with self._phase(f"replica check at step {step}", ("dp_cp", "edp")):
                        check_dp_replicas(assembly.modules, groups, step=step)
                cut_short = False
                if eval_micro > 0 and step < s.train_steps and _eval_due(config, step):
                    # a periodic evaluation ends early on a signal: the checkpoint that follows
                    # must fit in a scheduler's grace period, and this result is not needed
                    ev = evaluate_run(step, lambda at=step: self._agreed(stop, at))
                    cut_short = ev is None
                    if cut_short:
                        self.say(f"step {step}: evaluation cut short by {stop.signal_name}")
                stopping = cut_short or self._agreed(stop, step)
                if (
                    config.checkpoint.interval is not None
                    and step % config.checkpoint.interval == 0
                    and step < s.train_steps
                    and not stopping
                ):
                    with self._phase(f"checkpoint save at step {step}", ("world",)):
                        checkpointer.save(step)
                if stopping:
                    result.stopped_by = stop.signal_name
                    self.say(
                        f"received {stop.signal_name}: saving a checkpoint at step {step} and exiting"
                    )
                    break
            result.loop_seconds = time.perf_counter() - loop_t0
            if self.progress is not None:
                self.progress.close()
                self.progress = None
            self._save_final(step, result, checkpointer, assembly)
            final_eval = eval_micro > 0 and result.stopped_by is None and step == s.train_steps
            if final_eval and (config.eval.at_end or _eval_due(config, step)):
                self._final_evaluation(step, stop, result, evaluate_run)
        if writer is not None:
            writer.close()
        result.seconds = time.perf_counter() - t_start
        if runtime.is_logging_rank:
            plots = []
            if config.logging.plot:
                from shardwork.trainer.observe.plot import plot_run

                plots = plot_run(run_dir)
            self._report(result, plots, writer)
        return result

    def _save_final(self, step: int, result: RunResult, checkpointer, assembly) -> None:
        """The end-of-run (or stop) checkpoint, committed, and the Hugging Face export.

        Called before the final evaluation: a signal during it cannot lose either.
        """
        config = self.config
        if result.stopped_by is not None or config.checkpoint.save_at_end:
            with self._phase(f"checkpoint save at step {step}", ("world",)):
                result.checkpoint = checkpointer.save(step)
        with self._phase(f"checkpoint commit at step {step}", ("world",)):
            checkpointer.close()  # waits for an async save's commit
        if config.checkpoint.hf_export is not None and result.stopped_by is None:
            with self._phase("Hugging Face export", ("world",)):
                export_hf(assembly.modules, config.checkpoint.hf_export)
            result.hf_export = config.checkpoint.hf_export

    def _phase(self, phase: str, names: tuple[str, ...]):
        """A block whose lost peer or timeout is re-raised naming ``phase`` and ``names``."""
        return collective_phase(
            phase,
            self.runtime.groups,
            names,
            timeout_minutes=self.config.parallel.timeout_minutes,
        )

    def _agreed(self, stop: StopRequest, step: int) -> bool:
        """Whether any rank received a signal (a collective over the world when distributed)."""
        if self.runtime.world_size > 1:
            with self._phase(f"stop-signal agreement after step {step}", ("world",)):
                return stop.agreed(device=self.runtime.device)
        return stop.signal_name is not None

    def _final_evaluation(self, step: int, stop: StopRequest, result: RunResult, evaluate_run):
        """The evaluation after the last step, run once the final checkpoint is committed.

        A first signal is announced at once ("stopping after this evaluation") and the
        evaluation finishes (its result is the run's final score); a second SIGINT abandons it
        and the run still ends normally, its checkpoint already on disk.
        """
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
            evaluate_run(step, notice)
            notice()
        except KeyboardInterrupt:
            result.stopped_by = "SIGINT"
            self.say(f"second SIGINT: final evaluation abandoned ({saved})")

    def _report(self, result: RunResult, plots, writer) -> None:
        lines = [f"done: {result.final_step} steps in {format_duration(result.seconds)}"]
        if result.valid_losses:
            last = result.valid_losses[max(result.valid_losses)]
            line = f"final validation loss {last:.4f} nats/token"
            if result.bigram_nats is not None:
                verdict = "below" if last < result.bigram_nats else "NOT below"
                line += f", {verdict} the bigram baseline {result.bigram_nats:.4f} nats/token"
            lines.append(line)
        if writer is not None:
            lines.append(f"metrics:    {writer.path}")
            if writer.tensorboard_dir is not None:
                lines.append(f"tensorboard: {writer.tensorboard_dir}")
        if plots:
            lines.append(f"plots:      {plots[0].parent}/ ({', '.join(p.name for p in plots)})")
        if result.checkpoint:
            lines.append(f"checkpoint: {result.checkpoint}")
            lines.append(f"sample:     shardwork-generate {result.checkpoint} --prompt 'The '")
        if result.hf_export:
            lines.append(f"hf export:  {result.hf_export} (transformers loads it)")
        for line in lines:
            print(line, file=self.stream, flush=True)


def mtp_values(losses: list[float] | None) -> dict[str, float]:
    """``{"mtp_loss_1": ..., "mtp_loss_2": ...}``: one metric per MTP depth (none without MTP)."""
    return {} if losses is None else {f"mtp_loss_{k}": v for k, v in enumerate(losses, start=1)}


def _eval_due(config: TrainConfig, step: int) -> bool:
    """Whether ``eval.interval`` asks for an evaluation after ``step`` steps."""
    return config.eval.interval is not None and step % config.eval.interval == 0


def _layout_text(groups) -> str:
    c = groups.config
    parts = [f"{n}={getattr(c, n)}" for n in ("tp", "pp", "cp", "ep", "dp") if getattr(c, n)]
    return "(" + " ".join(parts) + ")"


def _flops_per_token(model_config, seq_length: int) -> float:
    """Training FLOPs per token from shardwork.models' calculator."""
    from shardwork.models.calculator import flops_per_token

    return float(
        flops_per_token(model_config, seq_length, full_recompute=model_config.recompute == "full")
    )


def train(config: TrainConfig, *, stream=None) -> RunResult:
    """Run training for a resolved, validated config (see shardwork.trainer.config)."""
    torch.set_float32_matmul_precision("high")
    return Trainer(config, stream=stream).run()
