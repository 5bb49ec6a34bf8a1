"""`save`: write a sharded state dict with torch.distributed.checkpoint, sync or async.

Phases (each timed, see `SaveResult.timings`):

1. **plan** (training thread, ``group``): sort the leaves (a sync save pickles its objects and
   plain values now, so a value that does not pickle is refused on every rank with its path
   before anything is touched; the bytes are what is written), gather a small description of
   every rank's pieces on the first rank, which validates globally and chooses one writer per
   distinct rectangle for all ranks at once (`plan.build_rank_plans`), then scatters to each
   rank only its writes, or the error that every rank then raises before anything is touched;
   the first rank clears the target directory (only an incomplete one, or a complete one with
   ``overwrite=True``) and everyone passes a barrier.
2. **stage** (async only, training thread): copy this rank's write pieces to host memory
   (pinned for CUDA tensors) and pickle its objects. After this the caller may modify the state.
3. **write**: `torch.distributed.checkpoint.save` with a planner that writes exactly the chosen
   pieces (`planners.PlannedSavePlanner`) and a writer that checksums every file inline
   (`storage.ShardworkWriter`). Async: on a background thread whose DCP collectives use a
   dedicated gloo group, never the training group.
4. **finalize** (training thread): all ranks exchange success/failure and file checksums; only
   if every rank succeeded does the first rank write ``shardwork.json`` and then the
   ``COMMITTED`` marker; the outcome is broadcast so every rank returns or raises together.
   For async saves this runs in `AsyncSave.finalize`; a background failure is raised there.

A second save waits for the first: an async save is *in flight* until its `AsyncSave.finalize`
ran (marker file in its directory, see `inflight`; its `StagingBuffers` held). ``save(...,
previous=handle)`` finalizes the earlier save first; a save without it while one of this
process is in flight in the same root, or with held buffers, raises ValueError before touching
anything, so two saves never overlap silently.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from shardwork.dist_checkpoint import metadata as md
from shardwork.dist_checkpoint.comm import (
    GroupInfo,
    all_gather_object,
    barrier,
    broadcast_object,
    gather_object,
    resolve_group,
    scatter_object,
)
from shardwork.dist_checkpoint.faults import fault_point
from shardwork.dist_checkpoint.inflight import (
    IN_FLIGHT_MARKER,
    clear_in_flight,
    in_flight_here,
    mark_in_flight,
)
from shardwork.dist_checkpoint.layout import describe_layout, group_ranks
from shardwork.dist_checkpoint.plan import (
    COMMON_KEY,
    LocalState,
    RankAssignment,
    build_rank_plans,
    collect_local,
    summarize,
)
from shardwork.dist_checkpoint.planners import PlannedSavePlanner
from shardwork.dist_checkpoint.staging import StagingBuffers, stage
from shardwork.dist_checkpoint.storage import DATA_SUFFIX, ShardworkWriter, file_crc32
from shardwork.dist_checkpoint.tree import path_str

__all__ = ["AsyncSave", "CheckpointSaveError", "SaveResult", "StagingBuffers", "save"]


class CheckpointSaveError(RuntimeError):
    """A save failed on at least one rank; the checkpoint was not committed."""


@dataclass
class SaveResult:
    """Outcome of a committed save, the same object on every rank except the byte counts.

    Attributes:
        path: the checkpoint directory.
        timings: seconds per phase on this rank: ``plan``, ``stage``, ``write``, ``finalize``,
            and ``blocking`` (time the caller's thread was blocked in `save`).
        bytes_written: bytes of tensor data this rank wrote.
        bytes_per_rank: bytes of tensor data each rank wrote.
    """

    path: Path
    timings: dict[str, float]
    bytes_written: int
    bytes_per_rank: list[int] = field(default_factory=list)


@dataclass
class _Job:
    """Everything a save needs after planning (shared by the sync path and the thread)."""

    path: Path
    g: GroupInfo
    write_g: GroupInfo
    plan: RankAssignment
    items: list[WriteItem]
    data: dict[tuple[str, Any], Any]
    thread_count: int
    sync_files: bool
    info: dict[str, Any]
    timings: dict[str, float]
    owned_group: Any = None
    staging_buffers: StagingBuffers | None = None
    error: str | None = None
    checksums: dict[str, dict[str, int]] = field(default_factory=dict)


def _is_checkpoint_file(name: str) -> bool:
    # A crash during an atomic write leaves ``<name>.tmp``: still ours, so still clearable.
    base = name.removesuffix(".tmp")
    return base.endswith(DATA_SUFFIX) or base in (
        md.DCP_METADATA_FILE,
        md.INFO_FILE,
        md.COMMIT_MARKER,
        IN_FLIGHT_MARKER,
    )


def _inspect_target(path: Path, overwrite: bool) -> str | None:
    """Error text if ``path`` must not be written (checked by the first rank only)."""
    if path.exists() and not path.is_dir():
        return f"path={str(path)!r} exists and is not a directory; valid: a directory path"
    if path.is_dir():
        # The directory is removed before writing: refuse to delete files a save did not make.
        foreign = sorted(p.name for p in path.iterdir() if not _is_checkpoint_file(p.name))
        if foreign:
            return (
                f"path={str(path)!r} holds files that are not checkpoint files ({foreign[:5]}); "
                f"valid: a new, empty or checkpoint directory (it is cleared before writing)"
            )
    if md.is_committed(path) and not overwrite:
        return (
            f"path={str(path)!r} already holds a committed checkpoint; valid: a new or "
            f"incomplete directory, or overwrite=True"
        )
    pending = in_flight_here(path)
    if pending:
        return (
            f"the async save to {str(pending[0])!r} in the same root is not finalized; a second "
            f"save waits for the first: pass previous=<its AsyncSave> (save finalizes it "
            f"first) or call its finalize() before saving to path={str(path)!r}"
        )
    return None


def _clear_target(path: Path) -> None:
    """Make ``path`` an empty directory; drop the commit marker first so a crash mid-way
    leaves a directory that is recognisably incomplete."""
    if path.exists():
        marker = path / md.COMMIT_MARKER
        if marker.exists():
            marker.unlink()
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


def _write_items(
    local: Any, plan: RankAssignment, rank: int, pickled: dict[str, bytes]
) -> tuple[list, dict]:
    """This rank's DCP write items and the data behind each (for a byte item, its bytes from
    ``pickled`` when there: `_pickle_byte_items`)."""
    items: list[WriteItem] = []
    data: dict[tuple[str, Any], Any] = {}
    wanted = set(plan.mine_tensors)
    for _, st, pieces in local.tensors:
        dtype = st.data.dtype
        size = torch.Size(st.global_shape)
        if st.key in plan.mine_empty:
            # A zero-element tensor has no piece to tile: one rank writes an empty item so the key
            # and its shape still appear in DCP's metadata.
            plan.mine_empty.discard(st.key)
            offsets = torch.Size([0] * len(size))
            pieces_to_write = [(offsets, size, torch.empty(size, dtype=dtype))]
        else:
            pieces_to_write = []
            for piece in pieces:
                ident = (st.key, piece.box[0])
                if ident in wanted:
                    wanted.discard(ident)
                    pieces_to_write.append(
                        (torch.Size(piece.box[0]), torch.Size(piece.box[1]), piece.view)
                    )
        for offsets, sizes, view in pieces_to_write:
            items.append(
                WriteItem(
                    index=MetadataIndex(st.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=dtype),
                        size=size,
                    ),
                )
            )
            data[(st.key, tuple(offsets))] = view
    assert not wanted, f"planned pieces not found locally: {sorted(wanted)[:3]}"
    for _, obj in local.objects:
        if obj.unique_key in plan.mine_objects:
            plan.mine_objects.discard(obj.unique_key)
            items.append(WriteItem(index=MetadataIndex(obj.unique_key), type=WriteItemType.BYTE_IO))
            data[(obj.unique_key, None)] = pickled.get(obj.unique_key, obj.data)
    # Plain values are taken from the first rank only.
    if rank == 0:
        common = {path_str(path): value for path, value in local.plain}
        items.append(WriteItem(index=MetadataIndex(COMMON_KEY), type=WriteItemType.BYTE_IO))
        data[(COMMON_KEY, None)] = pickled.get(COMMON_KEY, common)
    return items, data


def _pickled(value: Any) -> bytes:
    """``value`` as the writer stores a byte item (`planners.PlannedSavePlanner`)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the pickling error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= 80 else text[:77] + "..."


def _unpicklable(what: str, value: Any, exc: BaseException) -> str:
    return (
        f"{what}={_short_repr(value)} cannot be pickled ({type(exc).__name__}: {exc}); valid: "
        f"a picklable value (plain values and ShardedObject data are pickled into the checkpoint)"
    )


def _pickle_byte_items(local: LocalState, rank: int) -> tuple[dict[str, bytes], str | None]:
    """Pickle, before anything is planned or touched, what a sync save writes as byte items:
    this rank's primary objects and, on the first rank, the plain values (taken from it only).

    Returns the bytes by DCP key, handed to the write so that each is pickled once, or the
    error text naming the first value that does not pickle and its path in the state (the
    first rank refuses the save on every rank with it: `_plan_on_first_rank`).
    """
    pickled: dict[str, bytes] = {}
    for path, obj in local.objects:
        if obj.replica_id != 0:  # only the primary is written
            continue
        try:
            pickled[obj.unique_key] = _pickled(obj.data)
        except Exception as exc:
            return {}, _unpicklable(
                f"state[{path_str(path)!r}] (ShardedObject {obj.key!r}).data", obj.data, exc
            )
    if rank != 0:
        return pickled, None
    try:
        pickled[COMMON_KEY] = _pickled({path_str(path): value for path, value in local.plain})
    except Exception as whole:
        for path, value in local.plain:  # which value: the first that fails on its own
            try:
                _pickled(value)
            except Exception as exc:
                return {}, _unpicklable(f"state[{path_str(path)!r}]", value, exc)
        problem = f"{type(whole).__name__}: {whole}"
        return {}, f"the plain values of the state cannot be pickled together ({problem})"
    return pickled, None


def _run_write(job: _Job) -> None:
    """Phase 3; records an error instead of raising (it may run on a background thread)."""
    start = time.perf_counter()
    writer = ShardworkWriter(
        job.path, rank=job.g.rank, thread_count=job.thread_count, sync_files=job.sync_files
    )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                {},
                storage_writer=writer,
                planner=PlannedSavePlanner(job.items, job.data),
                process_group=job.write_g.pg,
                no_dist=not job.write_g.distributed,
            )
    # Recorded, not raised: every rank must still reach finalize's all-gather, which reports the
    # error on all ranks (a rank raising here would leave the others waiting there).
    except (Exception, CheckpointException) as exc:  # reported to all ranks at finalize
        job.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
    job.checksums = dict(writer.checksums)
    job.data = {}  # drop staged copies as soon as they are on disk
    job.timings["write"] = time.perf_counter() - start


def _finalize(job: _Job, agree_g: GroupInfo) -> SaveResult:
    """Phase 4 (training thread): agree, commit on the first rank, broadcast the outcome."""
    start = time.perf_counter()
    mine = {
        "error": job.error,
        "files": job.checksums,
        "bytes": job.plan.nbytes,
        "timings": {k: job.timings.get(k, 0.0) for k in ("plan", "stage", "write")},
    }
    everyone = all_gather_object(mine, agree_g)
    failed = {r: m["error"] for r, m in enumerate(everyone) if m["error"]}
    if job.g.rank == 0:
        # The all-gather above returned, so every rank's write has ended.
        clear_in_flight(job.path)  # every rank's write has ended
    if failed:
        text = "\n".join(f"--- rank {r} ---\n{err}" for r, err in sorted(failed.items()))
        raise CheckpointSaveError(
            f"save to {str(job.path)!r} failed on ranks {sorted(failed)}; the checkpoint was "
            f"not committed:\n{text}"
        )
    outcome: str | None = None
    if agree_g.rank == 0:
        try:
            fault_point("before_commit", job.g.rank)
            files: dict[str, dict[str, int]] = {}
            for m in everyone:
                files.update(m["files"])
            # DCP's ``.metadata`` is written by the base class's finish, outside the inline
            # checksums.
            size, crc = file_crc32(job.path / md.DCP_METADATA_FILE)
            files[md.DCP_METADATA_FILE] = {"size": size, "crc32": crc}
            # A phase took as long as its slowest rank.
            phases = {k: max(m["timings"][k] for m in everyone) for k in ("plan", "stage", "write")}
            md.write_commit(job.path, {**job.info, "files": files, "timings": phases})
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    # Every rank learns the commit's outcome, so all return or all raise together.
    outcome = broadcast_object(outcome, agree_g)
    if outcome is not None:
        raise CheckpointSaveError(f"commit of {str(job.path)!r} failed on rank 0: {outcome}")
    job.timings["finalize"] = time.perf_counter() - start
    # Each rank knows only its own bytes from planning; the agreement brings everyone's.
    return SaveResult(job.path, dict(job.timings), job.plan.nbytes, [m["bytes"] for m in everyone])


def _user_error(
    summaries: list[dict[str, Any]], path: Path, overwrite: bool
) -> tuple[str, str] | None:
    """The first rank's verdict on a mistake found before planning: a value that does not
    pickle on some rank (``"unpicklable"``, raised as TypeError), or a target that must not
    be written (``"invalid"``, ValueError); None if neither."""
    for rank, summary in enumerate(summaries):
        problem = summary.get("unpicklable")
        if problem is not None:
            where = f" (on rank {rank})" if len(summaries) > 1 else ""
            return "unpicklable", f"save to {str(path)!r}: {problem}{where}; nothing was written"
    error = _inspect_target(path, overwrite)
    return None if error is None else ("invalid", error)


def _plan_on_first_rank(
    summary: dict[str, Any], path: Path, overwrite: bool, g: GroupInfo
) -> tuple[RankAssignment, dict[str, Any]]:
    """Gather the summaries on the first rank, plan there, scatter each rank its writes.

    The first rank checks the target directory and the summaries; its verdict (each rank's
    `RankAssignment`, or an error text) is scattered, so every rank raises the same ValueError
    (TypeError for a value a sync save cannot pickle) before anything is touched (an unexpected failure there: `CheckpointSaveError` on the
    others, the original exception on the first rank). Returns this rank's writes and, on the first rank only, the
    plan's part of ``shardwork.json`` (catalogue, plain paths, bytes per rank; {} elsewhere).
    """
    summaries = gather_object(summary, g)
    outgoing: list[Any] | None = None
    record: dict[str, Any] = {}
    crash: Exception | None = None
    if summaries is not None:
        error: tuple[str, str] | None = None
        try:
            error = _user_error(summaries, path, overwrite)
            if error is None:
                plan, shares = build_rank_plans(summaries)
        except ValueError as exc:
            error = ("invalid", str(exc))
        except Exception as exc:
            # Not a user error, but the others must not wait in the scatter for a plan.
            crash = exc
        if crash is not None:
            text = f"planning on the first rank failed: {type(crash).__name__}: {crash}"
            outgoing = [("failed", text)] * g.size
        elif error is not None:
            outgoing = [error] * g.size
        else:
            outgoing = [("ok", share) for share in shares]
            record = {
                "keys": plan.catalogue,
                "plain_paths": plan.plain_paths,
                "bytes_per_rank": plan.bytes_per_rank,
            }
        del summaries
    verdict, mine = scatter_object(outgoing, g)
    if crash is not None:
        raise crash
    if verdict == "invalid":
        raise ValueError(mine)
    if verdict == "unpicklable":
        raise TypeError(mine)
    if verdict == "failed":
        raise CheckpointSaveError(f"save to {str(path)!r}: {mine}; nothing was written")
    return mine, record


def _stage_on_every_rank(
    data: dict, staging_buffers: StagingBuffers | None, path: Path, g: GroupInfo
) -> dict:
    """`stage`, then agree over ``g`` that every rank staged: one rank failing (out of pinned
    memory, an object that does not pickle) makes every rank raise here, before any
    background write starts; otherwise the others' writes would wait in DCP's collectives for
    a rank that never joins."""
    error: BaseException | None = None
    try:
        staged = stage(data, staging_buffers)
    except Exception as exc:
        error = exc
    # Every rank joins this all-gather, a failed one too; raising comes after.
    failed = [r for r, bad in enumerate(all_gather_object(error is not None, g)) if bad]
    if error is not None:
        raise error
    if failed:
        raise CheckpointSaveError(
            f"async save to {str(path)!r}: staging failed on rank(s) {failed} of the group; "
            "nothing was written and the checkpoint is not committed"
        )
    return staged


class AsyncSave:
    """Handle of an async save whose write runs on a background thread.

    Call `finalize` on the training thread (on every rank of the group) to wait for the
    write, agree across ranks and commit; it raises `CheckpointSaveError` if any rank's
    background write failed. `done` tells, without blocking, whether this rank's write ended.

    Until `finalize` ran, the save is *in flight*: its directory holds the ``ASYNC_IN_FLIGHT``
    marker and its `StagingBuffers` are held, and a later `save` of this process into the
    same root, or with the same buffers, is refused unless it gets this handle as
    ``previous=`` (it then finalizes it first: a second save waits for the first).
    """

    def __init__(self, job: _Job) -> None:
        self._job = job
        self._result: SaveResult | None = None
        self._finalize_started = False
        if job.g.rank == 0:
            mark_in_flight(job.path)
        if job.staging_buffers is not None:
            job.staging_buffers.hold(self)
        self._thread = threading.Thread(
            target=_run_write, args=(job,), name="shardwork-ckpt-writer", daemon=True
        )
        self._thread.start()

    @property
    def path(self) -> Path:
        return self._job.path

    @property
    def finalized(self) -> bool:
        """Whether `finalize` has run (committed, or raised the save's error)."""
        return self._finalize_started

    def done(self) -> bool:
        """Whether this rank's background write has ended (successfully or not)."""
        return not self._thread.is_alive()

    def finalize(self) -> SaveResult:
        """Block until the write ended, agree across ranks and commit.

        Idempotent once it succeeded. If it raised, the save is over (not committed): a later
        call raises `CheckpointSaveError` again without communicating.
        """
        if self._result is not None:
            return self._result
        if self._finalize_started:
            raise CheckpointSaveError(
                f"the async save to {str(self.path)!r} already failed at finalize; it was "
                f"not committed"
            )
        self._finalize_started = True
        self._thread.join()
        try:
            self._result = _finalize(self._job, self._job.write_g)
        finally:
            self._release()
        return self._result

    def _release(self) -> None:
        """The save is over: free its buffers, marker and owned background group."""
        job = self._job
        if job.staging_buffers is not None:
            job.staging_buffers.release(self)
        if job.g.rank == 0:
            clear_in_flight(job.path)
        if job.owned_group is not None:
            dist.destroy_process_group(job.owned_group)
            job.owned_group = None


def save(
    state: Any,
    path: str | os.PathLike,
    *,
    group: Any = None,
    async_save: bool = False,
    thread_count: int = 1,
    async_group: Any = None,
    content_version: int | str | None = None,
    layout: Any = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    sync_files: bool = True,
    staging_buffers: StagingBuffers | None = None,
    previous: AsyncSave | None = None,
) -> SaveResult | AsyncSave:
    """Save a sharded state dict to the directory ``path`` (collective over ``group``).

    Args:
        state: nested dicts/lists of `ShardedTensor`, `ShardedObject` and plain values. Plain
            values are taken from the group's first rank.
        path: checkpoint directory; must be new, incomplete, or ``overwrite=True``.
        group: the ranks that hold the state (None: world, or one process without
            torch.distributed). Used on the calling thread only.
        async_save: return an `AsyncSave` right after staging; the write runs in background.
        thread_count: writer threads (and data files) per rank.
        async_group: a gloo group over the same ranks for the background collectives; when
            None one is created (``new_group``, local synchronisation) and destroyed at
            finalize. `CheckpointManager` creates one and reuses it.
        content_version, layout, metadata: recorded in ``shardwork.json``. ``layout`` is the
            parallel layout the state was saved at: a mapping (``{"tp": 2, "pp": 2}``) or any
            object with the sizes as attributes, e.g. the ``ProcessGroups`` bundle (see
            `layout.describe_layout`). The group's size and global ranks are always recorded.
        overwrite: allow replacing a committed checkpoint at ``path``.
        sync_files: fsync data files (needed for crash safety; off only for benchmarks).
        staging_buffers: reuse these host buffers for async staging; refused while an
            unfinalized async save holds them (unless it is ``previous``).
        previous: an earlier async save of this group; it is finalized first (collective,
            raising its error if its background write failed), so the two never overlap.
            Without it, a save while an async save of this process is in flight in the same
            root (or holds ``staging_buffers``) raises ValueError before anything is touched.

    Returns:
        `SaveResult` once committed (sync), or an `AsyncSave` handle (async).

    Raises:
        ValueError: an invalid argument, target directory or layout of shards (every rank,
            before anything is written).
        TypeError: (sync) a plain value or `ShardedObject` data that cannot be pickled,
            named by its path in ``state`` (every rank, before anything is written; an async
            save finds it while staging: see `_stage_on_every_rank`).
        CheckpointSaveError: the write or the commit failed on some rank.
    """
    if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
        raise ValueError(f"thread_count={thread_count!r} is not valid; valid: an int >= 1")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path={path!r} is not valid; valid: a str or os.PathLike directory")
    if previous is not None and not isinstance(previous, AsyncSave):
        raise ValueError(
            f"previous={previous!r} is not valid; valid: None or the AsyncSave of an earlier save"
        )
    layout_record = describe_layout(layout)
    path = Path(path)
    g = resolve_group(group)
    if previous is not None and not previous.finalized:
        previous.finalize()  # a second save waits for the first
    if async_save and staging_buffers is not None and staging_buffers.holder is not None:
        raise ValueError(
            f"staging_buffers are held by the async save to {str(staging_buffers.holder.path)!r}, "
            f"which is not finalized; valid: pass previous=<its AsyncSave> or finalize it first"
        )
    blocking_start = time.perf_counter()
    timings: dict[str, float] = {"stage": 0.0}

    local = collect_local(state)
    summary = summarize(local)
    pickled: dict[str, bytes] = {}
    if not async_save:  # (an async save pickles while staging, before its write starts)
        pickled, summary["unpicklable"] = _pickle_byte_items(local, g.rank)
    share, record = _plan_on_first_rank(summary, path, overwrite, g)
    if g.rank == 0:
        _clear_target(path)
    # No rank may write into the directory before the first rank has cleared it.
    barrier(g)
    items, data = _write_items(local, share, g.rank, pickled)
    timings["plan"] = time.perf_counter() - blocking_start

    info = {
        "content_version": content_version,
        "layout": layout_record,
        "user_metadata": dict(metadata) if metadata is not None else None,
        "world_size": g.size,
        "group_ranks": group_ranks(g),
        "thread_count": thread_count,
        **record,
    }
    job = _Job(path, g, g, share, items, data, thread_count, sync_files, info, timings)
    job.staging_buffers = staging_buffers if async_save else None
    if not async_save:
        _run_write(job)
        result = _finalize(job, g)
        result.timings["blocking"] = time.perf_counter() - blocking_start
        return result

    stage_start = time.perf_counter()
    job.data = _stage_on_every_rank(data, staging_buffers, path, g)
    timings["stage"] = time.perf_counter() - stage_start
    if g.distributed:
        if async_group is None:
            ranks = dist.get_process_group_ranks(g.pg)
            # Background collectives get their own group: issued from another thread on the training
            # group, they could interleave differently with the training thread's collectives on
            # each rank. use_local_synchronization: only the member ranks take part in creating it.
            async_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
            job.owned_group = async_group
        job.write_g = resolve_group(async_group)
    handle = AsyncSave(job)
    timings["blocking"] = time.perf_counter() - blocking_start
    return handle
