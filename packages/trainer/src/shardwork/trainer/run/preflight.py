"""Checks of a validated config against the machine, before any process group or model exists.

:func:`validate_config` checks values; preflight checks what they point at, so that a mistake
stops the run before step 1 instead of at the first checkpoint or inside a step:

- ``logging.run_dir``, ``checkpoint.dir`` (and ``checkpoint.hf_export``; ``data.cache_dir``
  when the built-in corpus is still to be built there) are writable directories or can be
  created as such; probed with a temporary file in the directory (or its
  nearest existing ancestor) that is removed at once, so nothing is created that a later run
  would read as a run or a checkpoint.
- Free space under ``checkpoint.dir`` against the expected size of the checkpoints kept
  (parameters × bytes per parameter including optimizer state): a warning, not an error.
- Every dataset the run reads (``data.prefixes``, ``data.data_config``'s blends, the built-in
  corpus): both files exist, the ``.idx`` parses and agrees with itself and with the ``.bin``'s
  size, and every token id is below ``model.vocab_size`` (:mod:`..data.integrity`).
- The train and validation splits hold at least 2 tokens in each dataset (an input and its
  label); ``eval.steps`` fits in the validation split (counted in global batches). (A split
  with no sample at all while ``eval.steps`` is unset is a start-up warning of the trainer's,
  :func:`no_validation_sample_warning`: a data config's "valid" blend is optional.)
- ``precision.compile``: torch.compile can run on the run's device here (dynamo in this
  build; a C++ compiler for inductor on a CPU, Triton on a GPU), else the step would fail
  minutes into its first compilation.
- The checkpoint a resume would load first (the newest complete one under ``checkpoint.dir``
  for ``"auto"``, or the one ``checkpoint.resume`` names) was not trained with another
  ``optimizer.name`` while ``checkpoint.load_optimizer`` is on: read from its
  ``shardwork.json``; a checkpoint whose metadata cannot be read is left to the load, which
  verifies it.

Mistakes raise :class:`ConfigError` (exit 2), :class:`DataError` (exit 5) or
:class:`CheckpointError` (exit 4); each rank of a
torchrun job runs the same checks, so all stop alike before the process groups are created.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from shardwork.dist_checkpoint import CheckpointCorruptError, read_info
from shardwork.models.block_compile import compile_problem
from shardwork.models.calculator import num_parameters
from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.data.builder import (
    Component,
    build_eval_set,
    read_data_config,
    split_components,
)
from shardwork.trainer.data.corpus import builtin_corpus, corpus_prefix, default_cache_dir
from shardwork.trainer.data.indexed import IndexedDataset, dataset_exists
from shardwork.trainer.data.integrity import check_index, check_token_range
from shardwork.trainer.errors import CheckpointError, DataError
from shardwork.trainer.model_factory import gpt_config
from shardwork.trainer.run.checkpoint_choice import resume_candidates
from shardwork.trainer.run.resume_advice import optimizer_change_advice, optimizer_name_of

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


def preflight(config: TrainConfig) -> list[str]:
    """Run every check on a resolved, validated ``config``; return warnings (one line each).

    Raises ConfigError for an unusable directory or ``eval.steps``, DataError for a dataset.
    """
    problems = [
        problem
        for field, path in _output_dirs(config)
        if (problem := writable_dir_problem(field, path)) is not None
    ]
    if config.precision.compile:
        problem = compile_problem(run_device_type(config), config=gpt_config(config))
        if problem is not None:
            problems.append(f"precision.compile=true: {problem}; or set precision.compile = false")
    if problems:
        raise ConfigError(problems)
    check_resume_optimizer(config)
    found = [free_space_warning(config), earlier_checkpoints_warning(config)]
    warnings = [w for w in found if w is not None]
    for field, prefix in dataset_prefixes(config):
        check_dataset(field, prefix, vocab_size=config.model.settings["vocab_size"])
    splits = split_components(config.data)  # opens every dataset's index: once, for all three
    check_train_split(config, splits["train"])
    check_split_tokens(splits)
    check_eval_steps(config, splits["valid"])
    return warnings


def run_device_type(config: TrainConfig) -> str:
    """``"cuda"`` or ``"cpu"``: where the run will train (``precision.device``, auto resolved)."""
    want = config.precision.device
    return "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"


def _output_dirs(config: TrainConfig) -> list[tuple[str, str]]:
    """``(field, path)`` of every directory the run will write into."""
    dirs = [("logging.run_dir", config.logging.run_dir), ("checkpoint.dir", config.checkpoint.dir)]
    if config.checkpoint.hf_export is not None:
        dirs.append(("checkpoint.hf_export", config.checkpoint.hf_export))
    d = config.data
    if not d.prefixes and d.data_config is None:  # the built-in corpus, built on first use
        cache = d.cache_dir or str(default_cache_dir())
        # data.cache_dir unset: the environment variable chose the folder, and is what to fix
        env = d.cache_dir is None and "SHARDWORK_CACHE" in os.environ
        field = "SHARDWORK_CACHE (environment)" if env else "data.cache_dir"
        if not dataset_exists(corpus_prefix(d.corpus, cache)):
            dirs.append((field, cache))
    return dirs


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def writable_dir_problem(field: str, path: str) -> str | None:
    """Why ``path`` cannot be (or become) a writable directory, or None when it can."""
    target = Path(path).expanduser()
    base = _nearest_existing(target)
    valid = "valid: a writable directory, or a path where one can be created"
    if not base.is_dir():
        where = "is a file" if base == target else f"would be created under {base}, a file"
        return f"{field}={path!r}: {where}, not a directory; {valid}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardwork-write-probe-", dir=base)
    except OSError as exc:
        where = "" if base == target else f" (it would be created in {base})"
        return f"{field}={path!r}: cannot write there{where}: {exc.strerror}; {valid}"
    os.close(fd)
    os.unlink(probe)
    return None


def checkpoint_bytes(config: TrainConfig) -> int:
    """Estimated bytes of one checkpoint: per parameter its value in the run's dtype, an fp32
    master copy (fp64 with dtype fp64) and two optimizer moments (AdamW; Muon's one momentum
    is less). Fixed costs (metadata, RNG states) are left out: they matter only for tiny models."""
    dtype = config.precision.dtype
    state = 8 if dtype == "fp64" else 4
    return num_parameters(gpt_config(config)) * (_DTYPE_BYTES[dtype] + 3 * state)


def free_space_warning(config: TrainConfig) -> str | None:
    """A warning when the file system of ``checkpoint.dir`` has less free space than the
    ``keep_last`` checkpoints plus the one being written need, else None."""
    c = config.checkpoint
    if not (c.save_at_end or c.save_on_signal or c.interval is not None):
        return None
    base = _nearest_existing(Path(c.dir).expanduser())
    per_checkpoint = checkpoint_bytes(config)
    needed = per_checkpoint * (c.keep_last + 1)
    free = shutil.disk_usage(base).free
    if free >= needed:
        return None
    gib = 2**30
    return (
        f"warning: checkpoint.dir={c.dir!r}: {free / gib:.2f} GiB free on its file system, but "
        f"checkpoint.keep_last={c.keep_last} checkpoints plus the one being written need about "
        f"{needed / gib:.2f} GiB ({per_checkpoint / gib:.2f} GiB each); saving may fail"
    )


def earlier_checkpoints_warning(config: TrainConfig) -> str | None:
    """A warning when ``checkpoint.resume = "none"`` starts a run in a ``checkpoint.dir`` that
    already holds complete checkpoints: this run's join them, retention counts both, and a
    later ``resume = "auto"`` takes the newest step of either run (another model's, perhaps)."""
    c = config.checkpoint
    root = Path(c.dir).expanduser()
    if c.resume != "none" or not root.is_dir():
        return None
    found = resume_candidates("auto", root)  # what a later resume="auto" would choose from
    if found.newest is None:
        return None
    return (
        f"warning: checkpoint.dir={c.dir!r} already holds {len(found.steps)} checkpoint(s) "
        f"(newest {found.newest.name}) and checkpoint.resume='none' starts afresh: this run's "
        "checkpoints join them, checkpoint.keep_last counts both, and a later resume='auto' "
        "takes the newest of either run; use a new checkpoint.dir to keep them apart"
    )


def resume_candidate(config: TrainConfig) -> Path | None:
    """The checkpoint ``checkpoint.resume`` loads first (:mod:`.checkpoint_choice`): the newest
    complete ``step_*`` under ``checkpoint.dir`` (``"auto"``), the named one, or a named root's
    newest; None for ``"none"`` or where there is none (the run starts afresh, or resuming says
    why). Paths are read with ``~`` expanded, as preflight's other checks read them."""
    c = config.checkpoint
    resume = c.resume if c.resume in ("none", "auto") else str(Path(c.resume).expanduser())
    candidates = resume_candidates(resume, Path(c.dir).expanduser())
    return None if candidates is None else candidates.newest


def check_resume_optimizer(config: TrainConfig) -> None:
    """CheckpointError when the checkpoint to resume was trained with another
    ``optimizer.name`` and ``checkpoint.load_optimizer`` is on: its state cannot be loaded."""
    if not config.checkpoint.load_optimizer:
        return
    path = resume_candidate(config)
    if path is None:
        return
    try:
        info = read_info(path)
        saved = optimizer_name_of((info.get("user_metadata") or {}).get("train_config"))
    except (OSError, ValueError, AttributeError, CheckpointCorruptError):
        return  # unreadable metadata: the load verifies the checkpoint and says why
    if saved is not None and saved != config.optimizer.name:
        advice = optimizer_change_advice(saved, config.optimizer.name)
        raise CheckpointError(f"cannot resume {str(path)!r}: {advice}")


def dataset_prefixes(config: TrainConfig) -> list[tuple[str, str]]:
    """``(config field, prefix)`` of every dataset the run reads (each prefix once)."""
    d = config.data
    if d.data_config is not None:
        pairs = [
            (f"data.data_config[{split!r}][{i}]", prefix)
            for split, blend in read_data_config(d.data_config).items()
            for i, (_, prefix) in enumerate(blend)
        ]
    elif d.prefixes:
        pairs = [(f"data.prefixes[{i}]", prefix) for i, prefix in enumerate(d.prefixes)]
    else:
        pairs = [("data.corpus", builtin_corpus(d.corpus, d.cache_dir or default_cache_dir()))]
    seen: set[str] = set()
    return [(f, p) for f, p in pairs if not (p in seen or seen.add(p))]


def check_dataset(field: str, prefix: str, *, vocab_size: int) -> None:
    """Open ``prefix`` (header and sizes), check its index and its token ids; DataError names
    ``field`` and the file."""
    try:
        ds = IndexedDataset(prefix)
        check_index(ds)
    except DataError as exc:
        raise DataError(f"{field}={prefix!r}: {exc}") from None
    check_token_range(ds, vocab_size, field=f"{field}={prefix!r}")


def check_train_split(config: TrainConfig, components: list[Component]) -> None:
    """Refuse a run whose ``train`` split (its ``components``) has no documents, or only ones
    of weight 0 (an empty dataset, a data config whose train blend weighs nothing): nothing to
    sample from."""
    if any(c.weight > 0 and c.documents.size for c in components):
        return
    d = config.data
    source = (
        f"the 'train' blend of data.data_config={d.data_config!r}"
        if d.data_config is not None
        else f"data.prefixes={list(d.prefixes)} with data.split={d.split!r}"
    )
    held = ", ".join(
        f"{c.prefix!r}: {c.documents.size} docs, weight {c.weight:g}" for c in components
    )
    raise DataError(
        f"{source} gives the train split no documents to sample ({held or 'no datasets'}); "
        "valid: at least one dataset with documents and a weight > 0"
    )


def check_split_tokens(splits: dict[str, list[Component]]) -> None:
    """Refuse a dataset whose part of the train or validation split (of ``splits``, as
    `split_components` gives them) holds fewer than 2 tokens
    (documents that are all empty): the run builds samples from every such part, and a sample
    needs an input token and its label. Without this the run fails after its process groups
    exist (the test split is not read by training, so it is not checked)."""
    for split in ("train", "valid"):
        for c in splits[split]:
            tokens = int(IndexedDataset(c.prefix).sequence_lengths[c.documents].sum())
            if tokens < 2:
                raise DataError(
                    f"dataset {c.prefix!r}: its {split!r} split ({c.documents.size} documents) "
                    f"holds {tokens} tokens; valid: at least 2 (an input token and its label). "
                    "Are its documents empty? (shardwork-preprocess --append_eod false keeps an "
                    "empty document empty)"
                )


def check_eval_steps(config: TrainConfig, valid_split: list[Component] | None = None) -> None:
    """Refuse ``eval.steps`` above the global batches the validation split holds (its
    components ``valid_split``; None: read from ``config``)."""
    steps, e = config.eval.steps, config.eval
    if steps is None or (e.interval is None and not e.at_end):
        return
    s = config.schedule
    if valid_split is None:
        valid_split = split_components(config.data)["valid"]
    valid = build_eval_set(valid_split, seq_length=config.data.seq_length, num_samples=None)
    samples = 0 if valid is None else len(valid)
    # A split smaller than one global batch still gives one (the trainer repeats its samples).
    batches = max(1, samples // s.global_batch_size) if samples else 0
    if steps <= batches:
        return
    held = (
        f"the validation split holds {samples} samples of data.seq_length={config.data.seq_length}"
        f" tokens = {batches} global batches of schedule.global_batch_size={s.global_batch_size}"
    )
    source = (
        f'give the "valid" blend of data.data_config={config.data.data_config!r} datasets'
        if config.data.data_config is not None
        else "give data.split a larger validation part"
    )
    valid_range = (
        f"valid: 1..{batches}, or 'none' for the whole split"
        if batches
        else f"{source}, or set eval.interval='none' and eval.at_end=false"
    )
    raise ConfigError([f"eval.steps={steps}: {held}; {valid_range}"])


def no_validation_sample_warning(config: TrainConfig, valid_split: list[Component]) -> str:
    """The start-up warning of a run that evaluates (``eval.interval`` or ``eval.at_end``) but
    whose validation split (components ``valid_split``) gives no sample: every evaluation is
    skipped, which used to happen without a word (a data config without a "valid" blend, too
    few documents for ``data.split`` to give the split one, documents shorter than a sample)."""
    d, e = config.data, config.eval
    docs = sum(c.documents.size for c in valid_split)
    tokens = sum(
        int(IndexedDataset(c.prefix).sequence_lengths[c.documents].sum()) for c in valid_split
    )
    if d.data_config is not None:
        source = f'the "valid" blend of data.data_config={d.data_config!r}'
        remedy = f"give {source} datasets holding at least {d.seq_length + 1} tokens"
    else:
        source = f"data.prefixes={list(d.prefixes)}" if d.prefixes else f"data.corpus={d.corpus!r}"
        source += f" with data.split={d.split!r}"
        remedy = "give data.split a larger validation part (or the datasets more documents)"
    on = "none" if e.interval is None else e.interval
    return (
        f"warning: evaluation is on (eval.interval={on}, eval.at_end={str(e.at_end).lower()}) "
        f"but {source} gives the validation split {docs} documents, {tokens} tokens: no sample "
        f"of data.seq_length={d.seq_length} tokens (one needs {d.seq_length + 1}), so every "
        f"evaluation is skipped. To evaluate, {remedy}; to turn evaluation off (and this "
        "warning), set eval.interval='none' and eval.at_end=false"
    )
