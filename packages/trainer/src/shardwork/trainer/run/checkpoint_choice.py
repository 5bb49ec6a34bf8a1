"""Which checkpoints a resume may load: one answer for every reader of ``checkpoint.resume``.

Preflight asks it for the checkpoint a resume loads first (to refuse another optimizer's before
any process group exists), the trainer's resume for the checkpoints it tries, and
``shardwork-generate`` for the checkpoint a path names:

- ``checkpoint.resume = "none"``: none (the run starts afresh);
- ``"auto"``: every complete (committed) ``step_<N>`` under ``checkpoint.dir``; the trainer
  tries them newest first and, with ``checkpoint.fallback``, falls back past a corrupt one;
- a path naming a complete ``step_<N>`` directory: that checkpoint alone;
- any other path: the newest complete ``step_<N>`` in it, or none (the caller says why).

It reads directory entries and COMMITTED markers only: no process group, model or device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardwork.dist_checkpoint import is_committed

#: a checkpoint directory's name, as CheckpointManager writes and lists them
_STEP_DIR = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class CheckpointCandidates:
    """The complete checkpoints a resume may load: ``checkpoints`` maps each one's step to its
    directory, in ascending step order; all lie in ``root``."""

    root: Path
    checkpoints: dict[int, Path]

    @property
    def steps(self) -> list[int]:
        """The candidates' steps, ascending (a resume tries the last first)."""
        return list(self.checkpoints)

    @property
    def newest(self) -> Path | None:
        """The directory of the candidate a resume loads first; None when there is none."""
        return self.checkpoints[self.steps[-1]] if self.checkpoints else None


def locate_checkpoint(path: str | Path) -> tuple[Path, int | None]:
    """``(root, step)`` for a ``step_*`` checkpoint directory, or ``(root, None)`` for a root."""
    path = Path(path)
    match = _STEP_DIR.fullmatch(path.name)
    if match and is_committed(path):
        return path.parent, int(match.group(1))
    return path, None


def committed_checkpoints(root: Path) -> dict[int, Path]:
    """The complete ``step_<N>`` directories in ``root`` by step, ascending (as
    ``CheckpointManager.list`` finds them); empty when ``root`` is not a directory."""
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and is_committed(entry):
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def named_candidates(path: str | Path) -> CheckpointCandidates:
    """The checkpoint ``path`` names: itself when it is a complete ``step_<N>`` directory,
    else the newest complete one in it (no candidate when there is none)."""
    root, step = locate_checkpoint(path)
    if step is not None:
        return CheckpointCandidates(root, {step: Path(path)})
    newest = list(committed_checkpoints(root).items())[-1:]
    return CheckpointCandidates(root, dict(newest))


def resume_candidates(resume: str, checkpoint_dir: str | Path) -> CheckpointCandidates | None:
    """The checkpoints ``checkpoint.resume = resume`` may load (see the module docstring);
    None for ``"none"``. ``checkpoint_dir``: ``checkpoint.dir``, searched for ``"auto"``."""
    if resume == "none":
        return None
    if resume == "auto":
        root = Path(checkpoint_dir)
        return CheckpointCandidates(root, committed_checkpoints(root))
    return named_candidates(resume)
