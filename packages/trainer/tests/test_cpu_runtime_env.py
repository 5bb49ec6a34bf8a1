"""The environment ``shardwork-train`` and ``shardwork-generate`` set before torch loads."""

from __future__ import annotations

import os

import pytest

from shardwork.trainer.cli import huge_pages_offered, set_cpu_runtime_env

NAMES = ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.setenv(name, "placeholder")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)
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
    set_cpu_runtime_env(path)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == ("1" if offered else None)


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
