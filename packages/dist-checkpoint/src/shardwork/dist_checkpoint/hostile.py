"""Test helpers: alter a real checkpoint the way an attacker would, checksums included.

A checksum tells a damaged file from an intact one, not a hostile file from a friendly one:
whoever writes a checkpoint can write its checksums too. These helpers make such files for
tests of the allow-list decoder and the path/range confinement (see `decode`, `confine`):

- `RunsCommand`: a value that pickles as ``os.system(command)``;
- `rewrite_metadata(path, change)`: decode DCP's ``.metadata`` with plain pickle (it is our
  own, freshly saved), apply ``change`` to the `Metadata`, write it back, and re-record;
- `rerecord(path, name)`: record file ``name``'s current size and CRC-32 in
  ``shardwork.json``, and ``shardwork.json``'s CRC-32 in ``COMMITTED`` (format version 2).
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwork.dist_checkpoint.metadata import COMMIT_MARKER, DCP_METADATA_FILE, INFO_FILE

__all__ = ["RunsCommand", "rerecord", "rewrite_metadata", "write_info"]


class RunsCommand:
    """Pickles as a call of ``os.system(command)``: what a hostile record holds."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def write_info(path: str | os.PathLike, info: dict[str, Any]) -> None:
    """Rewrite ``shardwork.json`` and the CRC-32 the commit marker records for it."""
    path = Path(path)
    text = json.dumps(info)
    (path / INFO_FILE).write_text(text)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    marker["info_crc32"] = zlib.crc32(text.encode())
    (path / COMMIT_MARKER).write_text(json.dumps(marker))


def rerecord(path: str | os.PathLike, name: str) -> None:
    """Record file ``name``'s current size and CRC-32 as if the saver had written it."""
    path = Path(path)
    info = json.loads((path / INFO_FILE).read_text())
    data = (path / name).read_bytes()
    info["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    write_info(path, info)


def rewrite_metadata(path: str | os.PathLike, change: Callable[[Any], None]) -> None:
    """Apply ``change`` to the checkpoint's DCP `Metadata` and re-record the file."""
    path = Path(path)
    with open(path / DCP_METADATA_FILE, "rb") as f:
        metadata = pickle.load(f)  # a checkpoint this test just saved: trusted
    change(metadata)
    with open(path / DCP_METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    rerecord(path, DCP_METADATA_FILE)
