"""``shardwork-ckpt``: look into and check checkpoints without torch.distributed.

- ``shardwork-ckpt inspect PATH [--json]``: versions, the layout, world size and global ranks
  it was saved at, total size, and per key: kind, dtype, global shape, number of chunks. For a
  `CheckpointManager` root it lists the steps (complete or interrupted) and inspects the latest.
- ``shardwork-ckpt verify PATH``: re-checksums every file; for a root, of every complete
  checkpoint in it.
- More subcommands come from installed packages through the entry-point group
  ``shardwork_ckpt.commands`` (:data:`PLUGIN_GROUP`): each entry point is a function
  ``register(subparsers)`` that adds its parser and sets ``run=callable(args) -> int``. This
  package imports nothing of them (dist-checkpoint depends on torch only); e.g.
  shardwork-models registers ``import-megatron``. A plugin's ``ValueError`` is a user mistake
  (exit 2, one line).

Exit status: 0 success; 1 the checkpoint is corrupt (a checksum, size or metadata file does not
match: one ``CORRUPT:`` paragraph naming the files); 2 a usage error or a path that is not a
complete checkpoint (missing, a file, interrupted save, unreadable), one ``shardwork-ckpt:``
paragraph. These mistakes never print a traceback; anything else is an internal error and
keeps it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch

from shardwork.dist_checkpoint import metadata as md
from shardwork.dist_checkpoint.layout import LAYOUT_FIELDS
from shardwork.dist_checkpoint.verify import verify

__all__ = ["PLUGIN_GROUP", "main"]

PLUGIN_GROUP = "shardwork_ckpt.commands"
"""Entry-point group of extra ``shardwork-ckpt`` subcommands."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def _is_root(path: Path) -> bool:
    """A `CheckpointManager` root: ``step_*`` folders and no checkpoint of its own."""
    return not (path / md.INFO_FILE).exists() and bool(_step_dirs(path))


def _not_a_checkpoint_hint(path: Path) -> str | None:
    """What ``path`` is instead of a checkpoint, when that is recognisable: a training run's
    folder (its checkpoints are in ``checkpoints/``), so the message can say where to look, or
    a folder holding no checkpoint file at all, which "no COMMITTED marker (the save was
    interrupted ...)" would misdescribe as a checkpoint whose save broke off."""
    if not path.is_dir():
        return None
    names = (md.COMMIT_MARKER, md.INFO_FILE, md.DCP_METADATA_FILE)
    if any((path / name).exists() for name in names):
        return None
    inner = path / "checkpoints"
    if inner.is_dir() and _is_root(inner):
        return (
            f"{str(path)!r} is a training run's folder, not a checkpoint; its checkpoints are "
            f"in {str(inner)!r} (give that folder, or one of its step_* folders)"
        )
    return (
        f"{str(path)!r} is not a checkpoint: it holds none of a checkpoint's files "
        f"({', '.join(names)}) and no step_* checkpoint folders; valid: a checkpoint folder "
        "(e.g. RUN_DIR/checkpoints/step_000000100) or a CheckpointManager root holding step_* "
        "folders"
    )


def _inspect(path: Path, as_json: bool) -> int:
    if _is_root(path):
        steps = _step_dirs(path)
        complete = [p for p in steps if md.is_committed(p)]
        if not as_json:
            for p in steps:
                print(f"{p.name}  {'complete' if md.is_committed(p) else 'INCOMPLETE'}")
        if not complete:
            print(
                f"shardwork-ckpt: {str(path)!r} holds no complete checkpoint "
                f"({len(steps)} interrupted saves)",
                file=sys.stderr,
            )
            return 2
        if not as_json:
            print(f"\nlatest complete: {complete[-1].name}\n")
        path = complete[-1]
    info = md.read_info(path)
    if as_json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    total = sum(rec["size"] for rec in info.get("files", {}).values())
    print(f"checkpoint      {path}")
    print(f"format          {info['format']} v{info.get('format_version', 1)}")
    print(f"shardwork       {info['shardwork_version']}   torch {info['torch_version']}")
    print(f"content version {info.get('content_version')}")
    print(f"saved at        world size {info['world_size']}{_ranks(info.get('group_ranks'))}")
    print(f"layout          {_layout(info.get('layout'))}")
    print(f"size            {_human(total)} in {len(info.get('files', {}))} files")
    if info.get("user_metadata"):
        print(f"metadata        {info['user_metadata']}")
    timings = info.get("timings", {})
    if timings:
        print("timings (s)     " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items()))
    rows: list[tuple[str, ...]] = [("key", "kind", "dtype", "global shape", "chunks", "size")]
    for key, e in info["keys"].items():
        numel = math.prod(e["global_shape"])
        size = "" if e["kind"] == "object" else _human(numel * _itemsize(e["dtype"]))
        rows.append(
            (
                key,
                e["kind"],
                e["dtype"] or "-",
                str(tuple(e["global_shape"])),
                str(e["num_chunks"]),
                size,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _ranks(ranks: list[int] | None) -> str:
    """`` (global ranks 0-7)`` for a contiguous range, the list otherwise (first 16)."""
    if not ranks:
        return ""
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f" (global ranks {ranks[0]}-{ranks[-1]})"
    shown = ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
    return f" (global ranks {shown})"


def _layout(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "not recorded (pass layout= to save / CheckpointManager)"
    rank = {name: i for i, name in enumerate(LAYOUT_FIELDS)}
    keys = sorted(layout, key=lambda k: (rank.get(k, len(rank)), k))
    return " ".join(f"{k}={layout[k]}" for k in keys)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _verify(path: Path) -> int:
    """Verify one checkpoint, or every complete one of a root (an interrupted save is listed;
    the first corrupt checkpoint stops with its error)."""
    if not _is_root(path):
        summary: dict[str, Any] = verify(path)
        print(f"ok: {summary['files']} files, {_human(summary['bytes'])} match their checksums")
        return 0
    complete = 0
    for step in _step_dirs(path):
        if not md.is_committed(step):
            print(f"{step.name}  INCOMPLETE (an interrupted save; never loaded)")
            continue
        summary = verify(step)
        complete += 1
        print(f"{step.name}  ok: {summary['files']} files, {_human(summary['bytes'])}")
    if not complete:
        print(f"shardwork-ckpt: {str(path)!r} holds no complete checkpoint", file=sys.stderr)
        return 2
    return 0


def _run_plugin(args: argparse.Namespace) -> int:
    """Run a plugin subcommand; its ValueError is a user mistake (one line, exit 2)."""
    try:
        return args.run(args)
    except ValueError as exc:
        print(f"shardwork-ckpt: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shardwork-ckpt", description="Inspect and verify shardwork checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="tensors, dtypes, shapes, layout, size")
    p_inspect.add_argument("path", type=Path)
    p_inspect.add_argument("--json", action="store_true", help="print shardwork.json")
    p_verify = sub.add_parser("verify", help="re-checksum every file")
    p_verify.add_argument("path", type=Path)
    for plugin in entry_points(group=PLUGIN_GROUP):
        plugin.load()(sub)
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is not None:
        return _run_plugin(args)
    try:
        if args.command == "inspect":
            return _inspect(args.path, args.json)
        return _verify(args.path)
    except md.IncompleteCheckpointError as exc:
        print(f"shardwork-ckpt: {_not_a_checkpoint_hint(args.path) or exc}", file=sys.stderr)
        return 2
    except md.CheckpointCorruptError as exc:
        print(f"CORRUPT: {exc}", file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"shardwork-ckpt: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
