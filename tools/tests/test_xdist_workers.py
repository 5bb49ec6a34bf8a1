"""The repository conftest caps ``-n auto`` by the CPUs the run may use and by memory: xdist
really asks it, and it answers one worker per core only where both allow them."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"


def _workers_started(
    tmp_path: Path,
    peak_bytes: int | None,
    env_extra: dict | None = None,
    cpus: set | None = None,
    enter_cgroup: int | None = None,
) -> int:
    """Run ``pytest -n auto`` on one trivial test beside a copy of the repository conftest whose
    per-worker peak is ``peak_bytes`` (None: no conftest, xdist alone), pinned to ``cpus`` when
    given, and started inside the cgroup whose ``cgroup.procs`` is open as ``enter_cgroup``;
    the number of workers xdist started."""

    def before_exec():
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if enter_cgroup is not None:
            os.write(enter_cgroup, str(os.getpid()).encode())

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
        preexec_fn=before_exec,
        pass_fds=() if enter_cgroup is None else (enter_cgroup,),
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
    # A tiny peak: xdist's own answer (one per core), capped by the CPUs this run may use: the
    # suite itself may run pinned to fewer CPUs than the machine has (a container's quota, a
    # CI runner's affinity mask), and the copy's subprocess inherits that.
    cpus = _root_conftest().usable_cpus()
    expected = xdist_alone if cpus is None else min(xdist_alone, cpus)
    assert _workers_started(tmp_path / "tiny", 1) == expected
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


# The kernel's cgroup files, as each version writes them: v1's "no limit" is 2^63 - 1 rounded
# down to a 4 KiB page; v2 writes "max".
V1_NO_LIMIT = str((2**63 - 1) // 4096 * 4096)
GIB = 2**30


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")


def test_cgroup_v2_limit_of_the_process_own_cgroup_and_its_ancestors(tmp_path):
    """A systemd unit's MemoryMax and CPUQuota sit on the process's own cgroup, not the root."""
    root, self_file = tmp_path / "cgroup", tmp_path / "self"
    self_file.write_text("0::/user.slice/job.service\n")
    _tree(root, {
        "cgroup.controllers": "cpu memory",
        "memory.current": str(9 * GIB),  # the root has no memory.max
        "user.slice/memory.max": str(12 * GIB),
        "user.slice/memory.current": str(10 * GIB),  # headroom 2 GiB: the tightest level
        "user.slice/cpu.max": "max 100000",
        "user.slice/job.service/memory.max": str(8 * GIB),
        "user.slice/job.service/memory.current": str(1 * GIB),  # headroom 7 GiB
        "user.slice/job.service/cpu.max": "250000 100000",  # 2.5 CPUs: 3 workers may run
    })  # fmt: skip
    conftest = _root_conftest()
    assert conftest.cgroup_memory_headroom(root, self_file) == 12 * GIB - 10 * GIB
    assert conftest.cgroup_cpu_quota(root, self_file) == 3


def test_cgroup_v1_limit_at_the_process_cgroup_or_at_the_namespace_root(tmp_path):
    """cgroup v1 (older Docker hosts, this CI machine): per-controller hierarchies, and inside a
    container the process's cgroup path is not there, its own cgroup shows as the root."""
    root, self_file = tmp_path / "cgroup", tmp_path / "self"
    self_file.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n")
    _tree(root, {
        "memory/memory.limit_in_bytes": V1_NO_LIMIT,
        "memory/memory.usage_in_bytes": str(20 * GIB),
        "memory/docker/abc/memory.limit_in_bytes": str(8 * GIB),
        "memory/docker/abc/memory.usage_in_bytes": str(3 * GIB),
        "cpu/cpu.cfs_quota_us": "-1",
        "cpu/cpu.cfs_period_us": "100000",
        "cpu/docker/abc/cpu.cfs_quota_us": "150000",
        "cpu/docker/abc/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    conftest = _root_conftest()
    assert conftest.cgroup_memory_headroom(root, self_file) == 8 * GIB - 3 * GIB
    assert conftest.cgroup_cpu_quota(root, self_file) == 2
    # Inside the container: no docker/abc directory, the limits are the root's.
    _tree(root / "ns", {
        "memory/memory.limit_in_bytes": str(6 * GIB),
        "memory/memory.usage_in_bytes": str(1 * GIB),
        "cpu/cpu.cfs_quota_us": "-1",
        "cpu/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    assert conftest.cgroup_memory_headroom(root / "ns", self_file) == 5 * GIB
    assert conftest.cgroup_cpu_quota(root / "ns", self_file) is None


def test_no_cgroup_limits_read_as_none(tmp_path):
    root, self_file = tmp_path / "cgroup", tmp_path / "self"
    self_file.write_text("4:memory:/\n0::/\n")
    _tree(root, {"memory/memory.limit_in_bytes": V1_NO_LIMIT, "memory/memory.usage_in_bytes": "5"})
    conftest = _root_conftest()
    assert conftest.cgroup_memory_headroom(root, self_file) is None
    assert conftest.cgroup_cpu_quota(root, self_file) is None
    assert conftest.cgroup_memory_headroom(root, tmp_path / "absent") is None


def _memory_limited_cgroup(limit: int) -> Path | None:
    """A new cgroup (v1's memory hierarchy, else v2's root) limited to ``limit`` bytes, or None
    where this machine does not let the test make one (no root, no writable hierarchy)."""
    name = f"shardwork-xdist-test-{os.getpid()}"
    for base, limit_file in (
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),
    ):
        group = base / name
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit_file).write_text(str(limit))
            return group
        except OSError:
            group.rmdir()
    return None


def test_a_real_cgroup_memory_limit_caps_the_workers(tmp_path):
    """Started inside a cgroup whose memory holds one worker, ``-n auto`` starts one. Before
    stop 39 the conftest read only a v2 limit at the hierarchy's root: under this machine's
    cgroup v1 it started a worker per core whatever the limit."""
    # Outside a cgroup, the same conftest and a 1 GiB peak start a worker per core here; the
    # test needs that to be more than one, or the cap could not show.
    if _workers_started(tmp_path / "free", GIB) < 2:
        pytest.skip("one worker even without a memory limit (one core or little free memory)")
    group = _memory_limited_cgroup(3 * GIB // 2)
    if group is None:
        pytest.skip("this machine does not let the test make a memory-limited cgroup")
    try:
        with (group / "cgroup.procs").open("w") as procs:
            started = _workers_started(tmp_path / "limited", GIB, enter_cgroup=procs.fileno())
    finally:
        group.rmdir()
    assert started == 1
