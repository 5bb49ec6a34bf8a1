"""Keep every file name and byte range a checkpoint records inside that checkpoint.

DCP's metadata says, for each saved chunk, which file holds it and at which offset and
length; ``shardwork.json`` lists the files with their sizes and CRCs. A crafted checkpoint
could name ``../../home/user/.ssh/id_rsa``, an absolute path, a symbolic link that leaves the
directory, or a range past a file's end. Readers resolve names through `confined_file` and
check ranges with `check_storage_ranges` before reading, so a checkpoint can only make
shardwork read its own files, within their sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from shardwork.dist_checkpoint.metadata import CheckpointCorruptError, CheckpointRefusedError

__all__ = ["check_storage_ranges", "confined_file"]


def confined_file(directory: Path, name: Any) -> Path:
    """``directory / name`` for a recorded file ``name``; `CheckpointRefusedError` if the
    name is not a relative path that stays inside ``directory`` once links are resolved."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointRefusedError(
            f"{str(directory)!r}: refused file name {name!r}", checkpoint=str(directory)
        )
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or "\\" in name:
        raise CheckpointRefusedError(
            f"{str(directory)!r}: refused file name {name!r} (names must stay inside the "
            "checkpoint directory: no absolute paths, no '..')",
            checkpoint=str(directory),
        )
    path = directory / relative
    root = directory.resolve()
    target = path.resolve()
    if target != root and root not in target.parents:
        raise CheckpointRefusedError(
            f"{str(directory)!r}: refused file {name!r}: it resolves to {str(target)!r}, "
            "outside the checkpoint directory",
            checkpoint=str(directory),
            files=(name,),
        )
    return path


def check_storage_ranges(directory: Path, storage_data: Mapping[Any, Any]) -> None:
    """Check DCP's storage records (``MetadataIndex -> _StorageInfo``): each names a file
    inside ``directory`` and a byte range within that file's size.

    Raises `CheckpointRefusedError` naming the file and record otherwise, and
    `CheckpointCorruptError` when a named file is missing. One ``stat`` per distinct file.
    """
    sizes: dict[str, int] = {}
    for index, info in storage_data.items():
        name = info.relative_path
        if name not in sizes:
            path = confined_file(directory, name)
            if not path.is_file():
                raise CheckpointCorruptError(
                    f"{str(directory)!r}: data file {name!r} (named for {index.fqn!r}) is missing",
                    checkpoint=str(directory),
                    files=(name,),
                )
            sizes[name] = path.stat().st_size
        offset, length = info.offset, info.length
        valid = isinstance(offset, int) and isinstance(length, int) and offset >= 0
        if not valid or length < 0 or offset + length > sizes[name]:
            raise CheckpointRefusedError(
                f"{str(directory)!r}: {name}: record {index.fqn!r} asks for {length!r} bytes at "
                f"offset {offset!r}, but the file has {sizes[name]} bytes",
                checkpoint=str(directory),
                files=(name,),
            )
