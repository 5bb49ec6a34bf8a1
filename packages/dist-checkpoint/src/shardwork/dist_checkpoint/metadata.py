"""The shardwork metadata file, the commit marker, and reading them back.

A checkpoint directory holds DCP's files (``__<rank>_<n>.distcp`` data, ``.metadata``) plus:

- ``shardwork.json``: format version, shardwork and torch versions, the caller's content
  version and layout (`layout.describe_layout`), the group's size (``world_size``) and global
  ranks (``group_ranks``), every key's kind/dtype/global shape/paths, per-file size
  and CRC-32, bytes written per rank and per-phase timings;
- ``COMMITTED``: written last (write to a temporary name, fsync, rename, fsync the directory).
  A directory is a complete checkpoint if and only if this marker exists, so a save killed at
  any point before it leaves an incomplete directory that readers ignore. From format version
  2 it records the CRC-32 of ``shardwork.json`` (``info_crc32``), which `read_info` checks, so
  every file of a checkpoint except the marker itself is covered by a recorded checksum.

Format versions: 1 (no ``info_crc32``; also assumed when ``format_version`` is absent) and 2.
Both record CRC-32 per file; `checksum_kind` maps a version to the checksum it used, so a
later change of checksum keeps older checkpoints verifiable.
"""

from __future__ import annotations

import json
import os
import time
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch

from shardwork.dist_checkpoint.checksum import crc32

__all__ = [
    "COMMIT_MARKER",
    "FORMAT_VERSION",
    "INFO_FILE",
    "CheckpointCorruptError",
    "CheckpointRefusedError",
    "IncompleteCheckpointError",
    "UnsupportedFormatError",
    "checksum_kind",
    "is_committed",
    "read_info",
    "shardwork_version",
    "write_commit",
]

INFO_FILE = "shardwork.json"
COMMIT_MARKER = "COMMITTED"
DCP_METADATA_FILE = ".metadata"
#: Version of the on-disk layout written by this package (bumped on incompatible changes).
FORMAT_VERSION = 2
#: The checksum each format version records per file (see `checksum_kind`).
_CHECKSUMS = {1: "crc32", 2: "crc32"}


class IncompleteCheckpointError(ValueError):
    """The directory is not a committed checkpoint (its save was interrupted or is running)."""


class CheckpointCorruptError(RuntimeError):
    """A file of a checkpoint is missing, truncated or does not match its recorded checksum.

    Attributes:
        checkpoint: the checkpoint directory (None when not known where raised).
        files: names (relative to ``checkpoint``) of the files found bad.
    """

    def __init__(
        self, message: str, *, checkpoint: str | None = None, files: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.files = tuple(files)

    def __reduce__(self) -> tuple:  # keeps class and attributes through pickling (collectives)
        return _rebuild_corrupt, (type(self), str(self), self.checkpoint, self.files)


def _rebuild_corrupt(
    cls: type, message: str, checkpoint: str | None, files: tuple[str, ...]
) -> CheckpointCorruptError:
    return cls(message, checkpoint=checkpoint, files=files)


def checksum_kind(info: dict[str, Any]) -> str:
    """The per-file checksum a checkpoint's ``shardwork.json`` records (``"crc32"``).

    A missing ``format_version`` is version 1. A version this package does not know (written
    by a newer shardwork-dist-checkpoint) raises `UnsupportedFormatError` naming it.
    """
    version = info.get("format_version", 1)
    if version not in _CHECKSUMS:
        raise UnsupportedFormatError(
            f"format_version={version!r} of this checkpoint is not known to "
            f"shardwork-dist-checkpoint {shardwork_version()}; valid: {sorted(_CHECKSUMS)} "
            f"(read it with the newer version that wrote it)"
        )
    return _CHECKSUMS[version]


class UnsupportedFormatError(ValueError):
    """The checkpoint's ``format_version`` is newer than this package reads (nothing is read)."""


class CheckpointRefusedError(CheckpointCorruptError):
    """A checkpoint record is not what shardwork would read: a pickle that names code outside
    the allow-list, or a file name or byte range outside the checkpoint. Raised before
    anything from the checkpoint is written into the caller's tensors."""


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
        # Durable before the rename, so after a crash the final name never holds unwritten data.
        os.fsync(f.fileno())
    # Atomic within one filesystem: readers see the old file or the new one, never half.
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
    text = json.dumps(full, indent=1, sort_keys=True)
    _write_atomic(path / INFO_FILE, text)
    # Make the rename itself durable before the marker can exist.
    _fsync_dir(path)
    # The marker records shardwork.json's CRC-32, which read_info checks.
    marker = {"committed": True, "time": time.time(), "info_crc32": crc32(text.encode())}
    _write_atomic(path / COMMIT_MARKER, json.dumps(marker))
    _fsync_dir(path)


def is_committed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete (committed) checkpoint directory."""
    return (Path(path) / COMMIT_MARKER).is_file()


def read_info(path: str | os.PathLike, *, require_commit: bool = True) -> dict[str, Any]:
    """The parsed ``shardwork.json`` of a checkpoint, checked against the marker's CRC-32.

    Raises `IncompleteCheckpointError` if the directory has no commit marker (unless
    ``require_commit=False``) or no metadata file, and `CheckpointCorruptError` if the marker
    is unreadable or ``shardwork.json`` does not match the CRC-32 the marker recorded (format
    version 2; a version-1 marker records none).
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
    raw = info_path.read_bytes()
    expected = _recorded_info_crc(path)
    if expected is not None and crc32(raw) != expected:
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} is corrupt: {INFO_FILE}: checksum mismatch (crc32 "
            f"{crc32(raw):08x}, recorded {expected:08x} in {COMMIT_MARKER})",
            checkpoint=str(path),
            files=(INFO_FILE,),
        )
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} is corrupt: {INFO_FILE} is not valid JSON: {exc}",
            checkpoint=str(path),
            files=(INFO_FILE,),
        ) from exc


def _recorded_info_crc(path: Path) -> int | None:
    """The ``info_crc32`` the commit marker records (None: no marker, or a version-1 one)."""
    marker = path / COMMIT_MARKER
    if not marker.is_file():
        return None
    try:
        record = json.loads(marker.read_bytes())
        crc = record.get("info_crc32")
        if crc is not None and not isinstance(crc, int):
            raise TypeError(f"info_crc32={crc!r} is not an int")
        return crc
    except (ValueError, TypeError, AttributeError) as exc:  # JSON, decoding, shape
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} is corrupt: {COMMIT_MARKER} is not readable: {exc}",
            checkpoint=str(path),
            files=(COMMIT_MARKER,),
        ) from exc
