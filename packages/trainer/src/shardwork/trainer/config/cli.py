"""Command-line parsing of :class:`TrainConfig`: ``--config FILE.toml`` then ``--section.field`` overrides.

``--config`` (a TOML file) and ``--print-config`` are read first; the file's
values become the defaults that tyro shows and overrides, so
``--optimizer.lr 3e-4`` wins over the file, which wins over the built-in
defaults. Field names keep their underscores (``--schedule.train_steps``),
matching the TOML keys; booleans take a value (``--eval.at_end false``), and an optional
field takes ``none`` for None (``--eval.interval none``), the spelling TOML files use.

``--model.*`` flags are read here, not by tyro: the ``[model]`` table is a preset plus any
GPTConfig field at any depth (``--model.num_layers 2``, ``--model.moe.router.top_k 4``), so
each flag sets one key of that table, its value read as a TOML value (a number, ``true``,
``[1, 0]``; anything else is a string), and validation checks it like a key of the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any

import tyro

from shardwork.trainer.config.load import ConfigError, config_table, load_config, read_model_section
from shardwork.trainer.config.sections import TrainConfig

DESCRIPTION = (
    "Train a GPT with shardwork. With no arguments: a small byte-level GPT on Python's "
    "pydoc topics, on this CPU, in a few minutes. Extra flags: --config FILE.toml (values "
    "for every field below; flags override it) and --print-config (show the resolved "
    "configuration as TOML and exit). The model: --model.preset NAME, then any field of "
    "shardwork.models.GPTConfig as --model.FIELD VALUE (num_layers, hidden_size, "
    "num_attention_heads, num_query_groups, ffn_hidden_size, vocab_size, rope_theta, "
    "recompute, ...) and nested ones as --model.moe.FIELD, --model.moe.router.FIELD, "
    "--model.mla.FIELD, --model.mtp.FIELD (see docs/trainer.md, 'The model table'). "
    "Exit codes: 0 ok, 1 internal error (traceback), 2 usage or configuration error, 3 "
    "non-finite loss, 4 checkpoint error, 5 data error."
)

MODEL_FLAG = "--model."
SEED_HELP = "Seed of parameter init, data order and dropout (per-rank streams are derived from it)."


def _sections_without_model() -> type:
    """TrainConfig's fields except ``model``, as the dataclass tyro parses."""
    hints = typing.get_type_hints(TrainConfig)
    fields = []
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model":
            continue
        kind = hints[f.name]
        if not dataclasses.is_dataclass(kind):
            kind = Annotated[kind, tyro.conf.arg(help=SEED_HELP if f.name == "seed" else None)]
        fields.append((f.name, kind, dataclasses.field(default=None)))
    return dataclasses.make_dataclass("TrainFlags", fields, kw_only=True)


def optional_flags() -> set[str]:
    """``--section.field`` of every field of :class:`TrainConfig` that may be None."""
    flags = set()
    for section in dataclasses.fields(TrainConfig):
        hints = typing.get_type_hints(TrainConfig)[section.name]
        if not dataclasses.is_dataclass(hints):
            continue
        for name, annotation in typing.get_type_hints(hints).items():
            if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(
                None
            ) in typing.get_args(annotation):
                flags.add(f"--{section.name}.{name}")
    return flags


def _spell_none(args: list[str]) -> list[str]:
    """``none`` (any case) after the flag of an optional field becomes tyro's ``None``; a
    string field that is not optional keeps the text as given."""
    optional = optional_flags()
    out = list(args)
    for i in range(len(out)):
        if i and out[i].lower() == "none" and out[i - 1] in optional:
            out[i] = "None"
        elif out[i].startswith("--") and "=" in out[i]:
            flag, value = out[i].split("=", 1)
            if flag in optional and value.lower() == "none":
                out[i] = f"{flag}=None"
    return out


def flag_value(text: str) -> Any:
    """A flag's text as a TOML value (``4``, ``1e-3``, ``true``, ``[1, 0]``), else the text."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def split_model_flags(args: list[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """``([(dotted key under model, value), ...], the other arguments)``."""
    model, rest = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith(MODEL_FLAG):
            rest.append(arg)
            i += 1
            continue
        if "=" in arg:
            key, text = arg[len(MODEL_FLAG) :].split("=", 1)
            i += 1
        elif i + 1 < len(args):
            key, text = arg[len(MODEL_FLAG) :], args[i + 1]
            i += 2
        else:
            raise ConfigError([f"{arg}: needs a value (e.g. {arg} 4)"])
        model.append((key, flag_value(text)))
    return model, rest


def _with_model_flags(table: dict[str, Any], flags: list[tuple[str, Any]]) -> dict[str, Any]:
    """The ``[model]`` table with each ``(dotted key, value)`` flag set in it."""
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items()}
    for key, value in flags:
        *path, name = key.split(".")
        node = table
        for part in path:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[name] = value
    return table


def single_config_file(files: list[str]) -> str | None:
    """The one ``--config`` file of ``files`` (each ``--config`` given), or None. Several are
    refused: only one file is read, and argparse kept the last, silently dropping the others."""
    if len(files) > 1:
        raise ConfigError(
            [
                f"--config is given {len(files)} times ({', '.join(map(repr, files))}): one "
                "file is read, not a merge of several; valid: one --config FILE.toml, with the "
                "other files' values moved into it or given as flags (flags override the file)"
            ]
        )
    return files[0] if files else None


def parse_train_args(argv: Sequence[str]) -> tuple[TrainConfig, bool]:
    """``(config, print_config)`` from command-line arguments (raises ConfigError / SystemExit)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", action="append", default=[])
    pre.add_argument("--print-config", action="store_true")
    known, rest = pre.parse_known_args(list(argv))
    config_file = single_config_file(known.config)
    model_flags, rest = split_model_flags(rest)
    # TOML spells booleans true/false; accept that spelling on the command line too.
    rest = _spell_none([{"true": "True", "false": "False"}.get(a, a) for a in rest])
    base = load_config(config_file) if config_file else TrainConfig()
    flags_class = _sections_without_model()
    defaults = {f.name: getattr(base, f.name) for f in dataclasses.fields(flags_class)}
    parsed = tyro.cli(
        flags_class,
        default=flags_class(**defaults),
        args=rest,
        use_underscores=True,
        description=DESCRIPTION,
        prog="shardwork-train",
        config=(tyro.conf.FlagConversionOff,),
    )
    problems: list[str] = []
    notices: list[str] = []
    table = _with_model_flags(config_table(base)["model"], model_flags)
    model = read_model_section(table, problems, notices)
    if problems:
        raise ConfigError(problems)
    others = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(flags_class)}
    return TrainConfig(model=model, **others), known.print_config
