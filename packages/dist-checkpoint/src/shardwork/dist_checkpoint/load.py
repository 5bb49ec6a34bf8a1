"""`load`: fill a template sharded state dict from a checkpoint saved at any layout.

- Every template `ShardedTensor` asks for its rectangles (a flat range asks for the boxes of
  `boxes.flat_range_boxes`, read straight into views of its flat tensor); DCP intersects them
  with the saved chunks, so any layout loads into any other (TP/PP/EP/DP changes, flat
  optimizer shards at another DP size, 1 rank to 8 and back).
- Key checks (`keycheck`) run before any data is read, and every rank's findings are
  all-gathered so all ranks raise the same `CheckpointMismatchError`: *missing* (in the
  template, not in the checkpoint), *unexpected* (in the checkpoint, in no rank's template),
  *mismatch* (global shape, kind of leaf, or kind of dtype differs: a float checkpoint
  tensor is not loaded into an integer or bool template tensor, see `keycheck.dtype_kind`). ``strict=True`` raises on missing and
  unexpected, ``strict="missing"`` only on missing, ``strict=False`` on neither (missing
  entries keep the template's values). Mismatches always raise.
- ``key_filter(path, key)`` restricts the load to some leaves (granular loads); the others are
  returned as the template has them, and unexpected keys are judged among the saved keys whose
  recorded path passes the same filter.
- Data are read by `reader.ShardworkReader` (same files as DCP's reader): each file once, in
  order, straight into the template's memory where a saved chunk covers a destination as one
  dense byte range; ``thread_count`` files at a time.
- Verification (``verify=True``, the default): ``shardwork.json`` is checked against the
  commit marker's CRC-32, ``.metadata`` against its record before it is decoded, and every
  data file this rank reads against its recorded size and CRC-32 as it is read (the reader
  folds each range into the file's CRC). Every rank's findings are all-gathered after the
  read, so a mismatch on any rank raises `CheckpointCorruptError` on all of them, naming the
  checkpoint, each bad file and its found vs recorded CRC-32. The template's tensors may
  already hold bytes of the bad file then (they are read in place, not staged): a caller
  that falls back to another checkpoint loads it into the same template, which rewrites
  every element the failed load could have written (see the docs' "Verification on read").
- A read failure on a file that differs from its record (truncated, missing) is reported the
  same way; otherwise (``verify=False``) a failed read is re-raised as
  `CheckpointCorruptError` naming files whose size differs from the recorded one.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardwork.dist_checkpoint import metadata as md
from shardwork.dist_checkpoint.comm import GroupInfo, all_gather_object, resolve_group
from shardwork.dist_checkpoint.confine import confined_file
from shardwork.dist_checkpoint.keycheck import CheckpointMismatchError, KeyFindings, find_keys
from shardwork.dist_checkpoint.plan import COMMON_KEY, LocalState, collect_local
from shardwork.dist_checkpoint.planners import PlannedLoadPlanner
from shardwork.dist_checkpoint.reader import ShardworkReader
from shardwork.dist_checkpoint.sharded import ShardedObject, ShardedTensor
from shardwork.dist_checkpoint.tree import Path as TreePath
from shardwork.dist_checkpoint.tree import map_leaves, path_str

__all__ = ["KeyFilter", "load", "parse_path"]

KeyFilter = Callable[[TreePath, str], bool]
_STRICT_VALUES = (True, False, "missing")
#: what a rank that cannot open the checkpoint reports to the others (raised on all ranks)
_OPEN_ERRORS = (md.IncompleteCheckpointError, md.CheckpointCorruptError, ValueError, OSError)


def parse_path(text: str) -> TreePath:
    """Inverse of `tree.path_str` for filtering recorded paths (digits become ints)."""
    return tuple(int(p) if p.isdigit() else p for p in text.split("/")) if text else ()


def _byteio_read(fqn: str) -> ReadItem:
    index = MetadataIndex(fqn)
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=index,
        dest_offsets=torch.Size((0,)),
        storage_index=index,
        storage_offsets=torch.Size((0,)),
        lengths=torch.Size((0,)),
    )


def _size_problems(path: Path, info: dict[str, Any]) -> list[str]:
    problems = []
    for name, rec in sorted(info.get("files", {}).items()):
        f = confined_file(path, name)
        if not f.is_file():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != rec["size"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, recorded {rec['size']}")
    return problems


def _open(
    path: Path, g: GroupInfo, *, verify: bool, thread_count: int
) -> tuple[dict[str, Any], ShardworkReader, dict[str, Any]]:
    """``(info, reader, saved metadata)``; a rank that cannot read or verify them makes every
    rank raise its error (one all-gather), so none waits in a later collective."""
    failure: BaseException | None = None
    try:
        info = md.read_info(path)
        md.checksum_kind(info)  # an unknown (newer) format version is refused here
        records = info.get("files", {}) if verify else None
        if verify:  # a truncated file reads as such, before its records are range-checked
            _raise_size_problems(path, info, cause=None)
        reader = ShardworkReader(path, thread_count=thread_count, records=records)
        saved = reader.read_metadata().state_dict_metadata
    except _OPEN_ERRORS as exc:
        failure = exc
    # Every rank joins, a failed one too; each then raises its own error or the first other's.
    failures = [f for f in all_gather_object(failure, g) if f is not None]
    if failure is not None:
        raise failure
    if failures:
        raise failures[0]
    return info, reader, saved


def _judge_keys(
    everyone: list[tuple[list[str], list[tuple[str, str, str]], list[str]]],
    *,
    path: Path,
    strict: bool | str,
    info: dict[str, Any],
    keep: KeyFilter,
) -> None:
    """Raise `CheckpointMismatchError` for the union of every rank's key findings."""
    mismatched = sorted({m for _, mm, _ in everyone for m in mm})
    missing = sorted({k for miss, _, _ in everyone for k in miss}) if strict else []
    unexpected: list[str] = []
    if strict is True:
        # A key this rank's template lacks may be another rank's: judge against the union.
        union = {k for _, _, w in everyone for k in w}
        saved_names = [(key, entry["paths"]) for key, entry in info["keys"].items()] + [
            (p, [p]) for p in info.get("plain_paths", [])
        ]
        unexpected = sorted(
            name
            for name, paths in saved_names
            if name not in union and any(keep(parse_path(p), name) for p in paths)
        )
    if mismatched or missing or unexpected:
        raise CheckpointMismatchError(str(path), strict, mismatched, missing, unexpected)


def _read(
    path: Path,
    g: GroupInfo,
    reader: ShardworkReader,
    planner: PlannedLoadPlanner,
    info: dict[str, Any],
) -> None:
    """Run DCP's load with ``reader``; raise `CheckpointCorruptError` on every rank if any
    rank found a file that differs from its record."""
    failure: BaseException | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                {},
                storage_reader=reader,
                planner=planner,
                process_group=g.pg,
                no_dist=not g.distributed,
            )
    except (Exception, CheckpointException) as exc:  # DCP raises on every rank together
        failure = exc
    # Gathered after the read: a bad file seen by one rank makes every rank raise.
    found = sorted({item for rank in all_gather_object(reader.corrupt, g) for item in rank})
    if found:
        raise md.CheckpointCorruptError(
            f"checkpoint {str(path)!r} is corrupt: " + "; ".join(problem for _, problem in found),
            checkpoint=str(path),
            files=tuple(sorted({name for name, _ in found})),
        ) from failure
    if failure is None:
        return
    # A truncated or missing file is reported as such before DCP's generic read error.
    _raise_size_problems(path, info, cause=failure)
    refused = _checkpoint_error(failure)
    if refused is not None:
        raise refused from None
    raise failure


def _raise_size_problems(path: Path, info: dict[str, Any], *, cause: Any) -> None:
    """`CheckpointCorruptError` naming the files whose size differs from the record."""
    problems = _size_problems(path, info)
    if problems:
        raise md.CheckpointCorruptError(
            f"reading {str(path)!r} failed; files differ from what was recorded: "
            + "; ".join(problems),
            checkpoint=str(path),
            files=tuple(p.split(":", 1)[0] for p in problems),
        ) from cause


def _checkpoint_error(exc: BaseException) -> md.CheckpointCorruptError | None:
    """The checkpoint error behind DCP's `CheckpointException` (the lowest rank's; DCP
    gathers every rank's failure, so all ranks raise the same one), or None."""
    failures = getattr(exc, "failures", None) if isinstance(exc, CheckpointException) else None
    for rank in sorted(failures or {}):
        failure = failures[rank]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, md.CheckpointCorruptError):
            return inner
    return None


def load(
    template: Any,
    path: str | os.PathLike,
    *,
    group: Any = None,
    strict: bool | str = True,
    key_filter: KeyFilter | None = None,
    thread_count: int = 1,
    stats: dict[str, int] | None = None,
    verify: bool = True,
) -> Any:
    """Load ``path`` into ``template`` (collective over ``group``); return the loaded state.

    Args:
        template: sharded state dict describing what this rank wants; its `ShardedTensor`
            data are filled in place (any device; dtype cast on copy between dtypes of
            one kind, e.g. float32 into bfloat16, while a saved dtype of another kind, e.g.
            float32 into int64, raises `CheckpointMismatchError`).
        path: a committed checkpoint directory.
        group: ranks that load together (None: world, or one process).
        strict: True, ``"missing"`` or False (see the module docstring).
        key_filter: ``(path, key) -> bool``; leaves it rejects are left as in the template.
        thread_count: data files this rank reads concurrently (one thread each).
        stats: if given, updated with this rank's count of read items per read path
            (``direct``, ``staged``, ``fallback``, ``bytes``, ``empty``; see `reader`).
        verify: check what is read against the recorded checksums (see the module docstring).

    Returns:
        The template's structure with each `ShardedTensor` replaced by its (filled) tensor,
        each `ShardedObject` by the loaded object, plain values by the saved ones.

    Raises:
        CheckpointMismatchError: the template does not fit the checkpoint (before any read).
        CheckpointCorruptError: a file read differs from its record (on every rank).
        IncompleteCheckpointError: ``path`` is not a committed checkpoint.
    """
    if strict not in _STRICT_VALUES or (isinstance(strict, int) and not isinstance(strict, bool)):
        raise ValueError(f"strict={strict!r} is not valid; valid: True, False or 'missing'")
    if not isinstance(verify, bool):
        raise ValueError(f"verify={verify!r} is not valid; valid: True or False")
    path = Path(path)
    g = resolve_group(group)
    info, reader, saved = _open(path, g, verify=verify, thread_count=thread_count)
    keep = key_filter or (lambda _p, _k: True)

    local = collect_local(template)
    wanted = LocalState(
        tensors=[(p, st, pcs) for p, st, pcs in local.tensors if keep(p, st.key)],
        objects=[(p, obj) for p, obj in local.objects if keep(p, obj.key)],
        plain=[(p, v) for p, v in local.plain if keep(p, path_str(p))],
    )
    found: KeyFindings = find_keys(wanted, saved, info)
    # Gathered before any data is read, so every rank raises the same mismatch error.
    everyone = all_gather_object((sorted(found.missing), found.mismatched, sorted(found.wanted)), g)
    _judge_keys(everyone, path=path, strict=strict, info=info, keep=keep)

    items: list[ReadItem] = []
    for key, key_chunks in found.chunks.items():
        meta = saved[key]
        assert isinstance(meta, TensorStorageMetadata)
        items += create_read_items_for_chunk_list(key, meta, key_chunks)
    items += [_byteio_read(k) for k in sorted(found.object_reads)]
    if wanted.plain:
        items.append(_byteio_read(COMMON_KEY))
    planner = PlannedLoadPlanner(items, found.views)
    _read(path, g, reader, planner, info)
    if stats is not None:
        for name, count in reader.stats.items():
            stats[name] = stats.get(name, 0) + count

    common = planner.objects.get(COMMON_KEY, {})
    loaded_objects = planner.objects
    plain_included = {path_str(p) for p, _ in wanted.plain}

    def fill(p: TreePath, leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            # Filled in place by the reader (the template's own tensor).
            return leaf.data
        if isinstance(leaf, ShardedObject):
            if keep(p, leaf.key) and leaf.unique_key in loaded_objects:
                return loaded_objects[leaf.unique_key]
            return leaf.data
        if path_str(p) in plain_included and path_str(p) in common:
            return common[path_str(p)]
        return leaf

    return map_leaves(template, fill)
