"""The launcher's environment variables, checked before anything else reads them.

torchrun gives each rank ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; a process started without it has none of them and trains
alone. Set by hand (or left over in a shell) they used to fail late and raw: a non-number in
``int()`` with a traceback, a rank outside the world or a missing ``MASTER_ADDR`` inside process
group creation, after the whole configuration had been validated. `launch_world_size` checks
them together and is the one place the CLI learns the world size from. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from shardwork.trainer.config.load import ConfigError

__all__ = ["launch_problems", "launch_world_size"]

_HOW = (
    "torchrun sets these for every rank (torchrun --nproc-per-node N -m shardwork.trainer ...); "
    "unset WORLD_SIZE and RANK to train in one process"
)


def _integer(environ: Mapping[str, str], name: str, lowest: int) -> tuple[int | None, str | None]:
    """``(value, problem)`` of the variable ``name``: None and no problem when it is unset."""
    raw = environ.get(name)
    if raw is None:
        return None, None
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < lowest:
        return None, f"{name}={raw!r} is not valid; valid: an integer >= {lowest}"
    return value, None


def _rank_problems(environ: Mapping[str, str], world: int) -> list[str]:
    """``RANK`` and ``LOCAL_RANK`` against the world and ``LOCAL_WORLD_SIZE``."""
    problems = []
    rank, problem = _integer(environ, "RANK", 0)
    local_world, local_world_problem = _integer(environ, "LOCAL_WORLD_SIZE", 1)
    local_rank, local_problem = _integer(environ, "LOCAL_RANK", 0)
    problems += [p for p in (problem, local_world_problem, local_problem) if p]
    if rank is None and problem is None and world > 1:
        problems.append(f"WORLD_SIZE={world} but RANK is not set")
    if rank is not None and rank >= world:
        problems.append(f"RANK={rank} is not valid for WORLD_SIZE={world}; valid: 0..{world - 1}")
    if local_world is not None and local_world > world:
        problems.append(
            f"LOCAL_WORLD_SIZE={local_world} is more than WORLD_SIZE={world}; valid: 1..{world}"
        )
    if None not in (local_rank, local_world) and local_rank >= local_world:
        problems.append(
            f"LOCAL_RANK={local_rank} is not valid for LOCAL_WORLD_SIZE={local_world}; "
            f"valid: 0..{local_world - 1}"
        )
    return problems


def _rendezvous_problems(environ: Mapping[str, str]) -> list[str]:
    """``MASTER_ADDR`` and ``MASTER_PORT``, which ranks meet at when there are several."""
    problems = []
    if not environ.get("MASTER_ADDR", "").strip():
        problems.append("MASTER_ADDR is not set (the address of rank 0's host)")
    port, problem = _integer(environ, "MASTER_PORT", 1)
    if problem is None and port is None:
        problems.append("MASTER_PORT is not set (a free TCP port on rank 0's host)")
    elif problem is not None or port > 65535:
        raw = environ["MASTER_PORT"]
        problems.append(f"MASTER_PORT={raw!r} is not valid; valid: a TCP port, 1..65535")
    return problems


def launch_problems(environ: Mapping[str, str]) -> tuple[int, list[str]]:
    """``(world size, problems)`` of the launcher's variables in ``environ``.

    The world size is ``WORLD_SIZE`` (1 when unset or invalid). The rendezvous address is
    checked only for more than one rank: one process never creates a process group.
    """
    world, problem = _integer(environ, "WORLD_SIZE", 1)
    if problem:  # the other variables are checked against the world size, unknown here
        return 1, [problem]
    world = world or 1
    problems = _rank_problems(environ, world)
    if world > 1:
        problems += _rendezvous_problems(environ)
    return world, problems


def launch_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The world size the launcher announced; ConfigError (exit 2) listing every problem of
    its variables, each as ``environment: ...`` with how to launch."""
    world, problems = launch_problems(os.environ if environ is None else environ)
    if problems:
        lines = [f"environment: {p}" for p in problems]
        lines[-1] += f"; {_HOW}"
        raise ConfigError(lines)
    return world
