"""Whole-config validation and resolution, before any process group exists.

:func:`validate_config` checks every section and the relations between them
(batch sizes against data parallelism, heads against TP, layers against
pipeline stages, schedule lengths, data sources and the tokenizer: :mod:`.validate_data`, a
Hugging Face folder to start from: :mod:`.validate_hf`) for a given world size and
raises one :class:`ConfigError` listing every problem: each names the field,
its value and what would be valid.

:func:`resolve_config` returns a copy with every derived value filled in
(model dimensions from the preset or the demo model, padded vocabulary,
run and checkpoint directories), which is what ``--print-config`` shows. Before any check,
:func:`validate_config` expands a leading ``~`` in every path setting (:mod:`.paths`), so the
checks, the run and the config it stores all name the same files.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from shardwork.dist_checkpoint.faults import fault_env_problem
from shardwork.fused_kernels import environment_problems
from shardwork.models import GPTConfig
from shardwork.models.pipeline import layers_per_rank, standalone_last_stage_layers
from shardwork.parallel_state import ORDER_TOKENS, ParallelConfig
from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.config.model_settings import read_settings
from shardwork.trainer.config.paths import expand_home_paths
from shardwork.trainer.config.sections import DEMO_MODEL, ModelSection, TrainConfig
from shardwork.trainer.config.validate_data import check_data, check_tokenizer
from shardwork.trainer.config.validate_fsdp import check_fsdp
from shardwork.trainer.config.validate_hf import (
    check_hf_export,
    check_hf_init,
    check_hf_shapes,
    hf_dimensions,
)
from shardwork.trainer.config.validate_megatron import check_megatron_init
from shardwork.trainer.config.validate_peft import check_peft
from shardwork.trainer.data.tokenizer import load_tokenizer
from shardwork.trainer.model_factory import gpt_config, hf_config, preset_fields


def parallel_config(config: TrainConfig) -> ParallelConfig:
    p = config.parallel
    return ParallelConfig(tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep, etp=p.etp, order=p.order)


def _expert_tp(config: TrainConfig) -> int:
    p = config.parallel
    return p.tp if p.etp is None else p.etp


def _preset_dims(name: str) -> dict:
    """Architecture fields of a shardwork.models preset."""
    return preset_fields(name)


def check_model_settings(config: TrainConfig, problems: list[str]) -> TrainConfig:
    """``config`` with its ``[model]`` settings checked against GPTConfig's fields and converted
    to their types (a TOML list becomes a tuple where the field is one)."""
    settings = read_settings(GPTConfig, config.model.settings, "model", problems)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, settings=settings))


def resolve_config(config: TrainConfig) -> TrainConfig:
    """A copy with model dimensions, vocabulary and directories filled in (the dimensions the
    ``[model]`` table leaves unset are written in from the base, so ``--print-config`` and the
    checkpoint's stored config show them)."""
    model = config.model
    if config.checkpoint.hf_init is not None:
        base = hf_dimensions(hf_config(config.checkpoint.hf_init))
    elif model.preset:
        base = _preset_dims(model.preset)
    else:
        base = dict(DEMO_MODEL)
    settings = dict(model.settings)
    for name in DEMO_MODEL:
        if settings.get(name) is None and base.get(name) is not None:
            settings[name] = base[name]
    if settings.get("vocab_size") is None and config.checkpoint.hf_init is not None:
        settings["vocab_size"] = base["vocab_size"]
    elif settings.get("vocab_size") is None:
        tokenizer = load_tokenizer(config.data.tokenizer, eod_token=config.data.eod_token)
        settings["vocab_size"] = tokenizer.vocab_size
    run_dir = config.logging.run_dir or str(Path("runs") / config.logging.name)
    checkpoint_dir = config.checkpoint.dir or str(Path(run_dir) / "checkpoints")
    return dataclasses.replace(
        config,
        model=dataclasses.replace(model, settings=settings),
        logging=dataclasses.replace(config.logging, run_dir=run_dir),
        checkpoint=dataclasses.replace(config.checkpoint, dir=checkpoint_dir),
    )


def _positive(problems: list[str], where: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        valid = "an integer >= 1" + (' or "none"' if allow_none else "")
        problems.append(f"{where}={value!r}: must be {valid}")


def _order_problem(order: str) -> str | None:
    """Why ``parallel.order`` is not a permutation of every axis, or None.

    shardwork.parallel_state lets a size-1 axis be left out; the trainer asks for all five, so a
    misspelt or forgotten axis is never silently appended at the slowest-varying end."""
    tokens = order.split("-") if isinstance(order, str) else []
    if sorted(tokens) == sorted(ORDER_TOKENS):
        return None
    missing = [t for t in ORDER_TOKENS if t not in tokens]
    unknown = [t for t in tokens if t not in ORDER_TOKENS]
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    details = [
        f"{label} {names}"
        for label, names in (("missing", missing), ("unknown", unknown), ("repeated", repeated))
        if names
    ]
    return (
        f"parallel.order={order!r}: must name each axis of {', '.join(ORDER_TOKENS)} exactly "
        f"once, joined by '-', fastest-varying first (e.g. 'tp-cp-ep-dp-pp'); {'; '.join(details)}"
    )


def _check_parallel(config: TrainConfig, world_size: int, problems: list[str]) -> int:
    """Check the layout; return dp (1 if the layout is invalid)."""
    order_problem = _order_problem(config.parallel.order)
    if order_problem is not None:
        problems.append(order_problem)
        return 1
    try:
        resolved = parallel_config(config).resolve(world_size)
    except ValueError as exc:
        problems.append(f"parallel: {exc} (world size {world_size})")
        return 1
    p = config.parallel
    if p.sequence_parallel and p.tp == 1:
        problems.append("parallel.sequence_parallel=True needs parallel.tp > 1")
    if p.timeout_minutes <= 0:
        problems.append(f"parallel.timeout_minutes={p.timeout_minutes}: must be > 0")
    wants_cuda = p.backend == "nccl" or config.precision.device == "cuda"
    if wants_cuda and not torch.cuda.is_available():
        problems.append(
            f"parallel.backend={p.backend!r} / precision.device={config.precision.device!r}: "
            "no CUDA device here; use 'auto', 'gloo' and 'cpu'"
        )
    return resolved.dp


def _check_model(config: TrainConfig, problems: list[str]):
    """Build the GPTConfig and check it against the layout (shardwork.models does the
    checking); returns the GPTConfig, or None when it could not be built."""
    try:
        model = gpt_config(config)
    except (ValueError, TypeError) as exc:
        problems.append(f"model: {exc}")
        return None
    check_hf_shapes(config, model, problems)
    p = config.parallel
    if model.moe is None and (p.ep > 1 or (p.etp is not None and p.etp != p.tp)):
        problems.append(
            f"parallel.ep={p.ep} / parallel.etp={p.etp}: expert parallelism needs a model with "
            "experts, and this one is dense (no model.moe); valid: ep=1 and etp unset, or an "
            "MoE model (e.g. model.preset='tiny-mixtral-8x7b')"
        )
    if _order_problem(config.parallel.order) is not None:
        return model  # reported by _check_parallel
    try:
        model.check_layout(parallel_config(config), seq_length=config.data.seq_length)
    except ValueError as exc:
        problems.append(f"model/parallel: {exc}")
        return model

    p = config.parallel
    try:
        last = standalone_last_stage_layers(
            p.mtp_standalone,
            has_mtp=model.mtp is not None,
            pp=p.pp,
            vpp=p.vpp,
            last_stage_layers=p.last_stage_layers,
        )
    except ValueError as exc:
        problems.append(f"parallel.{exc}")
        return model
    try:
        layers_per_rank(
            model.num_layers,
            p.pp,
            vpp=p.vpp,
            first_stage_layers=p.first_stage_layers,
            last_stage_layers=last,
            first_virtual_stage_layers=p.first_virtual_stage_layers,
            last_virtual_stage_layers=p.last_virtual_stage_layers,
        )
    except ValueError as exc:
        problems.append(f"parallel (pipeline split of model.num_layers={model.num_layers}): {exc}")
    return model


def _check_quantile_balancing(config: TrainConfig, model, problems: list[str]) -> None:
    """Quantile balancing splits each micro-batch's tokens × top_k evenly over the experts, so
    that product must be a multiple of num_experts (each router sees the whole micro-batch:
    sequence shards are gathered over its token group)."""
    router = model.moe.router if model is not None and model.moe is not None else None
    if router is None or router.load_balancing_type != "quantile_balancing":
        return
    tokens = config.data.seq_length * config.schedule.micro_batch_size
    if (tokens * router.top_k) % router.num_experts:
        problems.append(
            f"model.moe.router.load_balancing_type='quantile_balancing' needs data.seq_length × "
            f"schedule.micro_batch_size × top_k = {config.data.seq_length} × "
            f"{config.schedule.micro_batch_size} × {router.top_k} to be a multiple of "
            f"num_experts={router.num_experts}"
        )


def _check_optimizer(config: TrainConfig, problems: list[str]) -> None:
    o = config.optimizer
    if not o.lr > 0:
        problems.append(f"optimizer.lr={o.lr}: must be > 0")
    if not 0 <= o.min_lr <= o.lr:
        problems.append(f"optimizer.min_lr={o.min_lr}: must be in [0, optimizer.lr={o.lr}]")
    if o.weight_decay < 0:
        problems.append(f"optimizer.weight_decay={o.weight_decay}: must be >= 0")
    if o.weight_decay_schedule != "constant" and o.weight_decay_end is None:
        problems.append(
            f"optimizer.weight_decay_schedule={o.weight_decay_schedule!r} needs "
            "optimizer.weight_decay_end (a number >= 0)"
        )
    if o.weight_decay_end is not None and o.weight_decay_end < 0:
        problems.append(f"optimizer.weight_decay_end={o.weight_decay_end}: must be >= 0")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            problems.append(f"optimizer.{name}={getattr(o, name)}: must be in [0, 1)")
    if not o.eps > 0:
        problems.append(f"optimizer.eps={o.eps}: must be > 0")
    if o.clip_grad < 0:
        problems.append(f"optimizer.clip_grad={o.clip_grad}: must be >= 0 (0 disables clipping)")
    if o.bucket_size_mb <= 0:
        problems.append(f"optimizer.bucket_size_mb={o.bucket_size_mb}: must be > 0")
    if o.name not in ("adamw", "muon"):
        problems.append(f"optimizer.name={o.name!r}: must be 'adamw' or 'muon'")
    if not o.muon_lr > 0:
        problems.append(f"optimizer.muon_lr={o.muon_lr}: must be > 0")
    if not 0 <= o.muon_momentum < 1:
        problems.append(f"optimizer.muon_momentum={o.muon_momentum}: must be in [0, 1)")
    if (
        isinstance(o.muon_ns_steps, bool)
        or not isinstance(o.muon_ns_steps, int)
        or (o.muon_ns_steps < 1)
    ):
        problems.append(f"optimizer.muon_ns_steps={o.muon_ns_steps!r}: must be an integer >= 1")


def _check_batch_size_ramp(config: TrainConfig, per_step: int, problems: list[str]) -> None:
    """Each ``schedule.batch_size_ramp`` entry: rising steps, and a size the step can split into
    micro-batches (``per_step`` = micro_batch_size × dp; with vpp, groups of pp of them)."""
    pp, vpp = config.parallel.pp, config.parallel.vpp or 1
    previous = -1
    for i, entry in enumerate(config.schedule.batch_size_ramp):
        step, size = entry
        where = f"schedule.batch_size_ramp[{i}]=({step}, {size})"
        if step <= previous or step < 0:
            problems.append(f"{where}: steps must be >= 0 and increasing")
        if size < 1 or size % per_step:
            problems.append(
                f"{where}: the size must be a positive multiple of micro_batch_size × dp = "
                f"{per_step}"
            )
        elif vpp > 1 and (size // per_step) % pp:
            problems.append(
                f"{where}: with parallel.vpp={vpp} the {size // per_step} micro-batches per step "
                f"must be a multiple of parallel.pp={pp} (the interleaved schedule runs them in "
                f"groups of pp): use a multiple of {per_step * pp}"
            )
        previous = step


def _check_schedule(config: TrainConfig, dp: int, problems: list[str]) -> None:
    s = config.schedule
    _positive(problems, "schedule.train_steps", s.train_steps)
    _positive(problems, "schedule.global_batch_size", s.global_batch_size)
    _positive(problems, "schedule.micro_batch_size", s.micro_batch_size)
    if any(p.startswith("schedule.") for p in problems):
        return
    per_step = s.micro_batch_size * dp
    if s.global_batch_size % per_step:
        problems.append(
            f"schedule.global_batch_size={s.global_batch_size}: must be a multiple of "
            f"micro_batch_size × dp = {s.micro_batch_size} × {dp} = {per_step}"
        )
    elif (config.parallel.vpp or 1) > 1 and (s.global_batch_size // per_step) % config.parallel.pp:
        # the interleaved schedule runs micro-batches in groups of pp (pipeline.plan)
        problems.append(
            f"schedule.global_batch_size={s.global_batch_size}: with parallel.vpp="
            f"{config.parallel.vpp} the {s.global_batch_size // per_step} micro-batches per step "
            f"must be a multiple of parallel.pp={config.parallel.pp} (the interleaved schedule "
            f"runs them in groups of pp): use a multiple of {per_step * config.parallel.pp}"
        )
    _check_batch_size_ramp(config, per_step, problems)
    if s.warmup_steps < 0 or s.warmup_steps > s.train_steps:
        problems.append(
            f"schedule.warmup_steps={s.warmup_steps}: must be in [0, train_steps={s.train_steps}]"
        )
    decay = s.lr_decay_steps if s.lr_decay_steps is not None else s.train_steps
    if s.lr_decay_steps is not None and s.lr_decay_steps <= s.warmup_steps:
        problems.append(
            f"schedule.lr_decay_steps={s.lr_decay_steps}: must exceed warmup_steps={s.warmup_steps}"
        )
    if s.wsd_decay_steps is not None and not 0 < s.wsd_decay_steps <= decay - s.warmup_steps:
        problems.append(
            f"schedule.wsd_decay_steps={s.wsd_decay_steps}: must be in "
            f"[1, lr_decay_steps - warmup_steps = {decay - s.warmup_steps}]"
        )
    pp, vpp = config.parallel.pp, config.parallel.vpp or 1
    if s.pipeline_schedule == "interleaved" and vpp == 1:
        problems.append(
            "schedule.pipeline_schedule='interleaved' needs parallel.vpp > 1 (virtual stages)"
        )
    if s.pipeline_schedule == "1f1b" and pp == 1:
        problems.append("schedule.pipeline_schedule='1f1b' needs parallel.pp > 1")
    if s.pipeline_schedule == "1f1b" and vpp > 1:
        # the schedule follows the layout: virtual stages always run interleaved 1F1B
        problems.append(
            f"schedule.pipeline_schedule='1f1b' with parallel.vpp={vpp}: virtual stages run the "
            "interleaved 1F1B schedule; set pipeline_schedule='interleaved' (or 'auto'), or "
            "parallel.vpp=none for plain 1F1B"
        )


def _check_rest(config: TrainConfig, problems: list[str]) -> None:
    c = config.checkpoint
    _positive(problems, "checkpoint.interval", c.interval, allow_none=True)
    _positive(problems, "checkpoint.keep_last", c.keep_last)
    _positive(problems, "checkpoint.keep_every", c.keep_every, allow_none=True)
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        problems.append(
            f"checkpoint.resume={c.resume!r}: must be 'auto', 'none' or an existing checkpoint path"
        )
    _positive(problems, "logging.interval", config.logging.interval)
    name = config.logging.name
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        problems.append(
            f"logging.name={name!r}: must be one folder name (not empty, no '/', not '.' or "
            "'..'): the run writes to runs/NAME unless logging.run_dir is set"
        )
    _positive(problems, "eval.interval", config.eval.interval, allow_none=True)
    _positive(problems, "eval.steps", config.eval.steps, allow_none=True)
    r = config.reliability
    _positive(problems, "reliability.max_consecutive_skips", r.max_consecutive_skips)
    _positive(
        problems,
        "reliability.check_dp_params_interval",
        r.check_dp_params_interval,
        allow_none=True,
    )
    if not isinstance(config.seed, int) or config.seed < 0:
        problems.append(f"seed={config.seed!r}: must be an integer >= 0")


def _non_finite_numbers(section, path: str = ""):
    """``(dotted field, value)`` of every nan / infinite float in ``section`` and the sections
    it holds (the ``[model]`` table's values are GPTConfig's, checked by the model)."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        where = f"{path}{field.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, ModelSection):
            yield from _non_finite_numbers(value, f"{where}.")
        elif isinstance(value, float) and not math.isfinite(value):
            yield where, value


def _check_numbers(config: TrainConfig, problems: list[str]) -> None:
    """Every float setting finite (a nan passes ``<`` / ``>`` checks and fails mid-run), and
    the positive ones positive."""
    for where, value in _non_finite_numbers(config):
        problems.append(f"{where}={value}: must be a finite number")
    if not config.precision.initial_loss_scale > 0:
        problems.append(
            f"precision.initial_loss_scale={config.precision.initial_loss_scale}: must be > 0"
        )
    peak = config.logging.peak_tflops
    if peak is not None and not peak > 0:
        problems.append(
            f'logging.peak_tflops={peak}: must be > 0 (one device\'s peak TFLOP/s) or "none" '
            "(the known GPU table, or a measured matmul rate on CPU)"
        )


def check_environment(problems: list[str]) -> None:
    """The shardwork environment variables the run would read mid-step or at its first save
    (kernel backend, CPU product library, checkpoint fault injection), checked up front;
    ``shardwork-generate`` runs the same check before it loads a checkpoint."""
    found = [*environment_problems(), fault_env_problem()]
    problems.extend(f"environment: {problem}" for problem in found if problem is not None)


def validate_config(config: TrainConfig, *, world_size: int) -> TrainConfig:
    """Resolve and check ``config`` for ``world_size`` ranks; return the resolved config.

    Raises :class:`ConfigError` listing every problem. Creates no process group. A leading
    ``~`` in a path setting is expanded first (:mod:`.paths`), so every check and every user of
    the returned config reads the same path.
    """
    problems: list[str] = []
    config = expand_home_paths(config, problems)
    path_problems = len(problems)
    config = check_model_settings(config, problems)
    settings_ok = len(problems) == path_problems
    check_data(config, problems)
    tokenizer_ok = not any(p.startswith("data.tokenizer") for p in problems)
    if tokenizer_ok:
        tokenizer_ok = check_tokenizer(config, problems)
    preset_ok = True
    if config.model.preset is not None:
        try:
            _preset_dims(config.model.preset)
        except ValueError as exc:
            problems.append(f"model.preset={config.model.preset!r}: {exc}")
            preset_ok = False
    hf_ok = check_hf_init(config, problems)
    model_ok = settings_ok and tokenizer_ok and preset_ok and hf_ok
    resolved = resolve_config(config) if model_ok else config
    dp = _check_parallel(resolved, world_size, problems)
    model = _check_model(resolved, problems) if model_ok else None
    check_hf_export(resolved, problems, model=model)
    check_megatron_init(resolved, problems, model=model)
    _check_optimizer(resolved, problems)
    _check_schedule(resolved, dp, problems)
    _check_quantile_balancing(resolved, model, problems)
    _check_rest(resolved, problems)
    _check_numbers(resolved, problems)
    check_peft(resolved, model, _expert_tp(resolved), problems)
    check_fsdp(resolved, world_size, problems)
    check_environment(problems)
    if problems:
        raise ConfigError(problems)
    return resolved
