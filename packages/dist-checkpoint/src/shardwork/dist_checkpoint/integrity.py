"""Checking a data file's recorded size and CRC-32 from the bytes a load reads anyway.

`load` reads a data file as a sequence of byte ranges (a chunk's head, then the regions it
needs), in file order, straight into their destinations. `FileCheck` folds each range into a
running CRC-32 right after it is read (while it is still in the CPU cache), so a file that
is read whole is checksummed without a second pass over its bytes. What a load does not
read — zip headers between chunks, the archive's central directory at the end, and chunks
of the file that this rank does not need (a resharded load) — is read by `FileCheck` itself
to close the gaps: the recorded CRC is of the whole file, so every byte must be seen. For a
same-layout load the gaps are a few hundred bytes per chunk; for a resharded load a rank
reads the rest of each file it touches (the cost is measured in the package docs).

Ranges may arrive out of order or overlap (a chunk's 4 KiB head overlaps its data; staged
regions of one chunk overlap): bytes already folded are skipped, and a range that starts
beyond the covered prefix first has the gap read. The result is exact for any order.

`file_problem` is the slow path for a file whose read failed: a full size + CRC check that
says whether the failure is explained by the file differing from its record.
"""

from __future__ import annotations

import os
from typing import Any

from shardwork.dist_checkpoint.checksum import crc32
from shardwork.dist_checkpoint.storage import file_crc32

__all__ = ["FileCheck", "file_problem", "mismatch"]

_GAP_SLICE = 4 * 2**20


def mismatch(name: str, size: int, crc: int, record: dict[str, Any]) -> str | None:
    """A description of how ``(size, crc)`` differs from ``record`` (None if they agree)."""
    if size != record["size"]:
        return f"{name}: {size} bytes, recorded {record['size']}"
    if crc != record["crc32"]:
        return f"{name}: checksum mismatch (crc32 {crc:08x}, recorded {record['crc32']:08x})"
    return None


def file_problem(path: str | os.PathLike, name: str, record: dict[str, Any]) -> str | None:
    """How the file at ``path`` differs from ``record`` (missing, size, CRC), or None."""
    if not os.path.isfile(path):
        return f"{name}: missing"
    size, crc = file_crc32(path)
    return mismatch(name, size, crc, record)


class FileCheck:
    """Running CRC-32 of one open data file, fed with the ranges a reader reads.

    Args:
        fd: the file, open for reading (gaps are read with ``pread``).
        name: its name in the checkpoint (for messages).
        record: its recorded ``{"size", "crc32"}``.
    """

    def __init__(self, fd: int, name: str, record: dict[str, Any]) -> None:
        self._fd = fd
        self.name = name
        self._record = record
        self._crc = 0
        self._pos = 0

    def add(self, offset: int, data: memoryview | bytes) -> None:
        """Fold ``data``, the file's bytes at ``offset``, into the CRC (skipping what was seen)."""
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        # Already folded (a chunk's head overlapping its data, or a re-read): nothing new.
        if end <= self._pos:
            return
        # A range beyond the covered prefix: the CRC runs in file order, so read the gap first.
        if offset > self._pos:
            self._read_gap(offset)
        # Fold only the part past the covered prefix.
        self._crc = crc32(view[self._pos - offset :], self._crc)
        self._pos = end

    def finish(self) -> str | None:
        """Read the rest of the file; return how it differs from the record (None: intact)."""
        # To the end of the file: the bytes the load did not need still count toward its CRC.
        while True:
            block = os.pread(self._fd, _GAP_SLICE, self._pos)
            if not block:
                break
            self._crc = crc32(block, self._crc)
            self._pos += len(block)
        return mismatch(self.name, self._pos, self._crc, self._record)

    def _read_gap(self, end: int) -> None:
        while self._pos < end:
            block = os.pread(self._fd, min(_GAP_SLICE, end - self._pos), self._pos)
            if not block:  # the file is shorter than the range being added: finish() says so
                raise OSError(f"{self.name}: file ends at byte {self._pos}, expected {end}")
            self._crc = crc32(block, self._crc)
            self._pos += len(block)
