"""Fail on breaking changes to a package's public API since its last release tag.

For each package, the newest release tag ``shardwork-<name>-vX.Y.Z`` (see docs/releasing.md;
tags with a suffix, such as ``-v1.0.0rc1``, are not releases) is the baseline; griffe compares
the package's public API at that tag with the working tree and reports removed or
incompatibly changed objects (a removed function, a removed or reordered parameter, ...);
additions are compatible. A breaking change is allowed only together with a major version
bump, or a minor bump while the major version is 0, which is how docs/releasing.md says to
ship one. A package with no release tag yet has no baseline and is reported as such.

Run from the repository root: ``python tools/check_api.py [package ...]``; exit status 1 on
a disallowed breaking change. Tests call :func:`check` with another repository root.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

import griffe

ROOT = pathlib.Path(__file__).resolve().parent.parent
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

Version = tuple[int, int, int]


def release_tags(name: str, root: pathlib.Path = ROOT) -> list[tuple[Version, str]]:
    """Release tags of ``shardwork-<name>`` as (version, tag), oldest first."""
    listed = subprocess.run(
        ["git", "tag", "--list", f"shardwork-{name}-v*"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    releases = []
    for tag in listed:
        match = _VERSION.fullmatch(tag.removeprefix(f"shardwork-{name}-v"))
        if match:
            releases.append((tuple(int(part) for part in match.groups()), tag))
    return sorted(releases)


def working_tree_version(name: str, root: pathlib.Path = ROOT) -> Version:
    """``X.Y.Z`` of ``packages/<name>/pyproject.toml`` (a suffix such as ``.dev1`` is ignored)."""
    path = root / "packages" / name / "pyproject.toml"
    version = tomllib.loads(path.read_text())["project"]["version"]
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"{path}: project.version={version!r} does not start with X.Y.Z")
    return tuple(int(part) for part in match.groups())


def allows_breaking(released: Version, current: Version) -> bool:
    """Whether going from ``released`` to ``current`` may break the API (semver, 0.x minor)."""
    if released[0] == 0:
        return current[:2] > released[:2]
    return current[0] > released[0]


def check(name: str, root: pathlib.Path = ROOT) -> list[str]:
    """Problems with ``packages/<name>``'s public API against its last release (empty: fine)."""
    releases = release_tags(name, root)
    if not releases:
        print(f"api check: shardwork-{name}: no release tag yet, no baseline to compare against")
        return []
    released, tag = releases[-1]
    current = working_tree_version(name, root)
    module = "shardwork." + name.replace("-", "_")
    old = griffe.load_git(module, ref=tag, repo=root, search_paths=[f"packages/{name}/src"])
    new = griffe.load(module, search_paths=[root / "packages" / name / "src"])
    breakages = [_ANSI.sub("", b.explain()) for b in griffe.find_breaking_changes(old, new)]
    if not breakages:
        print(f"api check: shardwork-{name}: public API compatible with {tag}")
        return []
    shown = ".".join(map(str, current))
    if allows_breaking(released, current):
        print(
            f"api check: shardwork-{name}: {len(breakages)} breaking changes since {tag}, "
            f"allowed by the version bump to {shown}"
        )
        return []
    return [
        f"shardwork-{name} {shown} since {tag} (a breaking change needs "
        f"{'a minor' if released[0] == 0 else 'a major'} version bump): {breakage}"
        for breakage in breakages
    ]


def main(names: list[str], root: pathlib.Path = ROOT) -> int:
    names = names or sorted(p.parent.name for p in root.glob("packages/*/pyproject.toml"))
    problems = [problem for name in names for problem in check(name, root)]
    for problem in problems:
        print(f"api check: BREAKING {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
