"""Fail on breaking changes to a package's public API since its last release tag.

For each package, the newest tag ``shardwork-<name>-vX.Y.Z`` (see docs/releasing.md) is
the baseline; griffe compares the package's public API at that tag with the working tree
and reports removed or incompatibly changed objects. A breaking change is allowed only
together with a major version bump (or a minor bump while the major version is 0), which is
how docs/releasing.md says to ship one. A package with no release tag yet has no baseline
and is reported as such.

Run from the repository root: ``python tools/check_api.py [package ...]``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

import griffe

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _last_tag(name: str) -> str | None:
    tags = subprocess.run(
        ["git", "tag", "--list", f"shardwork-{name}-v*", "--sort=-v:refname"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return tags[0] if tags else None


def _version(name: str) -> tuple[int, ...]:
    data = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())
    return tuple(int(x) for x in data["project"]["version"].split(".")[:3])


def _allows_breaking(old: tuple[int, ...], new: tuple[int, ...]) -> bool:
    if old[0] == 0:
        return new[:2] > old[:2]
    return new[0] > old[0]


def check(name: str) -> list[str]:
    tag = _last_tag(name)
    if tag is None:
        print(f"api check: shardwork-{name}: no release tag yet, no baseline to compare against")
        return []
    module = "shardwork." + name.replace("-", "_")
    search = [str(ROOT / "packages" / name / "src")]
    old = griffe.load_git(module, ref=tag, repo=ROOT, search_paths=[f"packages/{name}/src"])
    new = griffe.load(module, search_paths=search)
    breakages = list(griffe.find_breaking_changes(old, new))
    old_version = tuple(int(x) for x in tag.rsplit("-v", 1)[1].split(".")[:3])
    if breakages and _allows_breaking(old_version, _version(name)):
        print(
            f"api check: shardwork-{name}: {len(breakages)} breaking changes since {tag}, allowed by the version bump"
        )
        return []
    problems = [f"shardwork-{name} since {tag}: {b.explain()}" for b in breakages]
    if not problems:
        print(f"api check: shardwork-{name}: public API compatible with {tag}")
    return problems


def main(names: list[str]) -> int:
    names = names or sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
    problems = [problem for name in names for problem in check(name)]
    for problem in problems:
        print(f"api check: BREAKING {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
