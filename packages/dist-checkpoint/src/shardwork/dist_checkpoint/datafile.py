"""`DataFile`: one ``*.distcp`` data file being written, with its running CRC-32 and size.

What a save costs beyond putting its bytes on the disk is CPU work that the disk waits for;
this writer keeps that work small and lets the disk run while it happens:

- small writes (zip headers, pickles) are gathered in memory and go out with the next
  payload, so an item costs two ``write`` calls, not ten;
- a payload (tensor storage bytes) is written in 4 MiB slices, each checksummed right before
  it is written (while it is still in the CPU cache); its CRC-32 is computed once and serves
  both the zip record and, combined in O(log n) (`crc.crc32_combine`), the whole file's CRC;
- with ``sync_files`` every 16 MiB written are handed to the kernel for writeback at once
  (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux; elsewhere nothing): the disk writes
  while the next slices are checksummed and copied, instead of everything waiting for the
  final ``fsync`` (which still runs and is what makes the file durable);
- ``mid_file`` fault point: after the file's first bytes are durably written.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

from shardwork.dist_checkpoint.checksum import crc32
from shardwork.dist_checkpoint.crc import crc32_combine
from shardwork.dist_checkpoint.faults import fault_armed, fault_point

__all__ = ["DataFile"]

_SLICE = 4 * 2**20
_WRITEBACK_EVERY = 16 * 2**20
_COMBINE_FROM = 2**20  # below this, a second CRC pass is cheaper than combining
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class DataFile:
    """A data file open for writing (one per writer thread per rank).

    Args:
        path: the file (created or truncated).
        rank: this process's rank (for the ``mid_file`` fault point).
        sync_files: start writeback early and ``fsync`` at `close`.
    """

    def __init__(self, path: Path, *, rank: int, sync_files: bool) -> None:
        self.path = path
        self.size = 0
        self.crc = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pending = bytearray()
        self._rank = rank
        self._sync = sync_files
        self._writeback = _sync_file_range() if sync_files else None
        self._written_back = 0
        self._on_disk = 0
        self._fault = fault_armed("mid_file", rank)

    def tell(self) -> int:
        """Offset of the next byte (pending small writes included)."""
        return self.size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append small data (headers, pickles); large data goes through `write_payload`."""
        view = memoryview(data).cast("B")
        if view.nbytes >= _COMBINE_FROM:
            self.write_payload(view)
            return
        self.crc = crc32(view, self.crc)
        self.size += view.nbytes
        self._pending += view

    def write_payload(self, view: memoryview) -> int:
        """Append ``view`` (bytes) and return its own CRC-32 (from 0)."""
        view = view.cast("B") if view.format != "B" else view
        self._flush_pending()
        if view.nbytes < _COMBINE_FROM:
            crc = crc32(view)
            self.crc = crc32(view, self.crc)
            self._write_all(view)
            self.size += view.nbytes
            return crc
        crc = 0
        for start in range(0, view.nbytes, _SLICE):
            piece = view[start : start + _SLICE]
            crc = crc32(piece, crc)
            self._write_all(piece)
            self._start_writeback(self.size + start + piece.nbytes)
        self.crc = crc32_combine(self.crc, crc, view.nbytes)
        self.size += view.nbytes
        return crc

    def close(self) -> None:
        """Write what is pending, ``fsync`` (with ``sync_files``) and close."""
        if self._fd < 0:
            return
        try:
            self._flush_pending()
            if self._sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def _flush_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._write_all(memoryview(pending))

    def _write_all(self, view: memoryview) -> None:
        if self._fault and self._on_disk > 0:
            os.fsync(self._fd)
            fault_point("mid_file", self._rank)
        done = 0
        while done < view.nbytes:
            done += os.write(self._fd, view[done:])
        self._on_disk += done

    def _start_writeback(self, end: int) -> None:
        """Hand ``[written back, end)`` to the kernel's writeback once it is big enough."""
        if self._writeback is None or end - self._written_back < _WRITEBACK_EVERY:
            return
        self._writeback(
            self._fd, self._written_back, end - self._written_back, _SYNC_FILE_RANGE_WRITE
        )
        self._written_back = end
