"""`ShardworkReader`: DCP's `FileSystemReader` with a read path that copies each byte once.

DCP's reader loads every saved chunk with ``torch.load`` (many small reads, a fresh tensor)
and then copies the requested part into the destination. This reader, per data file:

- opens the file once (``posix_fadvise(SEQUENTIAL)``) and serves its read items in file
  order, so the disk sees one forward pass;
- reads a chunk's first `blob.HEAD_BYTES` to learn where its storage bytes lie
  (`blob.parse_tensor_blob`), once per chunk even when several items read from it;
- **direct**: when the requested region is one dense byte range of the stored chunk (the
  chunk covers the destination exactly, or rows of a row-major chunk) and the destination is
  a contiguous CPU tensor of the same dtype, ``preadv`` the bytes straight into the
  destination's memory: no intermediate tensor, no copy;
- **scatter**: when the stored region is dense but the destination is a strided view whose
  rows (inner dims) are contiguous runs of >= 4 KiB (e.g. a column block of a tensor that
  was saved row-sharded), one ``preadv`` per 1024 runs scatters the bytes into place;
- **staged**: otherwise (a strided region, another dtype or device) read only the byte span
  the region covers into one temporary buffer and ``copy_`` the strided view into the
  destination (which also casts and moves to the device);
- **fallback**: a chunk that is not a plain uncompressed tensor archive, or a checkpoint using
  DCP storage transforms, goes through ``torch.load`` as DCP does (after
  `decode.check_archive`: its entries' own CRCs, none compressed).

Files are read by up to ``thread_count`` threads (one file per thread; ``preadv`` releases
the GIL). A short read (a truncated file) raises `OSError` naming the file. The counts of
items per path are kept in `ShardworkReader.stats` (per instance) for tests and profiling.

Verification (``records``: the per-file ``{"size", "crc32"}`` of ``shardwork.json``): every
range read is folded into its file's CRC-32 as it is read (`integrity.FileCheck`, which also
reads the gaps), and the file is compared with its record once its items are served. A
mismatch is not raised here (one rank raising inside DCP's read step would give the other
ranks a generic error): it is appended to `ShardworkReader.corrupt`, and `load` agrees on
the union of every rank's findings. A read that fails on a file that differs from its record
(a truncated file, a header whose flipped byte breaks parsing) is reported the same way; one
that fails on an intact file is re-raised. ``.metadata`` is checked against its record before
it is decoded. Warnings raised while reading (torch warns about some damaged pickles) reach
the caller only if every file read matched its record.

Nothing in the checkpoint runs code or reaches outside it: ``.metadata`` is decoded with an
allow-list (`decode.decode_metadata`), every file name and byte range it records is checked
against the directory and the files' sizes (`confine.check_storage_ranges`), and object
records are decoded (allow-list, `decode.decode_object` through the planner) in a first pass
before any tensor is read, so a refused record stops the load before a destination is touched.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import threading
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shardwork.dist_checkpoint.blob import HEAD_BYTES, StoredTensor, parse_tensor_blob
from shardwork.dist_checkpoint.checksum import crc32
from shardwork.dist_checkpoint.confine import check_storage_ranges
from shardwork.dist_checkpoint.decode import check_archive, decode_metadata
from shardwork.dist_checkpoint.integrity import FileCheck, file_problem, mismatch
from shardwork.dist_checkpoint.metadata import (
    DCP_METADATA_FILE,
    CheckpointCorruptError,
    CheckpointRefusedError,
)

__all__ = ["ShardworkReader"]

_IOV_MAX = 1024  # Linux's limit on buffers per preadv
_MIN_RUN_BYTES = 4096  # below this a staged read + strided copy is cheaper than many iovecs


def _pread(fd: int, size: int, offset: int, name: str) -> bytes:
    """Exactly ``size`` bytes at ``offset`` (OSError naming ``name`` if the file is short)."""
    parts = []
    done = 0
    # pread may return fewer bytes than asked (a short read): loop until done or end of file.
    while done < size:
        block = os.pread(fd, size - done, offset + done)
        if not block:
            raise OSError(f"{name}: file ends at byte {offset + done}, expected {offset + size}")
        parts.append(block)
        done += len(block)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _readinto(fd: int, view: memoryview, offset: int, name: str) -> None:
    """Fill ``view`` (bytes) from ``offset``; OSError naming ``name`` if the file is short."""
    done, size = 0, view.nbytes
    while done < size:
        # Short reads again: continue into the rest of the view.
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{name}: file ends at byte {offset + done}, expected {offset + size}")
        done += n


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _dense(lengths: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a region of ``lengths`` with element strides ``stride`` is one dense block."""
    return _dense_suffix(lengths, stride) == 0


def _dense_suffix(lengths: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Smallest ``k`` such that dims ``k:`` of the region are packed densely (row-major)."""
    expected = 1
    for k in range(len(lengths) - 1, -1, -1):
        if lengths[k] != 1 and stride[k] != expected:
            return k + 1
        expected *= lengths[k]
    return 0


def _runs(dest: torch.Tensor, k: int) -> list[memoryview]:
    """Byte views of ``dest``'s dense runs (dims ``k:`` packed), in row-major order."""
    item = dest.element_size()
    # A byte view of dest's whole storage, so runs can be addressed by dest's storage offsets.
    storage = torch.empty(0, dtype=torch.uint8).set_(dest.untyped_storage())
    whole = memoryview(storage.numpy()).cast("B")
    run = math.prod(dest.shape[k:]) * item
    outer = dest.shape[:k]
    runs = []
    for idx in itertools.product(*(range(n) for n in outer)):
        start = (dest.storage_offset() + sum(i * s for i, s in zip(idx, dest.stride()))) * item
        runs.append(whole[start : start + run])
    return runs


def _done() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


def _scatter(fd: int, runs: list[memoryview], offset: int, name: str) -> None:
    """Fill ``runs`` in order from consecutive bytes at ``offset`` (``preadv``, batched)."""
    for first in range(0, len(runs), _IOV_MAX):
        batch = runs[first : first + _IOV_MAX]
        done = os.preadv(fd, batch, offset)
        for view in batch:
            got = min(max(done, 0), view.nbytes)
            if got < view.nbytes:  # a short read: finish this run on its own
                _readinto(fd, view[got:], offset + got, name)
            done -= view.nbytes
            offset += view.nbytes


class ShardworkReader(FileSystemReader):
    """`FileSystemReader` (same files, same metadata) with direct reads into destinations.

    Args:
        path: checkpoint directory.
        thread_count: files read concurrently (each by one thread).
        records: recorded ``{file name: {"size", "crc32"}}`` to verify what is read against
            (None: no verification; files without a record are not verified).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int = 1,
        records: dict[str, dict[str, int]] | None = None,
    ) -> None:
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count={thread_count!r} is not valid; valid: an int >= 1")
        super().__init__(path)
        self.thread_count = thread_count
        self.stats: Counter[str] = Counter()
        #: ``(file, how it differs from its record)`` for each bad file (see the module doc)
        self.corrupt: list[tuple[str, str]] = []
        self._records = records or {}
        self._stats_lock = threading.Lock()
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        """DCP's metadata, read once, checked against its record, then decoded.

        Raises `CheckpointCorruptError` naming the file when its size or CRC-32 differs from
        the record, `CheckpointRefusedError` when it names a global outside the allow-list or
        a file or byte range outside the checkpoint (`load` makes every rank raise either).
        """
        if self._metadata is None:
            raw = (Path(self.path) / DCP_METADATA_FILE).read_bytes()
            record = self._records.get(DCP_METADATA_FILE)
            problem = record and mismatch(DCP_METADATA_FILE, len(raw), crc32(raw), record)
            if problem:
                raise CheckpointCorruptError(
                    f"checkpoint {str(self.path)!r} is corrupt: {problem}",
                    checkpoint=str(self.path),
                    files=(DCP_METADATA_FILE,),
                )
            self._metadata = decode_metadata(raw, name=str(Path(self.path) / DCP_METADATA_FILE))
            check_storage_ranges(Path(self.path), self._metadata.storage_data or {})
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` (see the module docstring for the paths taken)."""
        if any(self.storage_data[r.storage_index].transform_descriptors for r in plan.items):
            with self._stats_lock:
                self.stats["fallback"] += len(plan.items)
            # not verified: only DCP's own writer with extensions writes transforms, and its
            # checkpoints have no shardwork.json, hence no records (load refuses them anyway)
            return super().read_data(plan, planner)
        # Torch decodes some damaged pickles with a warning that asks the user to file a torch
        # issue; next to the corruption error that follows it would only mislead. So warnings
        # raised while reading are held (from every reader thread: the filter state is
        # process-wide) and passed on only if no file this rank read differs from its record.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._read_all(self._by_file(plan.items), planner)
        for w in caught if not self.corrupt else ():
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        return _done()

    def _read_all(self, per_file: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        """Object records first (`_decode_objects`), then every file's tensors, ``thread_count``
        files at a time."""
        self._decode_objects(per_file, planner)
        if self.corrupt:  # a damaged object record: do not fill tensors from this checkpoint
            return
        jobs = list(per_file.items())
        threads = min(self.thread_count, len(jobs))
        if threads <= 1:
            for relative_path, reqs in jobs:
                self._read_file(relative_path, reqs, planner)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="shardwork-ckpt-reader") as pool:
            futures = [pool.submit(self._read_file, p, reqs, planner) for p, reqs in jobs]
            for f in futures:
                f.result()

    def _by_file(self, items: list[ReadItem]) -> dict[str, list[ReadItem]]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        return per_file

    def _decode_objects(self, per_file: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        """First pass: read and decode every object record (small) into the planner.

        A record that does not decode, in a file that differs from its record, is reported
        as corruption (as a failed read is); in an intact file it is refused, naming the file.
        The second pass folds these bytes into the file's CRC without decoding them again.
        """
        for relative_path, reqs in per_file.items():
            objects = [r for r in reqs if r.type == LoadItemType.BYTE_IO]
            if not objects:
                continue
            path = Path(self.path) / relative_path
            fd = os.open(path, os.O_RDONLY)
            try:
                for req in objects:
                    info = self.storage_data[req.storage_index]
                    blob = _pread(fd, info.length, info.offset, relative_path)
                    planner.load_bytes(req, io.BytesIO(blob))
            except (CheckpointRefusedError, OSError) as exc:
                record = self._records.get(relative_path)
                problem = file_problem(path, relative_path, record) if record else None
                if problem is not None:
                    self._report(relative_path, problem)
                    continue
                raise CheckpointRefusedError(
                    f"{relative_path}: {exc}", checkpoint=str(self.path), files=(relative_path,)
                ) from None
            finally:
                os.close(fd)

    def _report(self, name: str, problem: str | None) -> None:
        if problem is not None:
            with self._stats_lock:
                self.corrupt.append((name, problem))

    def _read_file(self, relative_path: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        """Serve ``reqs`` from one file; report it if it differs from its record."""
        path = self.fs.concat_path(self.path, relative_path)
        record = self._records.get(relative_path)
        try:
            self._report(
                relative_path, self._read_items(path, relative_path, record, reqs, planner)
            )
        except Exception:
            problem = file_problem(path, relative_path, record) if record else None
            if problem is None:
                raise
            self._report(relative_path, problem)

    def _read_items(
        self,
        path: str | os.PathLike,
        relative_path: str,
        record: dict[str, int] | None,
        reqs: list[ReadItem],
        planner: LoadPlanner,
    ) -> str | None:
        """Read ``reqs`` in file order; return the file's mismatch with ``record`` (or None)."""
        reqs = sorted(
            reqs,
            key=lambda r: (self.storage_data[r.storage_index].offset, tuple(r.storage_offsets)),
        )
        counts: Counter[str] = Counter()
        layouts: dict[int, StoredTensor | None] = {}
        fd = os.open(path, os.O_RDONLY)
        check = FileCheck(fd, relative_path, record) if record is not None else None
        try:
            # Requests are read in file order: let the kernel read ahead.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:  # decoded by `_decode_objects` already
                    if check is not None:
                        check.add(info.offset, _pread(fd, info.length, info.offset, relative_path))
                    counts["bytes"] += 1
                    continue
                if info.offset not in layouts:
                    head = _pread(fd, min(HEAD_BYTES, info.length), info.offset, relative_path)
                    if check is not None:
                        check.add(info.offset, head)
                    layouts[info.offset] = parse_tensor_blob(head, info.length)
                stored = layouts[info.offset]
                dest = planner.resolve_tensor(req).detach()
                if tuple(dest.shape) != tuple(req.lengths):
                    raise AssertionError(
                        f"read item {req.storage_index} has lengths {tuple(req.lengths)}, "
                        f"destination {tuple(dest.shape)}"
                    )
                if stored is None:
                    blob = _pread(fd, info.length, info.offset, relative_path)
                    if check is not None:
                        check.add(info.offset, blob)
                        # A chunk our parser cannot read is, in a checkpoint we wrote, a damaged
                        # one: check the whole file before torch.load decodes it, since a flipped
                        # size in its pickle makes torch allocate that size (20-27 GB seen).
                        problem = file_problem(path, relative_path, record)
                        if problem is not None:
                            return problem
                    # Also without records: the archive's own CRCs and no compressed entry
                    # (one could expand to any size), then weights_only (no arbitrary objects).
                    stream = io.BytesIO(blob)
                    check_archive(stream, f"{relative_path} at byte {info.offset}")
                    tensor = torch.load(stream, map_location="cpu", weights_only=True)
                    for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                        tensor = tensor.narrow(dim, o, n)
                    dest.copy_(tensor)
                    counts["fallback"] += 1
                else:
                    counts[
                        self._copy_region(fd, info.offset, stored, req, dest, relative_path, check)
                    ] += 1
                planner.commit_tensor(req, dest)
            problem = check.finish() if check is not None else None
        finally:
            os.close(fd)
        with self._stats_lock:
            self.stats.update(counts)
        return problem

    @staticmethod
    def _copy_region(
        fd: int,
        blob_offset: int,
        stored: StoredTensor,
        req: ReadItem,
        dest: torch.Tensor,
        name: str,
        check: FileCheck | None,
    ) -> str:
        """Read the region ``req`` names of ``stored`` into ``dest`` (folding the bytes read
        into ``check``); return the path taken."""
        lengths = tuple(req.lengths)
        if len(lengths) != len(stored.size):
            raise AssertionError(f"read item {req.storage_index} rank differs from the saved chunk")
        if math.prod(lengths) == 0:
            return "empty"
        item = stored.dtype.itemsize
        first = stored.storage_offset + sum(
            o * s for o, s in zip(req.storage_offsets, stored.stride)
        )
        start = blob_offset + stored.data_offset + first * item
        if (
            _dense(lengths, stored.stride)
            and dest.device.type == "cpu"
            and dest.dtype == stored.dtype
        ):
            if dest.is_contiguous():
                view = _bytes_of(dest)
                _readinto(fd, view, start, name)
                if check is not None:
                    check.add(start, view)
                return "direct"
            k = _dense_suffix(lengths, dest.stride())
            if math.prod(lengths[k:]) * item >= _MIN_RUN_BYTES:
                runs = _runs(dest, k)
                _scatter(fd, runs, start, name)
                if check is not None:  # the runs hold consecutive bytes of the file
                    for run in runs:
                        check.add(start, run)
                        start += run.nbytes
                return "scatter"
        span = sum((n - 1) * s for n, s in zip(lengths, stored.stride)) + 1
        buffer = torch.empty(span * item, dtype=torch.uint8)
        _readinto(fd, _bytes_of(buffer), start, name)
        if check is not None:
            check.add(start, _bytes_of(buffer))
        src = buffer.view(stored.dtype).as_strided(lengths, stored.stride)
        dest.copy_(src)
        return "staged"
