"""The in-flight marker of an async save: a second save in the same root must wait for it.

While an `AsyncSave` handle is not finalized, its directory holds ``ASYNC_IN_FLIGHT`` (written
by the group's first rank when the background write starts, removed by `AsyncSave.finalize`
once every rank's write has ended, whatever the outcome). It names the process that owns the
handle (host, pid, process start time), so:

- a later `save` by the same process into the same root (the checkpoint directory's parent,
  the directory itself included) is refused before anything is touched, instead of silently
  overlapping the first one (two background writes sharing the disk, the staging buffers or
  the background group, and a first checkpoint that is never committed);
- a marker left by a process that died (another pid, or the same pid with another start
  time) is ignored: its directory is just an incomplete checkpoint.

The state lives on disk next to the data it describes, not in a module-level registry.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

__all__ = ["IN_FLIGHT_MARKER", "clear_in_flight", "in_flight_here", "mark_in_flight"]

IN_FLIGHT_MARKER = "ASYNC_IN_FLIGHT"


def _process_start() -> str:
    """Start time of this process in clock ticks since boot (Linux), or "" elsewhere; with
    the pid it tells this process from an earlier one that had the same pid."""
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return ""
    # Field 22 (starttime): split after the last ")" because the command name (field 2) may contain
    # spaces or parentheses; field 3 is then index 0.
    return stat.rsplit(")", 1)[1].split()[19]


def process_identity() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start()}


def mark_in_flight(path: Path) -> None:
    """Record that this process has an unfinalized async save writing into ``path``."""
    (path / IN_FLIGHT_MARKER).write_text(json.dumps(process_identity()))


def clear_in_flight(path: Path) -> None:
    (path / IN_FLIGHT_MARKER).unlink(missing_ok=True)


def in_flight_here(path: Path) -> list[Path]:
    """Directories of ``path``'s root (``path`` included) that this process is still writing
    asynchronously (a marker with this process's identity)."""
    # The root holds the sibling step directories, any of which may be in flight.
    root = path.parent
    if not root.is_dir():
        return []
    me = process_identity()
    found = []
    for entry in sorted(root.iterdir()):
        marker = entry / IN_FLIGHT_MARKER
        try:
            owner = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if owner == me:
            found.append(entry)
    return found
