"""The environment ``shardwork-train`` and ``shardwork-generate`` set before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardwork.trainer.cpu_runtime import (
    GLIBC_MALLOC_VARIABLES,
    huge_pages_offered,
    set_cpu_runtime_env,
)

NAMES = ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE", *GLIBC_MALLOC_VARIABLES)
MIB = 1 << 20


def _has_mallinfo2() -> bool:
    """glibc 2.33 or later: mallopt, and mallinfo2 to read the allocator's counters."""
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (AttributeError, ValueError, OSError):
        return False
    major, _, minor = version.partition(".")
    return name == "glibc" and (int(major), int(minor.split(".")[0])) >= (2, 33)


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.setenv(name, "placeholder")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)
    # glibc read its MALLOC_* variables when this process started, so setting one here changes
    # nothing but set_cpu_runtime_env's choice: it leaves this test process's allocator alone.
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))
    return monkeypatch


def _mode_file(tmp_path, text):
    path = tmp_path / "enabled"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("mode", "offered"),
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
    ],
)
def test_huge_pages_follow_the_kernels_mode(clean_env, tmp_path, mode, offered):
    path = _mode_file(tmp_path, mode)
    assert huge_pages_offered(path) is offered
    settings = set_cpu_runtime_env(path)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == ("1" if offered else None)
    expected = {"OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "1" if offered else None}
    assert settings == {**expected, "reuse_freed_memory": False}


def test_no_mode_file_means_no_huge_pages(clean_env, tmp_path):
    missing = tmp_path / "absent"
    assert not huge_pages_offered(missing)
    set_cpu_runtime_env(missing)
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ


def test_an_explicit_setting_wins(clean_env, tmp_path):
    clean_env.setenv("OMP_WAIT_POLICY", "ACTIVE")
    clean_env.setenv("THP_MEM_ALLOC_ENABLE", "0")
    set_cpu_runtime_env(_mode_file(tmp_path, "always [madvise] never\n"))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


# Run in a fresh process: the allocator's settings last for the process. It allocates a 64 MiB
# block (twice glibc's largest automatic mmap threshold, 32 MiB) and frees it, reading glibc's
# own counters (mallinfo2) around each: `mapped` bytes in blocks mmapped for themselves,
# `heap` bytes the heap holds from the kernel, `heap_free` of those not in use, `heap_in_use`
# of those in use.
ALLOCATE_AND_FREE = """
import ctypes, json, sys
from shardwork.trainer.cpu_runtime import reuse_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = reuse_freed_memory() if sys.argv[1] == "reuse" else None
if sys.argv[2] == "torch":
    import torch
    make = lambda: torch.empty(16 << 20, dtype=torch.float32).fill_(1.5)
else:
    make = lambda: bytearray(64 << 20)

def counters():
    info = libc.mallinfo2()
    return {"mapped": info.hblkhd, "heap": info.arena, "heap_free": info.fordblks,
            "heap_in_use": info.uordblks}

before = counters()
block = make()
during = counters()
del block
print(json.dumps({"applied": applied, "before": before, "during": during, "after": counters()}))
"""


def _allocate_and_free(mode: str, allocator: str) -> dict:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}  # torch's 2 MiB-aligned path too
    for name in GLIBC_MALLOC_VARIABLES:
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATE_AND_FREE, mode, allocator],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_glibc_default_maps_a_large_block_and_unmaps_it():
    seen = _allocate_and_free("default", "bytes")
    assert seen["during"]["mapped"] - seen["before"]["mapped"] >= 64 * MIB
    assert seen["after"]["mapped"] == seen["before"]["mapped"]
    assert seen["after"]["heap"] - seen["before"]["heap"] < 64 * MIB


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
@pytest.mark.parametrize("allocator", ["bytes", "torch"])
def test_reused_memory_comes_from_the_heap_and_stays_there(allocator):
    seen = _allocate_and_free("reuse", allocator)
    assert seen["applied"] is True
    assert seen["during"]["mapped"] == seen["before"]["mapped"]  # nothing mmapped for it
    # the block is the heap's (the heap itself may grow by less: it can reuse free space)
    assert seen["during"]["heap_in_use"] - seen["before"]["heap_in_use"] >= 64 * MIB
    # freed, yet still the heap's, free for the next step's tensors
    assert seen["after"]["heap"] == seen["during"]["heap"]
    assert seen["after"]["heap_free"] - seen["during"]["heap_free"] >= 64 * MIB


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_a_glibc_malloc_variable_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    out = subprocess.run(
        [sys.executable, "-c", "from shardwork.trainer.cpu_runtime import reuse_freed_memory;"
         "print(reuse_freed_memory())"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == "False"
