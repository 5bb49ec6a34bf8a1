"""Integrity check of a committed checkpoint against the sizes and CRC-32s recorded at save.

`verify` re-reads every file listed in ``shardwork.json`` (data files and DCP's ``.metadata``)
and raises `CheckpointCorruptError` naming each missing, truncated or altered file; then it
decodes DCP's metadata as `load` does (allow-list, names and ranges confined), so a crafted
checkpoint with matching checksums is refused by `verify` too (`CheckpointRefusedError`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardwork.dist_checkpoint.confine import check_storage_ranges, confined_file
from shardwork.dist_checkpoint.decode import decode_metadata
from shardwork.dist_checkpoint.metadata import DCP_METADATA_FILE, CheckpointCorruptError, read_info
from shardwork.dist_checkpoint.storage import file_crc32

__all__ = ["verify"]


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check every recorded file of the checkpoint at ``path``.

    Returns ``{"files": count, "bytes": total}`` when all match; raises
    `CheckpointCorruptError` listing the bad files otherwise (and `IncompleteCheckpointError`
    if ``path`` is not a committed checkpoint).
    """
    path = Path(path)
    info = read_info(path)
    files = info.get("files", {})
    problems = []
    total = 0
    for name, rec in sorted(files.items()):
        f = confined_file(path, name)
        if not f.is_file():
            problems.append(f"{name}: missing")
            continue
        size, crc = file_crc32(f)
        total += size
        if size != rec["size"]:
            problems.append(f"{name}: truncated or extended ({size} bytes, recorded {rec['size']})")
        elif crc != rec["crc32"]:
            problems.append(
                f"{name}: checksum mismatch (crc32 {crc:08x}, recorded {rec['crc32']:08x})"
            )
    if problems:
        raise CheckpointCorruptError(f"checkpoint {str(path)!r} is corrupt: " + "; ".join(problems))
    metadata_file = path / DCP_METADATA_FILE
    if metadata_file.is_file():  # what `load` would decode: refused here too, not only there
        metadata = decode_metadata(metadata_file.read_bytes(), name=str(metadata_file))
        check_storage_ranges(path, metadata.storage_data or {})
    return {"files": len(files), "bytes": total}
