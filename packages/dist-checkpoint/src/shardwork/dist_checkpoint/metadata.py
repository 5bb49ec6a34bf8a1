"""The shardwork metadata file, the commit marker, and reading them back.

A checkpoint directory holds DCP's files (``__<rank>_<n>.distcp`` data, ``.metadata``) plus:

- ``shardwork.json``: format version, shardwork and torch versions, the caller's content
  version and layout (`layout.describe_layout`), the group's size (``world_size``) and global
  ranks (``group_ranks``), every key's kind/dtype/global shape/paths, per-file size
  and CRC-32, bytes written per rank and per-phase timings;
- ``COMMITTED``: written last (write to a temporary name, fsync, rename, fsync the directory).
  A directory is a complete checkpoint if and only if this marker exists, so a save killed at
  any point before it leaves an incomplete directory that readers ignore.
"""

from __future__ import annotations

import json
import os
import time
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "COMMIT_MARKER",
    "FORMAT_VERSION",
    "INFO_FILE",
    "CheckpointCorruptError",
    "IncompleteCheckpointError",
    "is_committed",
    "read_info",
    "shardwork_version",
    "write_commit",
]

INFO_FILE = "shardwork.json"
COMMIT_MARKER = "COMMITTED"
DCP_METADATA_FILE = ".metadata"
#: Version of the on-disk layout written by this package (bumped on incompatible changes).
FORMAT_VERSION = 1


class IncompleteCheckpointError(ValueError):
    """The directory is not a committed checkpoint (its save was interrupted or is running)."""


class CheckpointCorruptError(RuntimeError):
    """A file of a checkpoint is missing, truncated or does not match its recorded checksum."""


def shardwork_version() -> str:
    """Installed version of shardwork-dist-checkpoint (``"unknown"`` from a bare source tree)."""
    try:
        return importlib_metadata.version("shardwork-dist-checkpoint")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_commit(path: str | os.PathLike, info: dict[str, Any]) -> None:
    """Write ``shardwork.json`` then the ``COMMITTED`` marker, each atomically and durably."""
    path = Path(path)
    full = {
        "format": "shardwork-dist-checkpoint",
        "format_version": FORMAT_VERSION,
        "shardwork_version": shardwork_version(),
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        **info,
    }
    _write_atomic(path / INFO_FILE, json.dumps(full, indent=1, sort_keys=True))
    _fsync_dir(path)
    _write_atomic(path / COMMIT_MARKER, json.dumps({"committed": True, "time": time.time()}))
    _fsync_dir(path)


def is_committed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete (committed) checkpoint directory."""
    return (Path(path) / COMMIT_MARKER).is_file()


def read_info(path: str | os.PathLike, *, require_commit: bool = True) -> dict[str, Any]:
    """The parsed ``shardwork.json`` of a checkpoint.

    Raises `IncompleteCheckpointError` if the directory has no commit marker (unless
    ``require_commit=False``) or no metadata file.
    """
    path = Path(path)
    if not path.is_dir():
        raise IncompleteCheckpointError(f"checkpoint path {str(path)!r} is not a directory")
    if require_commit and not is_committed(path):
        raise IncompleteCheckpointError(
            f"{str(path)!r} is not a complete checkpoint: no {COMMIT_MARKER} marker (the save "
            f"was interrupted or has not been finalized)"
        )
    info_path = path / INFO_FILE
    if not info_path.is_file():
        raise IncompleteCheckpointError(f"{str(path)!r} has no {INFO_FILE}")
    try:
        return json.loads(info_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointCorruptError(f"{str(info_path)!r} is not valid JSON: {exc}") from exc
