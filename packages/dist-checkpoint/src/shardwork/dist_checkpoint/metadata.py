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
  The marker itself is checked for shape: ``committed`` and ``time``, ``info_crc32`` where
  ``shardwork.json`` says version 2, and no other key; a marker damaged so that it lacks
  ``info_crc32`` (a flipped bit in the key's name) is refused, not read as version 1, since
  that would turn the check of ``shardwork.json`` off.

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
    if isinstance(version, bool) or not isinstance(version, int) or version not in _CHECKSUMS:
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
    is unreadable or holds other keys than a marker of format version 1 or 2, if
    ``shardwork.json`` does not match the CRC-32 the marker recorded, or if the marker records
    no CRC-32 although ``shardwork.json`` says format version 2 (which always records one: a
    damaged marker must not turn the check off). A version-1 marker records none.
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
    marker = _read_marker(path)
    expected = None if marker is None else marker.get(_MARKER_CRC_KEY)
    if expected is not None and crc32(raw) != expected:
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} is corrupt: {INFO_FILE}: checksum mismatch (crc32 "
            f"{crc32(raw):08x}, recorded {expected:08x} in {COMMIT_MARKER})",
            checkpoint=str(path),
            files=(INFO_FILE,),
        )
    try:
        info = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} is corrupt: {INFO_FILE} is not valid JSON: {exc}",
            checkpoint=str(path),
            files=(INFO_FILE,),
        ) from exc
    if not isinstance(info, dict):
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} is corrupt: {INFO_FILE} holds a JSON "
            f"{type(info).__name__}, not an object",
            checkpoint=str(path),
            files=(INFO_FILE,),
        )
    if marker is not None:
        _check_marker_fits(path, marker, info)
    return info


#: The keys of a commit marker: every version writes these ...
_MARKER_REQUIRED = ("committed", "time")
#: ... and from this format version on also the CRC-32 of ``shardwork.json``.
_MARKER_CRC_KEY = "info_crc32"
_INFO_CRC_SINCE = 2


def _marker_error(path: Path, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {str(path)!r} is corrupt: {COMMIT_MARKER} {problem}",
        checkpoint=str(path),
        files=(COMMIT_MARKER,),
    )


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The commit marker's record (None: no marker), checked for shape: a JSON object with
    ``committed`` (true) and ``time`` (a number), optionally ``info_crc32`` (an unsigned
    32-bit int), nothing else. Whether ``info_crc32`` must be there depends on the format
    version of ``shardwork.json`` (`_check_marker_fits`)."""
    marker = path / COMMIT_MARKER
    if not marker.is_file():
        return None
    try:
        record = json.loads(marker.read_bytes())
    except ValueError as exc:  # JSON and UTF-8 decoding errors
        raise _marker_error(path, f"is not readable: {exc}") from exc
    if not isinstance(record, dict):
        raise _marker_error(path, f"holds a JSON {type(record).__name__}, not an object")
    missing = [key for key in _MARKER_REQUIRED if key not in record]
    if missing:
        raise _marker_error(path, f"lacks {missing} (keys: {sorted(record)})")
    if record["committed"] is not True:
        raise _marker_error(path, f"has committed={record['committed']!r}; valid: true")
    if isinstance(record["time"], bool) or not isinstance(record["time"], (int, float)):
        raise _marker_error(path, f"has time={record['time']!r}; valid: a number")
    crc = record.get(_MARKER_CRC_KEY)
    if _MARKER_CRC_KEY in record and (
        isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 2**32
    ):
        raise _marker_error(path, f"has {_MARKER_CRC_KEY}={crc!r}; valid: an int in [0, 2**32)")
    return record


def _check_marker_fits(path: Path, marker: dict[str, Any], info: dict[str, Any]) -> None:
    """Refuse a marker with unknown keys, or without ``info_crc32`` where the format version
    of ``shardwork.json`` says its writer recorded one (only then was the CRC-32 checked).
    A format version this package does not know raises `UnsupportedFormatError` first."""
    known = {*_MARKER_REQUIRED, _MARKER_CRC_KEY}
    unknown = sorted(set(marker) - known)
    if unknown:
        checksum_kind(info)  # a newer writer's marker: say so first
        raise _marker_error(path, f"has unknown keys {unknown}; valid keys: {sorted(known)}")
    if _MARKER_CRC_KEY in marker:
        return
    checksum_kind(info)
    version = info.get("format_version", 1)
    if version >= _INFO_CRC_SINCE:
        raise _marker_error(
            path,
            f"has no {_MARKER_CRC_KEY!r} (keys: {sorted(marker)}), which every marker of "
            f"format_version >= {_INFO_CRC_SINCE} records; {INFO_FILE} says "
            f"format_version={version!r}, so its CRC-32 cannot be checked",
        )
