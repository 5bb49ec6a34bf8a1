"""tools/lowest_requirements.py on a small fixture workspace, and on the real one.

The fixture: ``top`` needs ``mid[fast]`` at run time and ``base`` in its test group; ``mid``
needs ``base`` and its ``fast`` extra asks for ``speedup``; an unused extra of ``base`` must
not appear. The expected lines are written out here, not derived from the tool.
"""

import json
import pathlib

import lowest_requirements
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _package(root, name, runtime, extras=None, test=()):
    folder = root / "packages" / name
    folder.mkdir(parents=True)
    lines = ["[project]", f'name = "shardwork-{name}"', 'version = "0.1.0"']
    lines.append(f"dependencies = {json.dumps(runtime)}")  # a JSON list is a TOML array
    if extras:
        lines.append("[project.optional-dependencies]")
        lines += [f"{key} = {json.dumps(values)}" for key, values in extras.items()]
    if test:
        lines += ["[dependency-groups]", f"test = {json.dumps(list(test))}"]
    (folder / "pyproject.toml").write_text("\n".join(lines) + "\n")


@pytest.fixture
def workspace(tmp_path):
    _package(tmp_path, "base", ["torch>=2.14", "numpy>=1.26"], {"unused": ["never>=1"]})
    _package(tmp_path, "mid", ["torch>=2.14", "shardwork-base"], {"fast": ["speedup>=1.6"]})
    _package(
        tmp_path,
        "top",
        ["torch>=2.14", "tqdm>=4.66", "shardwork-mid[fast]"],
        test=["pytest>=8.3", "shardwork-base", "hypothesis>=6.100; sys_platform == 'linux'"],
    )
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for module in ("base", "mid", "top"):
        (wheels / f"shardwork_{module}-0.1.0-py3-none-any.whl").write_bytes(b"")
    return tmp_path, wheels


def test_closure_with_extras_and_test_group_at_their_bounds(workspace):
    root, wheels = workspace
    uri = {m: (wheels / f"shardwork_{m}-0.1.0-py3-none-any.whl").resolve().as_uri() for m in
           ("base", "mid", "top")}  # fmt: skip
    assert lowest_requirements.lowest_requirements("top", wheels, root) == sorted(
        [
            "torch>=2.14",
            "numpy>=1.26",
            "tqdm>=4.66",
            "speedup>=1.6",
            "pytest>=8.3",
            "hypothesis>=6.100; sys_platform == 'linux'",
            f"shardwork-base @ {uri['base']}",
            f"shardwork-mid[fast] @ {uri['mid']}",
            f"shardwork-top @ {uri['top']}",
        ]
    )
    # a package's own test group is not its dependencies': base's lines only
    assert lowest_requirements.lowest_requirements("base", wheels, root) == sorted(
        ["torch>=2.14", "numpy>=1.26", f"shardwork-base @ {uri['base']}"]
    )


def test_a_missing_wheel_and_an_unknown_package_are_named(workspace, capsys):
    root, wheels = workspace
    (wheels / "shardwork_mid-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(ValueError, match=r"one wheel of shardwork-mid .* found 0: build it"):
        lowest_requirements.lowest_requirements("top", wheels, root)
    with pytest.raises(ValueError, match=r"no package 'nope'"):
        lowest_requirements.lowest_requirements("nope", wheels, root)
    assert lowest_requirements.main(["nope"]) == 2
    assert "usage" in capsys.readouterr().err


def test_every_real_package_pins_torch_and_names_its_workspace_wheels(tmp_path):
    """On the real workspace: each package's lines hold its torch bound and one wheel line per
    shardwork package it needs (trainer: all seven; moe-router: itself and parallel-state)."""
    for name in ("parallel-state", "fused-kernels", "moe-router", "dist-checkpoint",
                 "dist-optimizer", "models", "trainer"):  # fmt: skip
        (tmp_path / f"shardwork_{name.replace('-', '_')}-0.1.0-py3-none-any.whl").write_bytes(b"")
    lines = {n: lowest_requirements.lowest_requirements(n, tmp_path, REPO) for n in
             ("moe-router", "trainer")}  # fmt: skip
    wheels = {n: sorted(line.split(" @ ")[0] for line in ls if " @ " in line) for n, ls in
              lines.items()}  # fmt: skip
    assert wheels["moe-router"] == ["shardwork-moe-router", "shardwork-parallel-state"]
    assert len(wheels["trainer"]) == 7
    assert "shardwork-dist-checkpoint[fast-crc]" in wheels["trainer"]
    assert "isal>=1.6" in lines["trainer"]
    for ls in lines.values():
        assert [line for line in ls if line.startswith("torch")] == ["torch>=2.14"]
