"""Collective failures named by phase and group instead of a raw backend traceback.

A rank whose peer dies sees one of two things, depending on how the peer went:

- the peer's process ended (killed, crashed) on a reachable host: its sockets close, and gloo
  fails the pending collective at once ("Connection reset by peer" / "Connection closed by
  peer"; NCCL reports a remote error). This is a :class:`CollectiveError`;
- the peer hangs, or its host vanished without closing anything: the collective waits until
  the process group's timeout (``parallel.timeout_minutes``, every subgroup included) and then
  fails. This is a :class:`CollectiveTimeoutError`.

:func:`collective_phase` turns either into one paragraph naming the rank, the phase (e.g.
"train step 12, forward/backward") and the members of the groups the phase communicates over;
the CLI prints it and exits with status 6. Other errors pass through unchanged.
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_LOST_WORDS = (
    "connection reset",
    "connection closed",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "ncclremoteerror",
)


class CollectiveError(RuntimeError):
    """A collective failed because a peer rank died or stopped answering."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within parallel.timeout_minutes."""


def _members(groups, name: str) -> list[int]:
    if name == "world":
        size = dist.get_world_size() if dist.is_initialized() else os.environ.get("WORLD_SIZE", 1)
        return list(range(int(size)))
    return list(groups.members.get(name, ()))


@contextlib.contextmanager
def collective_phase(phase: str, groups, names: tuple[str, ...], *, timeout_minutes: float):
    """Re-raise a lost peer or a timeout inside the block naming ``phase`` and the groups
    ``names`` ("world" for collectives over every rank; ``groups`` None before they exist)."""
    try:
        yield
    except CollectiveError:
        raise  # an inner phase already named it
    except RuntimeError as exc:
        text = str(exc).lower()
        timed_out = any(word in text for word in _TIMEOUT_WORDS)
        if not timed_out and not any(word in text for word in _PEER_LOST_WORDS):
            raise
        members = ", ".join(f"{n}={_members(groups, n)}" for n in names)
        original = (str(exc).strip().splitlines() or [""])[0]
        rank = groups.global_rank if groups is not None else os.environ.get("RANK", "0")
        head = f"rank {rank}: a collective in '{phase}'"
        if timed_out:
            raise CollectiveTimeoutError(
                f"{head} did not finish within parallel.timeout_minutes={timeout_minutes}; it "
                f"communicates over groups {members}. A rank of one of these groups has died, "
                f"hung or diverged. Original error: {original}"
            ) from exc
        raise CollectiveError(
            f"{head} failed: a peer rank closed its connection (its process died or exited); "
            f"it communicates over groups {members}. Check that rank's own output for the "
            f"cause. Original error: {original}"
        ) from exc
