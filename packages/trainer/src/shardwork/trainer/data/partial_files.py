"""Unique temporary names for files renamed into place when complete.

Several processes may build the same dataset at once (every rank of a fresh torchrun job).
Each writes under its own temporary sibling name and renames the complete file into place,
so a reader never sees half a file and no writer renames a peer's file away.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def partial_tag() -> str:
    """A suffix unique to this call and process: ``.partial-<pid>-<8 hex>``."""
    return f".partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def partial_path(path: Path, tag: str | None = None) -> Path:
    """``path``'s temporary sibling, with ``tag`` (a fresh :func:`partial_tag` when None)."""
    return path.with_name(path.name + (tag or partial_tag()))
