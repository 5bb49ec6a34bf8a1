"""An earlier run's logs in a reused ``logging.run_dir``, set aside for a run that starts afresh.

The metrics writer appends, which is right for a resumed run: it continues its own timeline.
A run that starts at step 0 in a directory that already holds logs (the same command run
again, or a resume="auto" that found no checkpoint) would instead mix two runs' steps 1..N in
one ``metrics.jsonl`` (and in TensorBoard, and plot them as one). So before it writes, its
predecessor's logs are renamed, nothing deleted: ``metrics.jsonl`` to ``metrics.1.jsonl``,
``config.toml`` to ``config.1.toml``, ``tensorboard/`` to ``tensorboard.1/``, ``plots/`` to
``plots.1/``; the number is the lowest that none of them uses yet, so one run's files share
it, and a third run's go to ``.2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

#: what the logging rank writes into the run directory; every other rank with
#: ``logging.per_rank`` writes its own metrics-rank<r>.jsonl only
LOGGING_RANK_LOGS = ("metrics.jsonl", "config.toml", "tensorboard", "plots")


def aside_name(name: str, number: int) -> str:
    """``name`` with ``number`` before its suffix: ``metrics.jsonl`` -> ``metrics.1.jsonl``,
    ``tensorboard`` -> ``tensorboard.1``."""
    path = Path(name)
    return f"{path.stem}.{number}{path.suffix}"


def _holds_something(path: Path) -> bool:
    """Whether ``path`` is a non-empty file or a directory with entries."""
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def set_aside(run_dir: Path, names: Sequence[str]) -> list[tuple[str, str]]:
    """Rename each of ``names`` in ``run_dir`` that holds something to its
    :func:`aside_name`, with one number for all (the lowest one that none of them uses);
    returns ``(name, new name)`` of each one renamed. An empty file or folder is left to be
    reused."""
    found = [name for name in names if _holds_something(run_dir / name)]
    if not found:
        return []
    number = 1
    while any((run_dir / aside_name(name, number)).exists() for name in names):
        number += 1
    moved = [(name, aside_name(name, number)) for name in found]
    for name, new in moved:
        (run_dir / name).rename(run_dir / new)
    return moved
