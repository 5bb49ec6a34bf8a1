"""Deterministic, test-only fault injection for the save path.

The writer calls `fault_point(name, rank)` at four places:

- ``before_data``: after planning, before this rank creates any data file;
- ``mid_file``: inside a data file, after its first write (the file exists, partly written);
- ``before_metadata``: on the coordinator, before DCP's ``.metadata`` file is written;
- ``before_commit``: on the first rank, after every rank's write succeeded, before the
  shardwork metadata and the commit marker are written.

Nothing happens unless the environment variable ``SHARDWORK_CKPT_FAULT`` names the point:
``"<point>"`` (every rank), ``"<point>@<rank>"`` (one rank), optionally followed by
``":raise"`` to raise `InjectedFaultError` instead of killing the process with SIGKILL. Killing is
the realistic case (no ``finally`` blocks, no flushing); raising tests error propagation.
"""

from __future__ import annotations

import os
import signal

__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "InjectedFaultError",
    "fault_armed",
    "fault_env_problem",
    "fault_point",
]

FAULT_ENV = "SHARDWORK_CKPT_FAULT"
FAULT_POINTS = ("before_data", "mid_file", "before_metadata", "before_commit")


class InjectedFaultError(OSError):
    """Raised at a fault point when ``SHARDWORK_CKPT_FAULT`` ends in ``:raise``."""


def _parse(spec: str) -> tuple[str, int | None, str]:
    body, _, action = spec.partition(":")
    point, _, rank = body.partition("@")
    action = action or "kill"
    if (
        point not in FAULT_POINTS
        or action not in ("kill", "raise")
        or (rank and not rank.isdigit())
    ):
        raise ValueError(
            f"{FAULT_ENV}={spec!r} is not valid; valid: '<point>[@<rank>][:raise]' with point in "
            f"{FAULT_POINTS}"
        )
    return point, int(rank) if rank else None, action


def fault_env_problem() -> str | None:
    """What is wrong with ``SHARDWORK_CKPT_FAULT``'s value, or None when it is unset or valid:
    a program checks it before training, not at its first save."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    try:
        _parse(spec)
    except ValueError as exc:
        return str(exc)
    return None


def fault_armed(point: str, rank: int) -> bool:
    """Whether ``SHARDWORK_CKPT_FAULT`` selects ``point`` on ``rank``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    want, want_rank, _ = _parse(spec)
    return want == point and (want_rank is None or want_rank == rank)


def fault_point(point: str, rank: int) -> None:
    """Kill this process (or raise) if ``SHARDWORK_CKPT_FAULT`` selects ``point`` on ``rank``."""
    if not fault_armed(point, rank):
        return
    _, _, action = _parse(os.environ[FAULT_ENV])
    if action == "raise":
        raise InjectedFaultError(f"injected fault at {point!r} on rank {rank}")
    os.kill(os.getpid(), signal.SIGKILL)
