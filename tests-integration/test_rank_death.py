"""When a rank dies: what its survivors do, with and without torchrun.

Two real rank processes of ``python -m shardwork.trainer`` (RANK/WORLD_SIZE set by hand, as
torchrun would, or torchrun itself) train a dp=2 tiny model; once rank 0 has logged two steps,
rank 1 is SIGKILLed (or SIGSTOPped, a hung peer). The survivor must end by itself with exit
status 6 and one paragraph naming its rank, the phase and the groups; under torchrun the agent
ends the survivor and exits non-zero naming the dead rank as the root cause.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT_MINUTES = 0.5
"""parallel.timeout_minutes of these runs: 30 s, also the rendezvous's limit (the two rank
processes start together but import torch on 2 shared cores)."""

PHASE = re.compile(
    r"shardwork-train: rank 0: a collective in "
    r"'(train step \d+, [a-z /]+|stop-signal agreement after step \d+)'"
)


def _write_config(tmp_path: Path, cache: str) -> Path:
    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.config.load import config_to_toml
    from shardwork.trainer.testing import tiny_config

    config = tiny_config(
        tmp_path / "run",
        world_size=2,
        parallel={"timeout_minutes": TIMEOUT_MINUTES},
        schedule={"train_steps": 100_000},
        logging={"interval": 1},
        eval={"interval": None, "at_end": False},
    )
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config))
    return path


def _env(cache: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, SHARDWORK_CACHE=cache, OMP_NUM_THREADS="1", **extra)
    env.pop("SHARDWORK_CKPT_FAULT", None)
    return env


def _launch_by_hand(config: Path, cache: str) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "shardwork.trainer", "--config", str(config)]
    env = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    return [
        subprocess.Popen(
            command,
            env=_env(cache, RANK=str(r), LOCAL_RANK=str(r), MASTER_PORT=str(port), **env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]


class _PortTakenError(Exception):
    """The free port picked for MASTER_PORT was taken by another process before rank 0 bound
    it (another test's gloo connection can get it between the two)."""


def _wait_for_training(run_dir: Path, procs: list[subprocess.Popen]) -> None:
    """Until rank 0 has logged two training steps (a hang guard, not a timing assertion)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 2):
        assert time.monotonic() < deadline, "training did not start"
        for p in procs:
            if p.poll() is not None:
                _, err = p.communicate()
                if "EADDRINUSE" in err:
                    raise _PortTakenError(err)
                raise AssertionError(err)
        time.sleep(0.05)


def _start_training(config: Path, cache: str, run_dir: Path) -> list[subprocess.Popen]:
    """Two ranks started by hand and training; a port taken before rank 0 bound it is retried
    with another (up to three times)."""
    attempts = 3
    for attempt in range(1, attempts + 1):
        procs = _launch_by_hand(config, cache)
        try:
            _wait_for_training(run_dir, procs)
        except _PortTakenError:
            _kill(procs)
            if attempt == attempts:
                raise
            continue
        except BaseException:
            _kill(procs)
            raise
        return procs


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=60)


@pytest.mark.parametrize("fault", ["SIGKILL", pytest.param("SIGSTOP", marks=pytest.mark.slow)])
def test_survivor_exits_naming_phase_and_group(tmp_path, corpus_cache, fault):
    procs = _start_training(_write_config(tmp_path, corpus_cache), corpus_cache, tmp_path / "run")
    try:
        procs[1].send_signal(getattr(signal, fault))
        # SIGKILL: the peer's sockets close and gloo fails at once; SIGSTOP: a hung peer, the
        # survivor waits for parallel.timeout_minutes (the wait's limit is only a hang guard)
        _, err = procs[0].communicate(timeout=240)
    finally:
        _kill(procs)
    assert procs[0].returncode == 6, err
    message = PHASE.search(err)
    assert message is not None, err
    paragraph = err[message.start() :].splitlines()[0]
    assert "dp_cp=[0, 1]" in paragraph or "world=[0, 1]" in paragraph, paragraph
    if fault == "SIGKILL":
        assert "a peer rank closed its connection" in paragraph, paragraph
    else:
        assert f"did not finish within parallel.timeout_minutes={TIMEOUT_MINUTES}" in paragraph
    assert "Traceback" not in err, err


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def _rank_of(pid: int) -> int | None:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds ranks through /proc")
def test_torchrun_ends_the_survivors_when_a_rank_dies(tmp_path, corpus_cache):
    config = _write_config(tmp_path, corpus_cache)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "shardwork.trainer", "--config", str(config)]
    agent = subprocess.Popen(
        command, env=_env(corpus_cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for_training(tmp_path / "run", [agent])
        ranks = {_rank_of(pid): pid for pid in _children(agent.pid)}
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        out, _ = agent.communicate(timeout=240)
    finally:
        _kill([agent])
    assert agent.returncode != 0, out
    # the agent's summary names the killed rank as the root cause
    assert "ChildFailedError" in out, out
    root = out[out.index("Root Cause") :]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root), root
    assert "exitcode  : -9" in root, root
    # and no rank process outlives the agent
    for pid in ranks.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), pid


def _state(pid: int) -> str:
    """The process's state letter from /proc (Z: a zombie, already dead)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
