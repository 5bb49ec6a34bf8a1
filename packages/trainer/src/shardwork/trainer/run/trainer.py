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

import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardwork.dist_optimizer import DistributedDataParallel
from shardwork.models.block_compile import compile_report
from shardwork.models.calculator import flops_per_token
from shardwork.trainer.config.load import config_to_toml
from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.data.baseline import blend_bigram_entropy, nats_to_bits
from shardwork.trainer.data.builder import build_blend, build_eval_set, split_components
from shardwork.trainer.data.indexed import IndexedDataset
from shardwork.trainer.observe.earlier_run import LOGGING_RANK_LOGS, set_aside
from shardwork.trainer.observe.metrics import MetricsWriter, metrics_path
from shardwork.trainer.observe.plot import plot_run
from shardwork.trainer.observe.progress import Progress, format_duration
from shardwork.trainer.observe.throughput import peak_tflops
from shardwork.trainer.run.checkpoint_policy import CheckpointPolicy
from shardwork.trainer.run.checkpointing import Checkpointer
from shardwork.trainer.run.collectives import collective_phase
from shardwork.trainer.run.evaluator import Evaluator
from shardwork.trainer.run.hf import will_resume
from shardwork.trainer.run.metrics_window import MetricsWindow
from shardwork.trainer.run.nonfinite import NonFiniteGuard
from shardwork.trainer.run.nonfinite import NonFiniteLossError as NonFiniteLossError  # re-export
from shardwork.trainer.run.params_check import check_dp_replicas, replica_check_due
from shardwork.trainer.run.preflight import no_validation_sample_warning
from shardwork.trainer.run.rng import derived_seed, rank_role, seed_everything
from shardwork.trainer.run.setup import Assembly, build_assembly, init_runtime
from shardwork.trainer.run.signals import StopRequest, stop_agreed
from shardwork.trainer.run.step import StepOutput, train_step
from shardwork.trainer.run.step_plan import StepPlan, apply_hyperparams, plan_step
from shardwork.trainer.schedules import consumed_samples


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
    peft_export: str | None = None
    """The PEFT adapter folder written at the end (peft.export), if any."""
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

    def record_step(self, step: int, out: StepOutput, *, tokens: int, guard) -> None:
        """Record finished step ``step`` (0-based): its losses, its ``tokens`` and the
        non-finite ``guard``'s skip counts."""
        self.skipped_steps = guard.skipped_steps
        self.overflow_skips = guard.overflow_skips
        self.train_losses[step] = out.loss
        if out.mtp is not None:
            self.train_mtp_losses[step] = out.mtp
        self.final_step = step + 1
        self.tokens += tokens

    @property
    def start_step(self) -> int:
        """The step the run started from: 0, or the resumed checkpoint's (every step taken
        since is recorded, up to ``final_step``)."""
        return self.final_step - len(self.train_losses)


@dataclass
class RunParts:
    """The training loop's components, built at start-up by ``Trainer._start``."""

    assembly: Assembly
    train_set: object
    """The training set (None on a pipeline stage that reads no data)."""
    result: RunResult
    writer: MetricsWriter | None
    guard: NonFiniteGuard
    window: MetricsWindow
    stop: StopRequest
    evaluator: Evaluator
    checkpoints: CheckpointPolicy
    data_offset: int = 0
    """Samples read beyond (negative: short of) this run's batch schedule, carried over from a
    resumed checkpoint's run with other batch sizes (``Checkpointer.data_offset``)."""


def _train_samples(config: TrainConfig) -> int:
    s = config.schedule
    return consumed_samples(
        s.train_steps, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp
    )


def build_train_set(
    config: TrainConfig, components, *, data_offset: int = 0, sample_order: str = "blocks"
):
    """The run's training set: the ``train`` split's blend, sized for every step's samples
    (batch-size ramp included) read from ``data_offset`` on, shuffled with the run's seed as
    ``data.shuffle`` says. In the ``"blocks"`` sample order its first samples do not depend on
    its size (data/gpt_dataset.py); ``"whole"`` continues a checkpoint written in that earlier order."""
    return build_blend(
        components,
        size=_train_samples(config) + max(data_offset, 0),
        seq_length=config.data.seq_length,
        seed=config.seed,
        shuffle=config.data.shuffle,
        sample_order=sample_order,
    )


def _train_set_for(config: TrainConfig, components, groups, checkpointer):
    """The training set at the data position and sample order of the run's start (a fresh
    run's, or the resumed checkpoint's: ``Checkpointer.data_offset``, ``.sample_order``); None
    on a rank that does not :func:`reads_data`. Built once, after the resume decided both."""
    if not reads_data(groups):
        return None
    return build_train_set(
        config,
        components["train"],
        data_offset=checkpointer.data_offset,
        sample_order=checkpointer.sample_order,
    )


def _baseline(components, runtime) -> float | None:
    """Bigram entropy (nats/token) of the training blend over its corpora's documents (every
    split's), each corpus weighted by its ``train`` blend weight; on the logging rank only."""
    if not runtime.is_logging_rank or not components["train"]:
        return None
    weights: dict[str, float] = {}
    for c in components["train"]:
        weights[c.prefix] = weights.get(c.prefix, 0.0) + c.weight
    parts, size = [], 0
    for prefix, weight in weights.items():
        ds = IndexedDataset(prefix)
        size += int(ds.sequence_lengths.sum())
        if size > 200_000_000:
            return None  # too large to count here; the baseline is for small corpora
        parts.append((weight, np.concatenate([ds[int(d)] for d in range(len(ds))])))
    return blend_bigram_entropy(parts)


def reads_data(groups) -> bool:
    """Whether this rank reads samples: the first pipeline stage (input ids) and the last
    (labels; and input ids for multi-token prediction). Middle stages only receive
    activations, so they never open the dataset files."""
    return groups.is_first_pp_stage or groups.is_last_pp_stage


def _datasets(config: TrainConfig, groups):
    """``(components by split, valid set, evaluation micro-batches per dp rank)``; empty /
    None / 0 on a rank that does not :func:`reads_data` (the training set waits for the
    resume: :func:`_train_set_for`)."""
    if not reads_data(groups):
        return {"train": [], "valid": [], "test": []}, None, 0
    comps = split_components(config.data)
    seq = config.data.seq_length
    dp, mbs = groups.size("dp"), config.schedule.micro_batch_size
    gbs = config.schedule.global_batch_size
    eval_samples = None if config.eval.steps is None else config.eval.steps * gbs
    valid_set = build_eval_set(comps["valid"], seq_length=seq, num_samples=eval_samples)
    if valid_set is None:
        return comps, None, 0
    # Whole global batches, so every layout evaluates the same samples (a split smaller than
    # one global batch: as many micro-batches as fit on each data-parallel rank).
    usable = len(valid_set) // gbs * gbs or len(valid_set)
    eval_micro = max(1, usable // (mbs * dp))
    return comps, valid_set, eval_micro


def _eval_micro_batches_of_first_stage(count: int, runtime) -> int:
    """The first stage's evaluation micro-batch count on every pipeline stage (one broadcast
    over the pp group at start-up): middle stages run the same schedule without the data
    it is derived from (the validation set's size)."""
    groups = runtime.groups
    if groups.size("pp") == 1:
        return count
    value = torch.tensor([count], dtype=torch.int64, device=runtime.device)
    # broadcast's src is a global rank: the first stage of this rank's pipeline.
    dist.broadcast(value, src=groups.members["pp"][0], group=groups.pp)
    return int(value.item())


class Trainer:
    """One training run for a resolved, validated :class:`TrainConfig`."""

    def __init__(self, config: TrainConfig, *, stream=None) -> None:
        self.config = config
        self.stream = stream or sys.stderr
        self.assembly: Assembly | None = None

    def _say_if_nothing_left(self, start_step: int) -> None:
        """A resumed checkpoint at or past ``schedule.train_steps`` trains nothing: say why,
        instead of a run that ends without a step."""
        train_steps = self.config.schedule.train_steps
        if start_step > 0 and start_step >= train_steps:
            self.say(
                f"notice: the checkpoint is at step {start_step}, at or past "
                f"schedule.train_steps={train_steps}: nothing left to train (raise "
                "schedule.train_steps to continue)"
            )

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
            # Detach the DDP wrappers: a model the caller keeps after train() gets plain
            # gradients again. (Freeing a dropped run no longer depends on this: the wrappers'
            # gradient hooks hold them weakly.)
            for chunk in self.assembly.chunks if self.assembly is not None else ():
                if isinstance(chunk, DistributedDataParallel):
                    chunk.remove_hooks()
            # Only a process group this run created itself is torn down.
            if runtime.owns_distributed and dist.is_initialized():
                dist.destroy_process_group()

    def _run(self, config: TrainConfig, runtime, t_start: float) -> RunResult:
        """Start up, then the loop: per step plan, train, guard, log, check replicas, evaluate,
        agree on a stop, checkpoint; then the final checkpoint and evaluation, and the report.

        Every collective (train step, replica check, evaluation and its stop checks, stop
        agreement, saves) is issued in this order on every rank.
        """
        p = self._start(config, runtime)
        result, stop, last = p.result, p.stop, config.schedule.train_steps
        step = result.final_step
        agreed = partial(stop_agreed, stop, runtime=runtime, phase=self._phase)
        loop_t0, first_step = time.perf_counter(), step
        with stop:
            while step < last:
                plan = plan_step(step, config, data_offset=p.data_offset)
                apply_hyperparams(p.assembly.optimizer, plan)
                p.guard.before_step()
                step_t0 = time.perf_counter()
                out = train_step(
                    p.assembly,
                    runtime,
                    p.train_set,
                    consumed=plan.consumed,
                    global_batch_size=plan.global_batch_size,
                    config=config,
                    step=step,
                )
                if step == first_step and p.assembly.compiled_layers:
                    self._report_compile(p, step, time.perf_counter() - step_t0)
                p.guard.after_step(step, out.loss, out.update_successful)
                step += 1
                tokens = plan.global_batch_size * config.data.seq_length
                result.record_step(plan.step, out, tokens=tokens, guard=p.guard)
                p.window.add(out, tokens)
                self._log_step(p, step, plan, out)
                if replica_check_due(config.reliability.check_dp_params_interval, step):
                    with self._phase(f"replica check at step {step}", ("dp_cp", "edp")):
                        # overlap_param_gather: the step's gathers are still in flight
                        p.assembly.optimizer.finish_param_sync()
                        check_dp_replicas(p.assembly.modules, runtime.groups, step=step)
                cut_short = p.evaluator.periodic(step, stop, partial(agreed, step))
                # a cut-short evaluation already agreed on the stop: no second agreement
                stopping = cut_short or agreed(step)
                p.checkpoints.after_step(step, stopping=stopping)
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
            # the final checkpoint precedes the final evaluation: a signal there loses nothing
            p.checkpoints.final(step, result)
            if p.evaluator.final_due(step, result.stopped_by):
                p.evaluator.final(step, stop, result)
        self._finish(p, t_start)
        return result

    def _say_if_no_validation(self, config: TrainConfig, valid_split, valid_set) -> None:
        """Warn a run that evaluates but reads data without a validation sample (a rank that
        reads no data has neither, and says nothing)."""
        evaluates = config.eval.interval is not None or config.eval.at_end
        if evaluates and valid_set is None and reads_data(self.runtime.groups):
            self.say(no_validation_sample_warning(config, valid_split))

    def _weight_sources(self, config: TrainConfig):
        """``(hf_init, megatron_init, peft_init)`` this run reads its initial weights from:
        none of them when it resumes a checkpoint (said), except a LoRA run's base."""
        hf_init = config.checkpoint.hf_init
        # A LoRA run's checkpoints hold adapters only: its frozen base comes from hf_init (or
        # megatron_init) again.
        if hf_init is not None and will_resume(config) and config.peft.method != "lora":
            self.say(f"checkpoint.hf_init={hf_init!r} not read: the run resumes a checkpoint")
            hf_init = None
        megatron_init = config.checkpoint.megatron_init
        if megatron_init is not None and will_resume(config) and config.peft.method != "lora":
            self.say(f"checkpoint.megatron_init={megatron_init!r} not read: the run resumes")
            megatron_init = None
        # A resumed LoRA run's adapters come from its checkpoint, not from peft.init.
        peft_init = None if will_resume(config) else config.peft.init
        return hf_init, megatron_init, peft_init

    def _start(self, config: TrainConfig, runtime) -> RunParts:
        """Seed, data, model and optimizer, resume, metrics writer, start-up messages and the
        loop's components, in this order (resume precedes anything written to the run dir)."""
        groups = runtime.groups
        run_dir = Path(config.logging.run_dir)
        seed_everything(derived_seed(config.seed, 0, rank_role(groups)), runtime.device)
        comps, valid_set, eval_micro = _datasets(config, groups)
        self._say_if_no_validation(config, comps["valid"], valid_set)
        with self._phase("start-up (evaluation size broadcast)", ("pp",)):
            eval_micro = _eval_micro_batches_of_first_stage(eval_micro, runtime)
        hf_init, megatron_init, peft_init = self._weight_sources(config)
        with self._phase("start-up (model and optimizer build)", ("world",)):
            assembly = build_assembly(
                config, runtime, hf_init=hf_init, megatron_init=megatron_init, peft_init=peft_init
            )
        self.assembly = assembly
        if peft_init is not None:
            self.say(f"LoRA adapters start from the PEFT folder {peft_init}")
        for source, what in ((hf_init, "Hugging Face"), (megatron_init, "Megatron-Core")):
            if source is not None:
                self.say(f"imported the {what} checkpoint {source} at this layout")
        # Resume before anything is written: a bad checkpoint stops the run with the run
        # directory (config.toml, metrics) untouched.
        checkpointer = Checkpointer(config, runtime, assembly)
        with self._phase("start-up (checkpoint resume)", ("world",)):
            start_step = checkpointer.maybe_resume(say=self.say)
        self._say_if_nothing_left(start_step)
        train_set = _train_set_for(config, comps, groups, checkpointer)
        result = RunResult(final_step=start_step, run_dir=str(run_dir))
        writer = self._open_writer(run_dir, resumed=start_step > 0)
        result.bigram_nats = baseline = _baseline(comps, runtime)
        flops = _flops_per_token(assembly.model_config, config.data.seq_length)
        peak, peak_source = peak_tflops(runtime.device, override=config.logging.peak_tflops)
        if runtime.is_logging_rank:
            self._announce(assembly, flops, (peak, peak_source), baseline)
            if baseline is not None and writer is not None:
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
        scaler = getattr(assembly.optimizer, "loss_scaler", None)
        guard = NonFiniteGuard(config.reliability, scaler, self.say)
        window = MetricsWindow(
            flops_per_token=flops,
            world_size=runtime.world_size,
            peak_tflops=peak,
            device=runtime.device,
            loss_scaler=scaler,
        )
        stop = StopRequest(enabled=config.checkpoint.save_on_signal)
        evaluator = Evaluator.for_run(
            config,
            assembly,
            runtime,
            valid_set,
            num_microbatches=eval_micro,
            valid_losses=result.valid_losses,
            writer=writer,
            baseline=baseline,
            say=self.say,
        )
        checkpoints = CheckpointPolicy(config, checkpointer, assembly.modules, self._phase)
        parts = (assembly, train_set, result, writer, guard, window, stop, evaluator, checkpoints)
        return RunParts(*parts, data_offset=checkpointer.data_offset)

    def _open_writer(self, run_dir: Path, *, resumed: bool) -> MetricsWriter | None:
        """The metrics writer of this rank (logging rank, or every rank with
        ``logging.per_rank``), after writing the run's config.toml on the logging rank. A run
        that is not ``resumed`` (it starts at step 0) first sets an earlier run's logs in
        ``run_dir`` aside (:mod:`..observe.earlier_run`); a resumed one appends to its own."""
        config, runtime = self.config, self.runtime
        if not (runtime.is_logging_rank or config.logging.per_rank):
            return None
        run_dir.mkdir(parents=True, exist_ok=True)
        rank = None if runtime.is_logging_rank else runtime.rank
        logs = LOGGING_RANK_LOGS if rank is None else (metrics_path(run_dir, rank=rank).name,)
        moved = [] if resumed else set_aside(run_dir, logs)
        writer = MetricsWriter(
            run_dir, rank=rank, tensorboard=config.logging.tensorboard and rank is None
        )
        if runtime.is_logging_rank:
            (run_dir / "config.toml").write_text(config_to_toml(config))
            if moved:
                renamed = ", ".join(f"{old} -> {new}" for old, new in moved)
                self.say(
                    f"notice: logging.run_dir={str(run_dir)!r} held an earlier run's logs and "
                    f"this run starts at step 0, so they were set aside ({renamed}) instead of "
                    "mixed with this run's; a resumed run appends to its own"
                )
            if writer.notice is not None:
                self.say(f"notice: {writer.notice}")
        return writer

    def _announce(self, assembly, flops_per_token: float, peak, baseline) -> None:
        """The start-up lines: model size, layout, tokens, FLOPs per token and MFU basis
        (``peak``: ``(TFLOP/s or None, where it came from)``), bigram baseline."""
        config, runtime = self.config, self.runtime
        seq = config.data.seq_length
        peak, peak_source = peak
        tokens_total = _train_samples(config) * seq
        self.say(
            f"shardwork-train: {assembly.num_params / 1e6:.2f} M parameters, "
            f"{runtime.world_size} rank(s) {_layout_text(runtime.groups)} on {runtime.device.type}, "
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

    def _report_compile(self, p: RunParts, step: int, seconds: float) -> None:
        """Once, after the run's first step (which traced and compiled every layer kind): what
        torch.compile did on the logging rank, as lines and as a metrics event."""
        report = compile_report(since=p.assembly.compile_baseline)
        self.say(
            f"torch.compile: {p.assembly.compiled_layers} transformer layer(s) compiled; step "
            f"{step} took {seconds:.1f} s including compilation"
        )
        for line in report.lines():
            self.say(line)
        if p.writer is not None:
            breaks = sum(report.graph_breaks.values())
            values = {"first_step_s": seconds, "graphs": report.graphs, "graph_breaks": breaks}
            p.writer.write("compile", step, values)

    def _log_step(self, p: RunParts, step: int, plan: StepPlan, out) -> None:
        """The step's metrics: a ``train`` line every ``logging.interval`` steps and after the
        last one (the window's means), and the progress bar's update."""
        last = self.config.schedule.train_steps
        log_now = step % self.config.logging.interval == 0 or step == last
        values = p.window.values(plan, out, log_now=log_now)
        if log_now and p.writer is not None:
            p.writer.write("train", step, values)
        if self.progress is not None:
            self.progress.update(step, values, log_line=log_now)

    def _finish(self, p: RunParts, t_start: float) -> None:
        """Close the metrics, time the run, and on the logging rank plot and report."""
        if p.writer is not None:
            p.writer.close()
        p.result.seconds = time.perf_counter() - t_start
        if self.runtime.is_logging_rank:
            # empty_ok: a resumed run with no step left logged no train loss to plot
            plots = plot_run(p.result.run_dir, empty_ok=True) if self.config.logging.plot else []
            self._report(p.result, plots, p.writer)

    def _phase(self, phase: str, names: tuple[str, ...]):
        """A block whose lost peer or timeout is re-raised naming ``phase`` and ``names``."""
        return collective_phase(
            phase,
            self.runtime.groups,
            names,
            timeout_minutes=self.config.parallel.timeout_minutes,
        )

    def _report(self, result: RunResult, plots, writer) -> None:
        trained, start = result.final_step - result.start_step, result.start_step
        # a resumed run's steps are counted from the checkpoint's: say which ones this run took
        span = f" (resumed at step {start}, ended at step {result.final_step})" if start else ""
        lines = [f"done: {trained} steps{span} in {format_duration(result.seconds)}"]
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
        if result.peft_export:
            lines.append(f"peft export: {result.peft_export} (peft loads it onto hf_init)")
        for line in lines:
            print(line, file=self.stream, flush=True)


def _layout_text(groups) -> str:
    c = groups.config
    parts = [f"{n}={getattr(c, n)}" for n in ("tp", "pp", "cp", "ep", "dp") if getattr(c, n)]
    return "(" + " ".join(parts) + ")"


def _flops_per_token(model_config, seq_length: int) -> float:
    """Training FLOPs per token from shardwork.models' calculator."""
    return float(
        flops_per_token(model_config, seq_length, full_recompute=model_config.recompute == "full")
    )


def train(config: TrainConfig, *, stream=None) -> RunResult:
    """Run training for a resolved, validated config (see shardwork.trainer.config)."""
    # Allows TF32 for fp32 matmuls on GPUs that have it.
    torch.set_float32_matmul_precision("high")
    return Trainer(config, stream=stream).run()
