"""A reusable pool of rank processes that run test functions on real gloo groups.

- Workers are started once (``spawn``) and kept for the life of the test
  process, so only the first multi-rank test pays torch's import cost.
- Each call builds a fresh default process group of exactly the requested
  size through a ``FileStore`` in a new temporary directory: no TCP ports, so
  ``pytest -n auto`` workers never clash.
- A rank that raises sends its formatted traceback back; the caller re-raises
  it as :class:`RankFailedError`. Ranks still running when the timeout expires are
  killed (the pool restarts them lazily) and reported as hung. A rank whose
  rendezvous failed exits after reporting, so the next call gets a fresh process.
- Every call starts with a barrier after the rendezvous: no rank runs (and tears
  its connections down) before all ranks finished connecting.
- Functions are sent by reference (module name, file, qualified name), so test
  functions defined at module level in pytest's ``importlib`` mode work.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

#: Open file descriptors from which a rank collects garbage after a task (`_release_cycles`).
FD_COLLECT_THRESHOLD = 256

#: Seconds gloo waits inside a collective. Always longer than the harness
#: timeout, so the harness (which knows which ranks hung) reports first.
_GLOO_TIMEOUT_MARGIN_S = 30.0


class RankFailedError(RuntimeError):
    """One or more ranks raised; the message carries every failing rank's traceback."""


class RankTimeoutError(RuntimeError):
    """Some ranks did not finish within the timeout; they were killed."""


@dataclass(frozen=True)
class _FunctionRef:
    module: str
    file: str | None
    qualname: str


def _reference(fn: Callable[..., Any]) -> _FunctionRef:
    module = sys.modules.get(fn.__module__)
    file = getattr(module, "__file__", None)
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise ValueError(
            f"run_on_ranks: fn={fn.__qualname__!r} must be defined at module level "
            "(rank processes import it by name); nested functions and lambdas cannot be sent"
        )
    return _FunctionRef(fn.__module__, file, fn.__qualname__)


def _resolve(ref: _FunctionRef) -> Callable[..., Any]:
    module = sys.modules.get(ref.module)
    if module is None:
        try:
            module = importlib.import_module(ref.module)
        except ImportError:
            if ref.file is None:
                raise
            spec = importlib.util.spec_from_file_location(ref.module, ref.file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[ref.module] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (not Linux)
        return None


def _release_cycles() -> None:
    """Collect garbage once this rank holds `FD_COLLECT_THRESHOLD` open descriptors.

    A task's objects that form reference cycles (a wrapper and its model, a bundle of groups
    kept by an object that refers to itself) keep their gloo groups' sockets, pipes and epoll
    descriptors open until Python's collector runs, and it runs by allocation counts, not by
    descriptors: as a non-root user (soft limit 1,024 open files) a rank that had run a few
    hundred tests failed in gloo with "Too many open files". A collection costs tens of ms
    with torch loaded, so it runs only past the threshold (every time where /proc is missing).
    """
    open_fds = _open_fds()
    if open_fds is None or open_fds >= FD_COLLECT_THRESHOLD:
        gc.collect()


def _worker_main(conn: Connection) -> None:
    """Loop of one rank process: receive a task, run it, send the outcome."""
    torch.set_num_threads(1)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        sys_path, ref, payload, rank, world_size, store_path, gloo_timeout_s = message
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn = _resolve(ref)
            args, kwargs = pickle.loads(payload)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            continue
        try:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=gloo_timeout_s),
            )
            # Every rank's end of the mesh is connected before any rank runs (and possibly
            # finishes and tears down): a rank done with a trivial function could otherwise
            # close its sockets while a slower peer is still in gloo's connect handshake
            # ("Connection closed by peer" in connectFullMesh, seen under load).
            dist.barrier()
        except BaseException:
            # A failed rendezvous leaves this process's torch.distributed state unknown:
            # report and exit, so the pool starts a fresh process for the next call.
            conn.send(("error", traceback.format_exc()))
            return
        outcome = _run_task(fn, args, kwargs)
        conn.send(outcome)
        if not _tear_down(after_success=outcome[0] == "ok"):
            return


def _run_task(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[str, Any]:
    """``("ok", pickled result)`` or ``("error", formatted traceback)`` of one task."""
    try:
        return ("ok", pickle.dumps(fn(*args, **kwargs)))
    except BaseException:
        return ("error", traceback.format_exc())


def _tear_down(after_success: bool) -> bool:
    """Leave this task's process group; False when this process should exit instead.

    The outcome is already sent, so what happens here never changes a task's report. After a
    successful task the ranks meet in a barrier first: under torch 2.5 a rank's
    ``destroy_process_group`` waited forever once a peer had already left (seen after a
    differentiable all-gather). The barrier fails at once when a peer raised and left, and
    when the harness kills a hung peer; either is that peer's report, not this rank's.
    """
    if after_success:
        with contextlib.suppress(Exception):
            dist.barrier()
    try:
        dist.destroy_process_group()
    except BaseException:
        # torch.distributed's state is unknown: the pool starts a fresh process instead.
        return False
    _release_cycles()
    return True


class _Worker:
    def __init__(self, context: mp.context.BaseContext) -> None:
        parent, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.conn = parent

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RankPool:
    """Rank processes kept alive between calls; grows to the largest world asked for."""

    def __init__(self) -> None:
        self._context = mp.get_context("spawn")
        self._workers: list[_Worker] = []

    def _ensure(self, world_size: int) -> list[_Worker]:
        for index, worker in enumerate(self._workers):
            if not worker.alive():
                self._workers[index] = _Worker(self._context)
        while len(self._workers) < world_size:
            self._workers.append(_Worker(self._context))
        return self._workers[:world_size]

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = 120.0,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result."""
        if world_size < 1:
            raise ValueError(f"run_on_ranks: world_size={world_size} must be >= 1")
        ref = _reference(fn)
        payload = pickle.dumps((tuple(args), dict(kwargs or {})))
        workers = self._ensure(world_size)
        with tempfile.TemporaryDirectory(prefix="shardwork-ranks-") as tmp:
            store_path = os.path.join(tmp, "store")
            for rank, worker in enumerate(workers):
                worker.conn.send(
                    (
                        list(sys.path),
                        ref,
                        payload,
                        rank,
                        world_size,
                        store_path,
                        timeout + _GLOO_TIMEOUT_MARGIN_S,
                    )
                )
            return self._collect(workers, timeout)

    def _collect(self, workers: list[_Worker], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = {worker.conn: rank for rank, worker in enumerate(workers)}
        grace_deadline: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            ready = wait(list(pending), timeout=limit - now)
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, body = conn.recv()
                except (EOFError, OSError):
                    status, body = (
                        "error",
                        f"rank {rank} process died (exit code {workers[rank].process.exitcode})",
                    )
                if status == "ok":
                    results[rank] = pickle.loads(body)
                else:
                    errors[rank] = body
                    # Peers of a failed rank usually block in a collective: give
                    # them a moment to fail on their own, then stop waiting.
                    if grace_deadline is None:
                        grace_deadline = time.monotonic() + 5.0
        hung = sorted(pending.values())
        for rank in hung:
            workers[rank].kill()
        if errors:
            text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items()))
            note = f"\n(ranks {hung} were still running and were killed)" if hung else ""
            raise RankFailedError(f"{len(errors)} of {len(workers)} ranks failed:\n{text}{note}")
        if hung:
            raise RankTimeoutError(
                f"ranks {hung} of {len(workers)} did not finish within {timeout:.0f} s and were killed"
            )
        return [results[rank] for rank in range(len(workers))]

    def close(self) -> None:
        for worker in self._workers:
            if worker.alive():
                with contextlib.suppress(OSError):
                    worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(timeout=5)
            if worker.alive():
                worker.kill()
        self._workers = []
