"""Resume anywhere, survive faults: checkpoints written at one layout continue at another, and a
run whose rank was SIGKILLed restarts from its last complete checkpoint.

- ``test_resume_reshards_across_layouts``: TP=2×PP=2 (4 ranks) saves at step 2, DP=2 resumes
  and saves at step 4, one process resumes and finishes; every resumed step's loss equals the
  uninterrupted one-process run (float64, rtol ``RTOL`` = 1e-9).
- ``test_resume_between_fsdp_and_zero1``: FSDP at DP=2 saves at step 2, ZeRO-1 at PP=2
  resumes and saves at step 4, FSDP again (the ZeRO-2-like mode) resumes and finishes; every
  resumed step's loss equals the uninterrupted one-process run (rtol ``RTOL``). The
  checkpoints are the same global-coordinate format whatever wrote them.
- ``test_sigkill_during_training_and_async_write``: two real rank processes
  (``python -m shardwork.trainer`` with RANK/WORLD_SIZE set, as torchrun would) train with a
  checkpoint every 2 steps; rank 1 is SIGKILLed during training once a checkpoint has
  committed. The restart (async saves on) has rank 1 killed inside its next checkpoint's data
  file (shardwork.dist_checkpoint's ``SHARDWORK_CKPT_FAULT=mid_file@1`` fault point); that
  checkpoint must stay uncommitted. The final restart continues from the last complete
  checkpoint with the uninterrupted run's losses (float64, rtol 1e-9 as well).
- ``test_two_ranks_fall_back_from_a_corrupt_checkpoint``: DP=2 checkpoints at steps 2 and 4;
  one flipped byte in step 4's data file written by rank 1; both ranks resume with
  ``checkpoint.resume = "auto"``, agree that step 4 is corrupt, fall back to step 2 together
  and reproduce the uninterrupted DP=2 run's losses (rtol 1e-9 as well).
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

STEPS = 6
RTOL = 1e-9
"""float64 runs: a resumed step differs from the uninterrupted one only by reduction order."""


def _sections(parallel: dict, *, steps: int = STEPS, **extra) -> dict:
    sections = {
        "model": {"num_layers": 4},
        "parallel": parallel,
        "precision": {"dtype": "fp64"},
        "schedule": {"train_steps": steps, "warmup_steps": 2, "micro_batch_size": 2},
        "eval": {"interval": None, "at_end": False},
    }
    sections.update(extra)
    return sections


def _train(run_dir: str, sections: dict, cache: str):
    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    stream = io.StringIO()
    result = train(tiny_config(run_dir, world_size=world, **sections), stream=stream)
    return result.train_losses, stream.getvalue()


def _assert_curve(losses: dict, reference: dict, steps: list[int]) -> None:
    assert sorted(losses) == steps
    for step in steps:
        assert losses[step] == pytest.approx(reference[step], rel=RTOL), f"step {step}"


def test_resume_reshards_across_layouts(tmp_path, corpus_cache):
    reference, _ = _train(str(tmp_path / "ref"), _sections({}), corpus_cache)
    ckpt = {"interval": 2, "keep_last": 5}
    first = _sections({"tp": 2, "pp": 2}, checkpoint=ckpt)
    run_on_ranks(_train, 4, args=(str(tmp_path / "a"), first, corpus_cache), timeout=600)
    step2 = tmp_path / "a" / "checkpoints" / "step_000000002"
    second = _sections({}, checkpoint={**ckpt, "resume": str(step2)})
    results = run_on_ranks(_train, 2, args=(str(tmp_path / "b"), second, corpus_cache), timeout=600)
    for losses, _ in results:
        _assert_curve(losses, reference, [2, 3, 4, 5])
    step4 = tmp_path / "b" / "checkpoints" / "step_000000004"
    third = _sections({}, checkpoint={"resume": str(step4)})
    losses, text = _train(str(tmp_path / "c"), third, corpus_cache)
    _assert_curve(losses, reference, [4, 5])
    assert "re-derived" in text  # the RNG grid of 2 ranks does not fit 1


def test_resume_between_fsdp_and_zero1(tmp_path, corpus_cache):
    reference, _ = _train(str(tmp_path / "ref"), _sections({}), corpus_cache)
    ckpt = {"interval": 2, "keep_last": 5}
    first = _sections({"fsdp": "full"}, checkpoint=ckpt)
    results = run_on_ranks(_train, 2, args=(str(tmp_path / "a"), first, corpus_cache), timeout=600)
    for losses, _ in results:
        _assert_curve(losses, reference, list(range(STEPS)))
    step2 = tmp_path / "a" / "checkpoints" / "step_000000002"
    second = _sections({"pp": 2}, checkpoint={**ckpt, "resume": str(step2)})
    results = run_on_ranks(_train, 2, args=(str(tmp_path / "b"), second, corpus_cache), timeout=600)
    for losses, _ in results:
        _assert_curve(losses, reference, [2, 3, 4, 5])
    step4 = tmp_path / "b" / "checkpoints" / "step_000000004"
    third = _sections({"fsdp": "zero2"}, checkpoint={"resume": str(step4)})
    results = run_on_ranks(_train, 2, args=(str(tmp_path / "c"), third, corpus_cache), timeout=600)
    for losses, _ in results:
        _assert_curve(losses, reference, [4, 5])
    assert "re-derived" in results[0][1]  # another layout: the RNG grid does not fit


@pytest.mark.slow
def test_resume_at_another_dp_and_batch_size_reads_on_from_the_consumed_samples(
    tmp_path, corpus_cache
):
    # One process with batches of 8 for 2 steps, then of 16 (a ramp); the same run as DP=2 at
    # 8 a step, resumed by one process at 16 a step, must read the same samples per step.
    ramp = {"global_batch_size": 8, "batch_size_ramp": [(2, 16)]}
    sections = _sections({})
    ref = {**sections, "schedule": {**sections["schedule"], **ramp}}
    reference, _ = _train(str(tmp_path / "ref"), ref, corpus_cache)
    first = _sections({}, checkpoint={"interval": 2})
    run_on_ranks(_train, 2, args=(str(tmp_path / "a"), first, corpus_cache), timeout=600)
    step2 = tmp_path / "a" / "checkpoints" / "step_000000002"
    second = _sections({}, checkpoint={"resume": str(step2)})
    second["schedule"]["global_batch_size"] = 16
    losses, text = _train(str(tmp_path / "b"), second, corpus_cache)
    assert "reading continues at sample 16" in text
    _assert_curve(losses, reference, [2, 3, 4, 5])


def test_two_ranks_fall_back_from_a_corrupt_checkpoint(tmp_path, corpus_cache):
    saves = {"interval": 2, "keep_last": 5, "save_at_end": True}
    full = _sections({}, checkpoint=saves)
    results = run_on_ranks(_train, 2, args=(str(tmp_path / "a"), full, corpus_cache), timeout=600)
    reference = results[0][0]
    root = tmp_path / "ckpts"
    shutil.copytree(tmp_path / "a" / "checkpoints", root)
    shutil.rmtree(root / "step_000000006")  # as if the run had been killed after step 4's save
    bad = root / "step_000000004" / "__1_0.distcp"  # written by rank 1
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    bad.write_bytes(bytes(raw))
    resumed = _sections({}, checkpoint={**saves, "dir": str(root), "resume": "auto"})
    results = run_on_ranks(
        _train, 2, args=(str(tmp_path / "b"), resumed, corpus_cache), timeout=600
    )
    for losses, _ in results:
        _assert_curve(losses, reference, [2, 3, 4, 5])
    text = results[0][1]
    assert "__1_0.distcp: checksum mismatch" in text and "fell back to step 2" in text, text


# --- SIGKILL of a real rank process -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _committed_steps(ckpt_dir: Path) -> list[int]:
    from shardwork.dist_checkpoint import is_committed

    if not ckpt_dir.is_dir():
        return []
    return sorted(
        int(p.name.split("_")[1]) for p in ckpt_dir.glob("step_*") if p.is_dir() and is_committed(p)
    )


def _launch(config_path: Path, cache: str, *, fault: str | None = None) -> list[subprocess.Popen]:
    """Two rank processes of ``python -m shardwork.trainer --config config_path``, each writing
    its stderr to ``<config stem>.rank<r>.err`` beside the config (a file, not a pipe: nothing
    reads a pipe while the test waits, and a rank that filled one would block forever)."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            SHARDWORK_CACHE=cache,
            OMP_NUM_THREADS="1",
        )
        env.pop("SHARDWORK_CKPT_FAULT", None)
        if fault is not None:
            env["SHARDWORK_CKPT_FAULT"] = fault
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "shardwork.trainer", "--config", str(config_path)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=_stderr_path(config_path, rank).open("w"),
            )
        )
    return procs


def _stderr_path(config_path: Path, rank: int) -> Path:
    return config_path.with_name(f"{config_path.stem}.rank{rank}.err")


def _wait_for_kill(proc: subprocess.Popen, config_path: Path, rank: int) -> None:
    """Until ``proc`` is killed by SIGKILL; a hang guard that shows both ranks' stderr."""
    try:
        code = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "still running after 240 s"
    tails = {r: _stderr_path(config_path, r).read_text()[-3000:] for r in (0, 1)}
    assert code == -signal.SIGKILL, f"rank {rank}: {code}; stderr of each rank: {tails}"


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=60)


def _write_config(path: Path, run_dir: Path, cache: str, **sections) -> Path:
    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.config.load import config_to_toml
    from shardwork.trainer.testing import tiny_config

    path.write_text(config_to_toml(tiny_config(run_dir, world_size=2, **sections)))
    return path


def test_sigkill_during_training_and_async_write(tmp_path, corpus_cache):
    steps = 16
    reference, _ = _train(str(tmp_path / "ref"), _sections({}, steps=steps), corpus_cache)
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    ckpt = {"interval": 2, "keep_last": 3, "resume": "auto", "save_at_end": False}
    common = _sections({"timeout_minutes": 0.5}, steps=steps, logging={"interval": 1})

    # 1. rank 1 dies by SIGKILL in the middle of training, after a checkpoint committed
    config = _write_config(tmp_path / "sync.toml", run_dir, corpus_cache, **common, checkpoint=ckpt)
    procs = _launch(config, corpus_cache)
    deadline = time.monotonic() + 240
    while not _committed_steps(ckpt_dir):
        assert time.monotonic() < deadline, "no checkpoint committed in time"
        assert procs[1].poll() is None, _stderr_path(config, 1).read_text()
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    assert procs[1].wait(timeout=60) == -signal.SIGKILL
    _kill_all(procs)  # rank 0 would wait for its peer until the collective timeout
    after_kill = _committed_steps(ckpt_dir)
    assert after_kill and after_kill[-1] < steps

    # 2. restart with async saves; rank 1 is killed inside its next checkpoint's data file
    config = _write_config(
        tmp_path / "async.toml",
        run_dir,
        corpus_cache,
        **common,
        checkpoint={**ckpt, "async_save": True},
    )
    procs = _launch(config, corpus_cache, fault="mid_file@1")
    _wait_for_kill(procs[1], config, 1)
    _kill_all(procs)
    complete = _committed_steps(ckpt_dir)
    assert complete == after_kill, "the checkpoint torn by the kill must not count as complete"
    torn = ckpt_dir / f"step_{after_kill[-1] + 2:09d}"
    assert torn.exists()  # the write had started: a torn, uncommitted directory

    # 3. the final restart continues from the last complete checkpoint, losses unchanged
    resumed = _sections({}, steps=steps, checkpoint=ckpt, logging={"interval": 1})
    results = run_on_ranks(_train, 2, args=(str(run_dir), resumed, corpus_cache), timeout=600)
    for losses, _ in results:
        _assert_curve(losses, reference, list(range(complete[-1], steps)))
