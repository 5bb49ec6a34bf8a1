"""DCP storage writer: shardwork's data-file writing under DCP's planning and metadata.

`ShardworkWriter` is DCP's `FileSystemWriter` (same file names, same ``.metadata``, same
``_StorageInfo`` records, so every DCP reader reads the result) whose `write_data` writes the
data files itself:

- byte items (objects, plain values) as they are, then tensor chunks as ``torch.save``-format
  archives (`archive.write_tensor_archive`: one pass over each chunk's bytes, views written
  without a copy), through `datafile.DataFile` (inline per-file CRC-32 and size, early
  writeback, ``fsync`` at the end);
- one file per thread, ``thread_count`` threads; items split over files by size (bytes
  items round-robin, tensors largest first to the least-filled file), as DCP does;
- the ``before_data`` (before any file exists), ``mid_file`` (`DataFile`) and
  ``before_metadata`` (coordinator, before DCP's ``.metadata``) fault points.

`checksums` maps each data file's name to its ``{"size", "crc32"}``; the ``.metadata`` file
is summed at commit.
"""

from __future__ import annotations

import io
import math
import os
import threading
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from shardwork.dist_checkpoint.archive import write_tensor_archive
from shardwork.dist_checkpoint.checksum import crc32
from shardwork.dist_checkpoint.datafile import DataFile
from shardwork.dist_checkpoint.faults import fault_point

__all__ = ["DATA_SUFFIX", "ShardworkWriter", "file_crc32"]

DATA_SUFFIX = ".distcp"
_READ_CHUNK = 16 * 2**20


def _item_nbytes(item: WriteItem) -> int:
    """Bytes of the item's chunk (DCP's own split sizes by the whole tensor instead)."""
    data = item.tensor_data
    shape = data.size if data.chunk is None else data.chunk.sizes
    return math.prod(shape) * data.properties.dtype.itemsize


def split_items(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """Items per file: byte items round-robin, tensor chunks largest first to the file with
    the fewest bytes so far (ties: the first such file). Each file's byte items come before
    its tensors."""
    buckets: list[list[WriteItem]] = [[] for _ in range(files)]
    filled = [0] * files
    byte_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
    tensor_items = [item for item in items if item.type != WriteItemType.BYTE_IO]
    for i, item in enumerate(byte_items):
        buckets[i % files].append(item)
    for item in sorted(tensor_items, key=_item_nbytes, reverse=True):
        target = filled.index(min(filled))
        buckets[target].append(item)
        filled[target] += _item_nbytes(item)
    return buckets


class ShardworkWriter(FileSystemWriter):
    """`FileSystemWriter` writing its data files through `DataFile`; one file per thread."""

    def __init__(self, path: str | os.PathLike, *, rank: int, thread_count: int, sync_files: bool):
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=sync_files,
            thread_count=thread_count,
            overwrite=True,
        )
        self._shardwork_rank = rank
        self.checksums: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fault_point("before_data", self._shardwork_rank)
        prefix = plan.storage_data.prefix
        jobs = [
            (f"{prefix}{i}{DATA_SUFFIX}", bucket)
            for i, bucket in enumerate(split_items(plan.items, self.thread_count))
        ]
        results: list[list[WriteResult]] = [[] for _ in jobs]
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                results[i] = self._write_file(jobs[i][0], jobs[i][1], planner)
            except BaseException as exc:  # re-raised on the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(jobs))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        future: Future[list[WriteResult]] = Future()
        future.set_result([r for file_results in results for r in file_results])
        return future

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        out = DataFile(
            Path(self.path) / name, rank=self._shardwork_rank, sync_files=self.sync_files
        )
        written = []
        try:
            for item in items:  # byte items first (`split_items`)
                offset = out.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    out.write(data.getbuffer() if isinstance(data, io.BytesIO) else data)
                    length = out.tell() - offset
                else:
                    length = write_tensor_archive(out, data)
                written.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )
        finally:
            out.close()
        with self._lock:
            self.checksums[name] = {"size": out.size, "crc32": out.crc}
        return written

    def finish(self, metadata: Any, results: Any) -> None:
        fault_point("before_metadata", self._shardwork_rank)
        super().finish(metadata, results)


def file_crc32(path: str | os.PathLike) -> tuple[int, int]:
    """``(size, crc32)`` of a file, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_READ_CHUNK):
            crc = crc32(block, crc)
            size += len(block)
    return size, crc
