"""``shardwork-ckpt import-megatron SRC DST --preset NAME [--set FIELD=VALUE ...]``.

Registered in shardwork-models' pyproject under the entry-point group
``shardwork_ckpt.commands``: dist-checkpoint's CLI finds it without importing models (its
dependency rule). The architecture comes from the user: a preset (``tiny-llama3-8b``,
``llama3-8b``, ...) and GPTConfig field changes, nested ones with dots
(``--set moe.router.num_experts=4``); values are JSON (``4``, ``1e-6``, ``true``) or else
strings. Every mistake (unknown preset or field, not a Megatron checkpoint, a key or shape that
does not fit) is one ``shardwork-ckpt:`` line and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.megatron.convert import import_megatron
from shardwork.models.presets import preset

__all__ = ["config_with_changes", "register"]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_sets(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set vocab_size=32000")
        out[name] = _value(value)
    return out


def _replace(obj: Any, changes: dict[str, Any], where: str) -> Any:
    """``obj`` (a config dataclass) with dotted ``changes`` applied, nested ones recursively."""
    fields = {f.name for f in dataclasses.fields(obj)}
    flat, nested = {}, {}
    for name, value in changes.items():
        head, _, rest = name.partition(".")
        if head not in fields:
            raise ValueError(
                f"--set {where}{name}: {type(obj).__name__} has no field {head!r} "
                f"(fields: {', '.join(sorted(fields))})"
            )
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[head] = value
    for head, sub in nested.items():
        inner = getattr(obj, head)
        if inner is None:
            raise ValueError(f"--set {where}{head}.…: the preset has no {head!r} section")
        flat[head] = _replace(inner, sub, f"{where}{head}.")
    return obj.replace(**flat) if hasattr(obj, "replace") else dataclasses.replace(obj, **flat)


def config_with_changes(preset_name: str, changes: dict[str, Any]) -> GPTConfig:
    """The preset ``preset_name`` with dotted field ``changes`` (ValueError names a bad one)."""
    return _replace(preset(preset_name), changes, "")


def _check_destination(dst: Path) -> None:
    """ValueError unless ``dst`` is a new folder (its nearest existing ancestor a directory)
    or an empty directory: checked before anything is read, so a wrong DST (an existing file,
    a path under a file) is one line, not a traceback from deep in the save."""
    valid = "give a new folder path or an empty directory"
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"destination {str(dst)!r} exists and is not a directory ({valid})")
    try:
        if dst.is_dir() and any(dst.iterdir()):
            raise ValueError(f"destination {str(dst)!r} exists and is not empty ({valid})")
    except OSError as exc:
        raise ValueError(f"destination {str(dst)!r} cannot be listed: {exc.strerror}") from None
    ancestor = next((p for p in dst.absolute().parents if p.exists()), None)
    if ancestor is not None and not ancestor.is_dir():
        raise ValueError(
            f"destination {str(dst)!r} cannot be created: {str(ancestor)!r} is a file, not a "
            f"directory ({valid})"
        )


def _run(args: argparse.Namespace) -> int:
    """Import ``args.src`` into ``args.dst``; every check (config, destination, checkpoint)
    runs before the first write, each mistake a ValueError that the CLI prints as one line."""
    config = config_with_changes(args.preset, _parse_sets(args.set))
    _check_destination(args.dst)
    summary = import_megatron(args.src, args.dst, config)
    print(
        f"imported {summary['tensors']} tensors ({summary['parameters']:,} parameters) from "
        f"{args.src} into {args.dst}"
    )
    return 0


def register(subparsers) -> None:
    """Add ``import-megatron`` to ``shardwork-ckpt``'s subcommands."""
    p = subparsers.add_parser(
        "import-megatron",
        help="convert a Megatron-Core torch_dist checkpoint into a shardwork checkpoint",
    )
    p.add_argument("src", type=Path, help="Megatron-Core torch_dist checkpoint folder")
    p.add_argument("dst", type=Path, help="new shardwork checkpoint folder")
    p.add_argument("--preset", required=True, help="shardwork preset of the architecture")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="GPTConfig change (dots for nested fields, JSON values)",
    )
    p.set_defaults(run=_run)
