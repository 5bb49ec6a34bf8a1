"""A leading ``~`` in the config's path settings, expanded once, when the config is validated.

A TOML file is read by no shell, so ``checkpoint.dir = "~/runs/x"`` arrives with its ``~``.
:func:`expand_home_paths` turns it into the home directory's path (``os.path.expanduser``:
``~`` and ``~/...`` from ``$HOME``, ``~USER/...`` from that user's entry) in every field of
:data:`PATH_FIELDS`, so that validation, preflight, the trainer, its checkpoints, the
``config.toml`` it writes and ``shardwork-generate`` reading a stored config all name the same
directory (without it the trainer wrote to ``./~/runs/x`` while preflight checked
``$HOME/runs/x``). Only a value that starts with ``~`` changes: the keywords of these fields
(``"auto"``, ``"none"``, ``"byte"``) never do, and other fields (``data.corpus``,
``model.preset``, ``logging.name``) are names, not paths.
"""

from __future__ import annotations

import dataclasses
import os

from shardwork.trainer.config.sections import TrainConfig

PATH_FIELDS: dict[str, tuple[str, ...]] = {
    "data": ("prefixes", "data_config", "cache_dir", "tokenizer"),
    "checkpoint": ("dir", "resume", "hf_init", "megatron_init", "hf_export"),
    "logging": ("run_dir",),
    "peft": ("init", "export"),
}
"""Every path-valued setting, by section; ``data.prefixes`` is a list of paths."""


def _expanded(where: str, value: str, problems: list[str]) -> str:
    """``value`` with a leading ``~`` expanded; a problem when it cannot be (no such user, or
    no home directory), since the run would otherwise write to a literal ``./~...`` folder."""
    if not value.startswith("~"):
        return value
    path = os.path.expanduser(value)
    if path.startswith("~"):
        user = value[1:].split("/", 1)[0]
        cause = f"there is no user {user!r}" if user else "there is no home directory ($HOME)"
        problems.append(
            f"{where}={value!r}: cannot expand its leading '~' ({cause}); valid: a path starting "
            "with '~/' (your home directory), '~USER/' of an existing user, or without '~'"
        )
    return path


def expand_home_paths(config: TrainConfig, problems: list[str]) -> TrainConfig:
    """A copy of ``config`` with a leading ``~`` expanded in each field of :data:`PATH_FIELDS`;
    a value that cannot be expanded stays as given and adds a line to ``problems``."""
    sections = {}
    for name, fields in PATH_FIELDS.items():
        section = getattr(config, name)
        changes = {}
        for field in fields:
            value, where = getattr(section, field), f"{name}.{field}"
            if isinstance(value, str):
                changes[field] = _expanded(where, value, problems)
            elif isinstance(value, list):
                changes[field] = [
                    _expanded(f"{where}[{i}]", v, problems) if isinstance(v, str) else v
                    for i, v in enumerate(value)
                ]
        sections[name] = dataclasses.replace(section, **changes)
    return dataclasses.replace(config, **sections)
