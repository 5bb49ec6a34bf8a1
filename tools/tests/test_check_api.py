"""tools/check_api.py against a throwaway git repository holding one tiny package.

The repository is laid out like ours (``packages/toy/pyproject.toml``, a PEP 420
``src/shardwork/toy`` package re-exporting from a submodule) and carries release tags
``shardwork-toy-vX.Y.Z``; each test edits the working tree and checks the verdict.
"""

import os
import subprocess

import check_api
import pytest

GREET = 'def greet(name: str) -> str:\n    return "hi " + name\n'
SCALE = "def scale(x: float, factor: float = 2.0) -> float:\n    return x * factor\n"
SHOUT = "def shout(text: str) -> str:\n    return text.upper()\n"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.org",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.org",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


class ToyRepo:
    """A git repository with ``packages/toy``; write its API and version, commit and tag."""

    def __init__(self, root):
        self.root = root
        self.package = root / "packages" / "toy"
        (self.package / "src" / "shardwork" / "toy").mkdir(parents=True)
        self.git("init", "-q", "-b", "main")

    def git(self, *args):
        subprocess.run(
            ["git", *args],
            cwd=self.root,
            check=True,
            capture_output=True,
            env=os.environ | _GIT_ENV,
        )

    def write(self, *functions, version):
        """``core.py`` holds ``functions`` (source texts); ``__init__`` re-exports them all."""
        names = [text.split("(")[0].removeprefix("def ") for text in functions]
        module = self.package / "src" / "shardwork" / "toy"
        (module / "core.py").write_text("\n\n".join(functions))
        (module / "__init__.py").write_text(
            f"from shardwork.toy.core import {', '.join(names)}\n\n__all__ = {names!r}\n"
        )
        (self.package / "pyproject.toml").write_text(
            f'[project]\nname = "shardwork-toy"\nversion = "{version}"\n'
        )

    def commit(self, tag=None):
        self.git("add", "-A")
        self.git("commit", "-q", "-m", tag or "work")
        if tag:
            self.git("tag", tag)


@pytest.fixture
def toy(tmp_path):
    """``toy`` released as 0.1.0 with greet and scale."""
    repo = ToyRepo(tmp_path)
    repo.write(GREET, SCALE, version="0.1.0")
    repo.commit("shardwork-toy-v0.1.0")
    return repo


def test_added_function_passes(toy, capsys):
    toy.write(GREET, SCALE, SHOUT, version="0.1.0")
    assert check_api.check("toy", toy.root) == []
    assert "public API compatible with shardwork-toy-v0.1.0" in capsys.readouterr().out


def test_renamed_function_and_removed_parameter_fail_naming_them(toy, capsys):
    renamed = GREET.replace("greet", "hello")
    toy.write(renamed, "def scale(x: float) -> float:\n    return 2.0 * x\n", version="0.1.1")
    assert check_api.main(["toy"], toy.root) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "BREAKING" in line]
    prefix = (
        "api check: BREAKING shardwork-toy 0.1.1 since shardwork-toy-v0.1.0 "
        "(a breaking change needs a minor version bump): "
    )
    assert lines and all(line.startswith(prefix) for line in lines), lines
    assert any(line.endswith("greet: Public object was removed") for line in lines), lines
    assert any("scale(factor): Parameter was removed" in line for line in lines), lines
    assert not any("\x1b" in line for line in lines)  # plain text, no terminal colours
    assert not any("hello" in line for line in lines)  # an addition is not a breakage


def test_breaking_change_with_a_minor_bump_passes_while_major_is_zero(toy, capsys):
    toy.write(SCALE, version="0.2.0")
    assert check_api.check("toy", toy.root) == []
    assert "allowed by the version bump to 0.2.0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("released", "current", "allowed"),
    [
        ((0, 1, 0), (0, 1, 0), False),
        ((0, 1, 0), (0, 1, 1), False),  # 0.x: a patch release must not break
        ((0, 1, 0), (0, 2, 0), True),  # 0.x: a minor bump may
        ((0, 1, 0), (1, 0, 0), True),
        ((1, 2, 0), (1, 3, 0), False),  # from 1.0 on only a major bump may
        ((1, 2, 0), (1, 2, 1), False),
        ((1, 2, 0), (2, 0, 0), True),
        ((0, 3, 0), (0, 2, 9), False),
    ],
)
def test_version_policy(released, current, allowed):
    assert check_api.allows_breaking(released, current) is allowed


def test_baseline_is_the_newest_release_by_version_not_by_name(toy):
    # 0.9.0 has greet and scale; 0.10.0 adds shout; a pre-release tag is not a baseline.
    toy.write(GREET, SCALE, version="0.9.0")
    toy.commit("shardwork-toy-v0.9.0")
    toy.write(GREET, SCALE, SHOUT, version="0.10.0")
    toy.commit("shardwork-toy-v0.10.0")
    toy.write(GREET, version="0.11.0rc1")
    toy.commit("shardwork-toy-v0.11.0rc1")
    assert [tag for _, tag in check_api.release_tags("toy", toy.root)] == [
        "shardwork-toy-v0.1.0",
        "shardwork-toy-v0.9.0",
        "shardwork-toy-v0.10.0",
    ]
    # Removing shout breaks only against 0.10.0 (a string sort would pick 0.9.0).
    toy.write(GREET, SCALE, version="0.10.1")
    problems = check_api.check("toy", toy.root)
    assert problems and all("since shardwork-toy-v0.10.0" in p for p in problems), problems
    assert any(p.endswith("shout: Public object was removed") for p in problems), problems


def test_package_without_a_release_tag_has_no_baseline(tmp_path, capsys):
    toy = ToyRepo(tmp_path)
    toy.write(GREET, version="0.1.0")
    toy.commit()
    assert check_api.check("toy", toy.root) == []
    assert "no release tag yet" in capsys.readouterr().out


def test_version_that_is_not_semver_is_named(toy):
    toy.write(SCALE, version="one")
    with pytest.raises(ValueError, match=r"project.version='one' does not start with X.Y.Z"):
        check_api.check("toy", toy.root)
