"""tools/megatron_env.py's pure parts (building the environment needs PyPI and ~1 min: not here).

- The wheel rename keeps name and version and puts the ``py3-none-any`` tags (pip reads the
  tags from the file name only).
- The pins exported from ``uv.lock`` name the very versions this workspace's environment runs
  (``uv sync --locked`` installed them), so the scratch environment gets the project's torch.
"""

import importlib.metadata

import megatron_env
import pytest


def test_wheel_renamed_to_pure_python_tags():
    name = "megatron_core-0.19.2-cp312-cp312-manylinux_2_39_x86_64.whl"
    assert megatron_env.pure_python_wheel_name(name) == "megatron_core-0.19.2-py3-none-any.whl"
    # a build tag (6 parts) stays
    assert (
        megatron_env.pure_python_wheel_name("pkg-1.0-1-cp312-abi3-linux_x86_64.whl")
        == "pkg-1.0-1-py3-none-any.whl"
    )
    with pytest.raises(ValueError, match="not a wheel"):
        megatron_env.pure_python_wheel_name("megatron_core-0.19.2.tar.gz")


def test_locked_pins_are_the_workspace_versions():
    pins = megatron_env.locked_requirements()
    for package in megatron_env.LOCKED_PACKAGES:
        installed = importlib.metadata.version(package).split("+")[0]
        versions = [
            line.split("==")[1].split(";")[0].strip()
            for line in pins
            if line.startswith(f"{package}==")
        ]
        assert installed in versions, (package, installed, pins)
