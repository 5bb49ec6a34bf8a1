"""The repository conftest caps ``-n auto`` by the CPUs the run may use and by memory: xdist
really asks it, and it answers one worker per core only where both allow them."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT_CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"


def _workers_started(
    tmp_path: Path, peak_bytes: int | None, env_extra: dict | None = None, cpus: set | None = None
) -> int:
    """Run ``pytest -n auto`` on one trivial test beside a copy of the repository conftest whose
    per-worker peak is ``peak_bytes`` (None: no conftest, xdist alone), pinned to ``cpus`` when
    given; the number of workers xdist started."""
    tmp_path.mkdir()
    if peak_bytes is not None:
        conftest, count = re.subn(
            r"^WORKER_PEAK_BYTES = .*$",
            f"WORKER_PEAK_BYTES = {peak_bytes}",
            ROOT_CONFTEST.read_text(),
            flags=re.M,
        )
        assert count == 1
        (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_AUTO_NUM_WORKERS"}
    env.update(env_extra or {})
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    started = re.search(r"created: (\d+)/\d+ workers?", out.stdout)
    assert started, out.stdout
    return int(started.group(1))


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_xdist_asks_the_conftest_which_caps_auto(tmp_path):
    available = _root_conftest().available_memory_bytes()
    assert available is not None and available > 0  # /proc/meminfo on Linux
    xdist_alone = _workers_started(tmp_path / "plain", None)
    # A worker's peak larger than the machine's memory: one worker, whatever the cores.
    assert _workers_started(tmp_path / "huge", 1 << 60) == 1
    # A tiny peak: xdist's own answer (one per core).
    assert _workers_started(tmp_path / "tiny", 1) == xdist_alone
    # Pinned to one CPU: one worker (xdist alone counts the machine's physical cores where
    # psutil is installed, whatever the affinity).
    assert _workers_started(tmp_path / "pinned", 1, cpus={min(os.sched_getaffinity(0))}) == 1
    # xdist's own variable still wins over the cap.
    assert _workers_started(tmp_path / "env", 1 << 60, {"PYTEST_XDIST_AUTO_NUM_WORKERS": "2"}) == 2


def test_workers_for_takes_the_smaller_of_cores_and_memory():
    root = _root_conftest()
    gib = 2**30
    # 32 cores and 64 GiB free: 16 workers of 4 GiB (32 would need ~70-125 GiB).
    assert root.workers_for(32, 64 * gib) == 16
    assert root.workers_for(2, 19 * gib) == 2  # this machine: unchanged
    assert root.workers_for(8, 3 * gib) == 1  # never fewer than one
    assert root.workers_for(8, None) == 8  # memory unknown: xdist's answer
