"""`CheckpointManager`: step directories, atomic commit, async pipelining, retention, granular
loads and integrity checks on top of `save` / `load`.

- Layout: ``<root>/step_<step, 9 digits>/``; a directory counts only once its ``COMMITTED``
  marker exists (`metadata`), so `latest` / `list` never see a partial save.
- Interrupted saves (a process killed at any point) leave a directory without marker; the next
  `save` removes every such directory on the first rank before writing (nothing else can be in
  flight then, because a save first finalizes the previous async one).
- Async: `save(..., async_save=True)` returns after staging; the previous async save is always
  finalized first (a second save waits for the first); `finalize` commits it on the training
  thread and raises the background error, if any. One dedicated gloo group is created on first
  use for all background collectives and reused; ``async_timeout`` bounds its collectives
  (torch's default for a new group is 30 minutes, whatever the training group's timeout).
- Retention after each commit, first rank only: keep the last ``keep_last`` complete
  checkpoints plus every step divisible by ``keep_every``, and never the latest complete one.
  Deletion removes the marker first, so a crash mid-deletion leaves an incomplete directory.
- Granular loads filter the template by top-level section (``include=("model",)`` = model
  only; ``exclude=("optimizer",)`` / ``("rng",)``) and/or by key.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwork.dist_checkpoint import metadata as md
from shardwork.dist_checkpoint.comm import all_gather_object, broadcast_object, resolve_group
from shardwork.dist_checkpoint.layout import describe_layout
from shardwork.dist_checkpoint.load import load
from shardwork.dist_checkpoint.save import AsyncSave, SaveResult, StagingBuffers, save
from shardwork.dist_checkpoint.tree import Path as TreePath
from shardwork.dist_checkpoint.tree import section_of
from shardwork.dist_checkpoint.verify import verify

__all__ = ["CheckpointManager"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _check_optional_positive(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} is not valid; valid: None or an int >= 1")


def _check_timeout(value: Any) -> None:
    if value is not None and (
        not isinstance(value, datetime.timedelta) or value <= datetime.timedelta(0)
    ):
        raise ValueError(
            f"async_timeout={value!r} is not valid; valid: None or a positive datetime.timedelta"
        )


def _section_names(name: str, value: Any) -> tuple[str, ...]:
    """``include`` / ``exclude`` as a tuple of section names (ValueError for a bare str or a
    non-iterable, TypeError naming an element that is not a str: sections are str)."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"{name}={value!r} is not valid; valid: a sequence of names")
    names = tuple(value)
    for item in names:
        if not isinstance(item, str):
            raise TypeError(
                f"{name}={value!r} is not valid: {item!r} is a {type(item).__name__}; valid: "
                f"section names (str), the top-level keys of the state dict"
            )
    return names


def _template_sections(template: Any) -> set[str]:
    """The sections (`tree.section_of`) the template's leaves can be in: its top-level keys
    (indices of a list/tuple), also those whose subtree is empty on this rank."""
    if isinstance(template, dict):
        return {str(key) for key in template}
    if isinstance(template, (list, tuple)):
        return {str(index) for index in range(len(template))}
    return {""}


def _recorded_paths(path: Path) -> list[str] | None:
    """Every leaf path ``shardwork.json`` records (None if it cannot be read: `load` then
    reports why, on every rank)."""
    try:
        info = md.read_info(path)
        paths = [p for entry in info.get("keys", {}).values() for p in entry["paths"]]
        return paths + list(info.get("plain_paths", []))
    # Unreadable, corrupt, or not shardwork's layout (IncompleteCheckpointError is a ValueError).
    except (md.CheckpointCorruptError, OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


def _check_sections_exist(
    template: Any, path: Path, given: dict[str, tuple[Any, Sequence[str]]]
) -> None:
    """ValueError naming an ``include`` / ``exclude`` name that is a section of neither the
    template nor the checkpoint, with the valid names (the checkpoint's are read only when
    the template lacks a name). ``given``: argument name -> (value as passed, its names)."""
    in_template = _template_sections(template)
    unknown = [
        (arg, name)
        for arg, (_, names) in given.items()
        for name in names
        if name not in in_template
    ]
    if not unknown:
        return
    recorded = _recorded_paths(path)
    if recorded is None:
        return
    for arg, name in unknown:
        if not any(p == name or p.startswith(name + "/") for p in recorded):
            valid = sorted(in_template | {p.split("/")[0] for p in recorded})
            raise ValueError(
                f"{arg}={given[arg][0]!r}: {name!r} is not a top-level section of the template "
                f"or of checkpoint {str(path)!r}; valid: {valid}"
            )


class CheckpointManager:
    """Checkpoints of one training run under ``root`` (call collectively on every rank).

    Args:
        root: directory holding ``step_*`` checkpoint directories.
        group: ranks that save/load together (None: world, or one process).
        keep_last: keep this many most recent complete checkpoints (None: keep all).
        keep_every: also keep every step divisible by this (None: no such exception).
        async_save: default for `save`.
        thread_count: writer threads (and data files) per rank at save; files read
            concurrently per rank at load.
        layout, content_version: recorded with every checkpoint (``layout``: a mapping, or
            an object with the parallel sizes such as the ``ProcessGroups`` bundle; the
            group's size and global ranks are recorded in any case).
        sync_files: fsync data files (keep True for crash safety).
        reuse_staging_buffers: keep the async staging buffers between saves (staging is then
            a copy into memory already allocated/pinned; costs a host copy of the rank's
            write set).
        async_timeout: how long a collective of the background writes' gloo group may wait
            for a peer before failing (None: torch's default for new groups, 30 minutes).
            Pass the training group's timeout, so that a stalled background write fails as
            soon as a stalled training step would.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        group: Any = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = False,
        thread_count: int = 1,
        layout: Any = None,
        content_version: int | str | None = None,
        sync_files: bool = True,
        reuse_staging_buffers: bool = True,
        async_timeout: datetime.timedelta | None = None,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise ValueError(f"root={root!r} is not valid; valid: a str or os.PathLike")
        _check_optional_positive("keep_last", keep_last)
        _check_optional_positive("keep_every", keep_every)
        _check_optional_positive("thread_count", thread_count)
        _check_timeout(async_timeout)
        self.root = Path(root)
        self.group = group
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.thread_count = thread_count
        self.layout = describe_layout(layout)
        self.content_version = content_version
        self.sync_files = sync_files
        self.async_timeout = async_timeout
        self._g = resolve_group(group)
        self._pending: AsyncSave | None = None
        self._pending_step: int | None = None
        self._async_group: Any = None
        self._staging = StagingBuffers() if reuse_staging_buffers else None
        #: per-phase seconds of the last committed save (plan, stage, write, finalize, blocking)
        self.last_timings: dict[str, float] = {}

    # ---------------------------------------------------------------- discovery
    def step_path(self, step: int) -> Path:
        """Directory of ``step`` (whether or not it exists)."""
        return self.root / f"step_{step:09d}"

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for entry in self.root.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and entry.is_dir():
                out.append((int(m.group(1)), entry))
        return sorted(out)

    def list(self) -> list[int]:
        """Steps of the complete (committed) checkpoints, ascending."""
        return [step for step, p in self._step_dirs() if md.is_committed(p)]

    def latest(self) -> int | None:
        """Step of the newest complete checkpoint, or None."""
        steps = self.list()
        return steps[-1] if steps else None

    def incomplete(self) -> list[Path]:
        """Directories of interrupted saves (not counting the async save in flight)."""
        return [
            p
            for step, p in self._step_dirs()
            # The step of an unfinalized async save is in flight, not abandoned: leave it alone.
            if not md.is_committed(p) and step != self._pending_step
        ]

    def clean_incomplete(self) -> list[Path]:
        """Remove interrupted saves (call on one rank only); returns what was removed."""
        removed = self.incomplete()
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    # ---------------------------------------------------------------- saving
    def save(
        self,
        step: int,
        state: Any,
        *,
        async_save: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> SaveResult | AsyncSave:
        """Save ``state`` as ``step``; async saves are committed by `finalize` (or the next
        `save`). Raises the previous async save's error, if it failed."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} is not valid; valid: an int >= 0")
        use_async = self.async_save if async_save is None else async_save
        # A second save waits for the first: its directory is committed (or its error raised) before
        # anything below touches the root.
        self.finalize(blocking=True)
        if self._g.rank == 0:
            self.clean_incomplete()
        # Created once, on first async use, and reused by every later background write.
        if use_async and self._g.distributed and self._async_group is None:
            ranks = dist.get_process_group_ranks(self._g.pg)
            self._async_group = dist.new_group(
                ranks, backend="gloo", timeout=self.async_timeout, use_local_synchronization=True
            )
        result = save(
            state,
            self.step_path(step),
            group=self.group,
            async_save=use_async,
            thread_count=self.thread_count,
            async_group=self._async_group,
            content_version=self.content_version,
            layout=self.layout,
            metadata={"step": step, **(dict(metadata) if metadata else {})},
            overwrite=overwrite,
            sync_files=self.sync_files,
            staging_buffers=self._staging,
        )
        if isinstance(result, AsyncSave):
            self._pending, self._pending_step = result, step
            return result
        self._after_commit(result)
        return result

    def finalize(self, *, blocking: bool = True) -> SaveResult | None:
        """Commit the async save in flight, if any (collective).

        With ``blocking=False`` it returns None unless every rank's background write has
        ended (one small all-gather on the training group). Raises `CheckpointSaveError` if a
        background write failed anywhere.
        """
        if self._pending is None:
            return None
        if not blocking:
            # Every rank must decide the same: finalize's collectives run only if all writes ended.
            done = all_gather_object(self._pending.done(), self._g)
            if not all(done):
                return None
        handle, self._pending = self._pending, None
        try:
            result = handle.finalize()
        finally:
            self._pending_step = None
        self._after_commit(result)
        return result

    def _after_commit(self, result: SaveResult) -> None:
        self.last_timings = dict(result.timings)
        if self._g.rank == 0:
            self.apply_retention()

    def apply_retention(self) -> list[int]:
        """Delete complete checkpoints the policy does not keep (call on one rank only)."""
        steps = self.list()
        if not steps or self.keep_last is None:
            return []
        keep = set(steps[-self.keep_last :]) | {steps[-1]}
        if self.keep_every is not None:
            keep |= {s for s in steps if s % self.keep_every == 0}
        deleted = []
        for step in steps:
            if step in keep:
                continue
            path = self.step_path(step)
            # Marker first: a crash mid-deletion leaves a directory that reads as incomplete.
            (path / md.COMMIT_MARKER).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(step)
        return deleted

    def close(self) -> None:
        """Finalize the save in flight and release the background group."""
        self.finalize(blocking=True)
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None

    # ---------------------------------------------------------------- loading
    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            latest = self.latest()
            if latest is None:
                raise FileNotFoundError(f"no complete checkpoint under {str(self.root)!r}")
            return latest
        if step not in self.list():
            raise ValueError(
                f"step={step!r} is not a complete checkpoint under {str(self.root)!r}; "
                f"valid: one of {self.list()}"
            )
        return step

    def load(
        self,
        template: Any,
        *,
        step: int | None = None,
        strict: bool | str = True,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        key_filter: Callable[[TreePath, str], bool] | None = None,
        verify_files: bool = False,
    ) -> Any:
        """Load ``step`` (default: latest complete) into ``template`` (collective).

        ``include`` / ``exclude`` select top-level sections of the state dict (model only:
        ``include=("model",)``; no optimizer: ``exclude=("optimizer",)``; no RNG:
        ``exclude=("rng",)``); ``key_filter(path, key)`` narrows further. Leaves not selected
        are returned as in the template. Each name must be a top-level section of the template
        or of the checkpoint (``shardwork.json`` is read for a name the template lacks): a
        misspelt name raises ValueError listing the valid ones before anything is loaded
        (it would silently select nothing, or exclude nothing). ``verify_files`` checks
        checksums first (on the first rank) and raises `CheckpointCorruptError` naming a bad
        file.
        """
        include_names = None if include is None else _section_names("include", include)
        exclude_names = _section_names("exclude", exclude)
        step = self._resolve_step(step)
        path = self.step_path(step)
        given = {"include": (include, include_names or ()), "exclude": (exclude, exclude_names)}
        _check_sections_exist(template, path, given)
        if verify_files:
            self.verify(step)
        include_set = set(include_names) if include_names is not None else None
        exclude_set = set(exclude_names)

        def keep(p: TreePath, key: str) -> bool:
            section = section_of(p)
            if include_set is not None and section not in include_set:
                return False
            if section in exclude_set:
                return False
            return key_filter is None or key_filter(p, key)

        selective = include_set is not None or exclude_set or key_filter is not None
        return load(
            template,
            path,
            group=self.group,
            strict=strict,
            key_filter=keep if selective else None,
            thread_count=self.thread_count,
        )

    def verify(self, step: int | None = None) -> dict[str, Any]:
        """Checksum every file of ``step`` on the first rank; all ranks raise on a bad file."""
        path = self.step_path(self._resolve_step(step))
        outcome: Any = None
        # One rank reads the files; the verdict is broadcast so every rank returns or raises alike.
        if self._g.rank == 0:
            try:
                outcome = verify(path)
            except md.CheckpointCorruptError as exc:
                outcome = exc
        outcome = broadcast_object(outcome, self._g)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def __repr__(self) -> str:
        return (
            f"CheckpointManager(root={str(self.root)!r}, keep_last={self.keep_last}, "
            f"keep_every={self.keep_every}, async_save={self.async_save})"
        )
