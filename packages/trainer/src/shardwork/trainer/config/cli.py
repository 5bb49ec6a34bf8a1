"""Command-line parsing of :class:`TrainConfig`: ``--config FILE.toml`` then ``--section.field`` overrides.

``--config`` (a TOML file) and ``--print-config`` are read first; the file's
values become the defaults that tyro shows and overrides, so
``--optimizer.lr 3e-4`` wins over the file, which wins over the built-in
defaults. Field names keep their underscores (``--schedule.train_steps``),
matching the TOML keys; booleans take a value (``--eval.at_end false``), and an optional
field takes ``none`` for None (``--eval.interval none``), the spelling TOML files use.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence

import tyro

from shardwork.trainer.config.load import load_config
from shardwork.trainer.config.sections import TrainConfig

DESCRIPTION = (
    "Train a GPT with shardwork. With no arguments: a small byte-level GPT on Python's "
    "pydoc topics, on this CPU, in a few minutes. Extra flags: --config FILE.toml (values "
    "for every field below; flags override it) and --print-config (show the resolved "
    "configuration as TOML and exit). Exit codes: 0 ok, 1 internal error (traceback), 2 usage "
    "or configuration error, 3 non-finite loss, 4 checkpoint error, 5 data error."
)


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


def parse_train_args(argv: Sequence[str]) -> tuple[TrainConfig, bool]:
    """``(config, print_config)`` from command-line arguments (raises ConfigError / SystemExit)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    known, rest = pre.parse_known_args(list(argv))
    # TOML spells booleans true/false; accept that spelling on the command line too.
    rest = _spell_none([{"true": "True", "false": "False"}.get(a, a) for a in rest])
    base = load_config(known.config) if known.config else TrainConfig()
    config = tyro.cli(
        TrainConfig,
        default=base,
        args=rest,
        use_underscores=True,
        description=DESCRIPTION,
        prog="shardwork-train",
        config=(tyro.conf.FlagConversionOff,),
    )
    return config, known.print_config
