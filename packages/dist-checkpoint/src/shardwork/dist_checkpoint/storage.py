"""DCP storage writer with inline per-file checksums and the fault points.

- `ChecksummingFileSystem` wraps every stream DCP opens for writing: bytes pass straight to the
  file while their CRC-32 and count are accumulated, so recording checksums costs no re-read.
  Only data files (``*.distcp``) are recorded; the ``.metadata`` file is summed at commit.
- `ShardworkWriter` is DCP's `FileSystemWriter` (same file names, same format) with that file
  system and the ``before_data`` / ``mid_file`` / ``before_metadata`` fault points.
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from shardwork.dist_checkpoint.faults import fault_armed, fault_point

__all__ = ["DATA_SUFFIX", "ChecksummingFileSystem", "ShardworkWriter", "file_crc32"]

DATA_SUFFIX = ".distcp"
_READ_CHUNK = 16 * 2**20


class _ChecksumStream(io.RawIOBase):
    """Write-through stream that accumulates CRC-32 and size; fires ``mid_file``."""

    def __init__(self, raw: Any, on_close: Any, rank: int) -> None:
        super().__init__()
        self._raw = raw
        self._crc = 0
        self._size = 0
        self._on_close = on_close
        self._rank = rank
        self._fault = fault_armed("mid_file", rank)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self._fault and self._size > 0:
            self._raw.flush()
            os.fsync(self._raw.fileno())
            fault_point("mid_file", self._rank)
        view = memoryview(b).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        self._size += view.nbytes
        self._raw.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._on_close(self._size, self._crc)
        super().close()


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording ``{file name: (size, crc32)}`` of data files."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.checksums: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase]:
        path = Path(path)
        if mode != "wb" or not path.name.endswith(DATA_SUFFIX):
            with super().create_stream(path, mode) as stream:
                yield stream
            return

        def record(size: int, crc: int) -> None:
            with self._lock:
                self.checksums[path.name] = {"size": size, "crc32": crc}

        with path.open("wb") as raw:
            stream = _ChecksumStream(raw, record, self.rank)
            try:
                yield stream  # type: ignore[misc]
            finally:
                stream.close()


class ShardworkWriter(FileSystemWriter):
    """`FileSystemWriter` with checksums and fault points; one file per thread per rank."""

    def __init__(self, path: str | os.PathLike, *, rank: int, thread_count: int, sync_files: bool):
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=sync_files,
            thread_count=thread_count,
            overwrite=True,
        )
        self.fs = ChecksummingFileSystem(rank)
        self._shardwork_rank = rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        fault_point("before_data", self._shardwork_rank)
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        fault_point("before_metadata", self._shardwork_rank)
        super().finish(metadata, results)


def file_crc32(path: str | os.PathLike) -> tuple[int, int]:
    """``(size, crc32)`` of a file, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_READ_CHUNK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc
