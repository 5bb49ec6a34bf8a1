"""Messages for a checkpoint that cannot be resumed, each with the command-line remedy.

- `mismatch_message`: the checkpoint's tensors have other shapes than this run's model (a
  model of another width, depth or vocabulary). The load error lists every key; a person
  needs the count, the first few shapes ("checkpoint has X, this run has Y") and which
  ``model.*`` settings differ between the checkpoint's saved config and this run — those
  are what to pass on the command line to resume it; a checkpoint of another
  ``optimizer.name`` (Muon's momentum buffers, AdamW's moments) is named with
  ``--checkpoint.load_optimizer false``, which keeps its weights with a fresh optimizer.
- `corrupt_message`: a file of the checkpoint does not match its recorded checksum and the
  run may not fall back (an explicit ``checkpoint.resume`` path, or
  ``checkpoint.fallback = false``).
"""

from __future__ import annotations

import tomllib
from typing import Any

from shardwork.dist_checkpoint import CheckpointCorruptError, CheckpointMismatchError
from shardwork.trainer.config.model_table import convert_overrides, flatten_settings

#: differing model settings named in a message; the rest are counted
_SHOWN = 3


def _model_table(toml_text: str | None) -> dict[str, Any]:
    """The ``[model]`` settings of a stored config as ``{"moe.router.top_k": 4, ...}``; a
    config in the format before composed configs is converted first, so both compare alike."""
    if not toml_text:
        return {}
    table = tomllib.loads(toml_text).get("model", {})
    return flatten_settings(convert_overrides(table, notices=[], problems=[]))


def model_differences(saved_toml: str | None, run_toml: str) -> list[tuple[str, Any, Any]]:
    """``(field, checkpoint's value, this run's value)`` for each ``model.*`` setting that
    differs between the checkpoint's saved config and this run's (both resolved TOML)."""
    saved, ours = _model_table(saved_toml), _model_table(run_toml)
    if not saved:  # not written by shardwork-train: nothing to compare with
        return []
    return [
        (name, saved.get(name), ours.get(name))
        for name in sorted(set(saved) | set(ours))
        if saved.get(name) != ours.get(name)
    ]


def optimizer_name_of(config_toml: str | None) -> str | None:
    """The ``optimizer.name`` of a resolved config's TOML (a checkpoint's saved config or this
    run's), the default "adamw" where it leaves the name out; None for no config (a checkpoint
    not written by shardwork-train)."""
    if not config_toml:
        return None
    return tomllib.loads(config_toml).get("optimizer", {}).get("name", "adamw")


def optimizer_change(saved_toml: str | None, run_toml: str) -> tuple[str, str] | None:
    """``(checkpoint's optimizer.name, this run's)`` when they differ; None when they agree or
    the checkpoint holds no shardwork-train config."""
    saved = optimizer_name_of(saved_toml)
    ours = optimizer_name_of(run_toml)
    return None if saved is None or saved == ours else (saved, ours)


def optimizer_change_advice(saved: str, ours: str) -> str:
    """What to do about a checkpoint trained with ``optimizer.name = saved`` in a run of
    ``ours``, whose optimizer state the run cannot load."""
    return (
        f"the checkpoint was trained with optimizer.name={saved!r} (this run: {ours!r}), whose "
        "state this run's optimizer cannot load: to keep its weights and start a fresh "
        "optimizer, pass --checkpoint.load_optimizer false."
    )


#: the settings that decide which samples the training set holds in which order
#: (data/builder.py, data/gpt_dataset.py), in the order a warning names them. Its size
#: (train_steps x batch sizes) is not one: a longer set starts with a shorter one's samples, and
#: a resume reads on from the checkpoint's consumed samples.
DATA_ORDER_FIELDS = (
    ("seed",),
    ("data", "seq_length"),
    ("data", "corpus"),
    ("data", "prefixes"),
    ("data", "weights"),
    ("data", "data_config"),
    ("data", "split"),
    ("data", "shuffle"),
)

#: the settings that size the training set: they decide its order too in the "whole" sample
#: order of checkpoints written before the "blocks" order
SIZE_FIELDS = (
    ("schedule", "train_steps"),
    ("schedule", "global_batch_size"),
    ("schedule", "batch_size_ramp"),
)


def _setting(table: dict[str, Any], path: tuple[str, ...]) -> Any:
    """The value at ``path`` (section, key) of a parsed config; None where it is absent."""
    for key in path:
        table = table.get(key, {}) if isinstance(table, dict) else {}
    return table if table != {} else None


def data_order_differences(
    saved_toml: str | None, run_toml: str, *, whole_order: bool = False
) -> list[tuple[str, Any, Any]]:
    """``(field, checkpoint's value, this run's value)`` for each setting of
    :data:`DATA_ORDER_FIELDS` (and, in the ``whole_order`` of an older checkpoint, of
    :data:`SIZE_FIELDS`) that differs between a checkpoint's saved config and this run's (one
    the saved config lacks is skipped). ``seed`` and the size are left out when neither run
    shuffles: they draw nothing else of the data."""
    if not saved_toml:
        return []
    saved, ours = tomllib.loads(saved_toml), tomllib.loads(run_toml)
    shuffled = (
        _setting(saved, ("data", "shuffle")) is not False
        or _setting(ours, ("data", "shuffle")) is not False
    )
    fields = DATA_ORDER_FIELDS + (SIZE_FIELDS if whole_order and shuffled else ())
    out = []
    for path in fields:
        if path == ("seed",) and not shuffled:
            continue
        theirs, mine = _setting(saved, path), _setting(ours, path)
        # A setting the stored config lacks (an older version's) is not known to differ.
        if theirs is not None and theirs != mine:
            out.append((".".join(path), theirs, mine))
    return out


def data_order_warning(step: int, differences: list[tuple[str, Any, Any]]) -> str:
    """The warning for a resume at ``step`` whose data settings ``differences`` (from
    :func:`data_order_differences`) changed the training set's sample order."""
    changed = ", ".join(
        f"{name}={_cli_value(theirs)} (this run: {_cli_value(mine)})"
        for name, theirs, mine in differences
    )
    return (
        f"warning: resuming at step {step} with other data settings than the checkpoint's run: "
        f"{changed}. The training set's samples and their order are a function of these, so "
        "from here the run reads another order than the checkpoint's run would have: samples it already trained on can come again and others "
        "are never read. To keep its order, resume with the checkpoint's values."
    )


def _cli_value(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def mismatch_message(exc: CheckpointMismatchError, *, saved_toml: str | None, run_toml: str) -> str:
    """One paragraph: the load's findings, summarised, and the options that resume it."""
    lines = [exc.summary("this run")]
    diffs = model_differences(saved_toml, run_toml)
    if diffs:
        shown = ", ".join(f"model.{n}={s!r} (this run: {o!r})" for n, s, o in diffs[:_SHOWN])
        more = f" and {len(diffs) - _SHOWN} more" if len(diffs) > _SHOWN else ""
        flags = " ".join(f"--model.{n} {_cli_value(s)}" for n, s, _ in diffs if s is not None)
        lines.append(f"the checkpoint was trained with {shown}{more}.")
        if flags:
            lines.append(f"To resume it, run with the checkpoint's model: {flags}.")
    changed = optimizer_change(saved_toml, run_toml)
    if changed:
        lines.append(optimizer_change_advice(*changed))
    lines.append(
        "To train this model from scratch instead, pass a new --checkpoint.dir (--checkpoint.resume "
        "none also starts afresh, but keeps these checkpoints beside the new ones, where a later "
        "resume 'auto' may pick them)."
    )
    return "\n".join(lines)


def corrupt_message(exc: CheckpointCorruptError, *, why: str) -> CheckpointCorruptError:
    """``exc`` again, its message one paragraph: what is corrupt, why the run did not fall
    back, and what to do (the type stays, so callers and the CLI's exit code see the same)."""
    message = (
        f"{exc}. {why}. Check every file with `shardwork-ckpt verify {exc.checkpoint}`; "
        "resume from an earlier checkpoint with --checkpoint.resume PATH, or let "
        "checkpoint.resume=auto fall back to the newest intact one with "
        "--checkpoint.fallback True."
    )
    return CheckpointCorruptError(message, checkpoint=exc.checkpoint, files=exc.files)
