"""The requirements that install one package alone at the lowest versions it declares.

Run from the repository root: ``python tools/lowest_requirements.py NAME WHEEL_DIR`` prints one
requirement per line for ``uv pip install --resolution lowest-direct -r -``:

- every runtime requirement and ``test`` group requirement of ``packages/NAME``, and the runtime
  requirements (with the extras asked for) of every workspace package those pull in, so that
  ``lowest-direct`` takes the lowest version each of them declares, not only NAME's own;
- each workspace package as its wheel in WHEEL_DIR (``shardwork-x[extra] @ file://...``),
  which the caller built; a wheel that is missing is an error naming the package.

Why: the packages' bounds (``torch>=...``, ``transformers>=...``) are what ``pip install
shardwork-moe-router`` gives a team with its own stack, and nothing else tests them: the
workspace lock holds the newest versions. Measured at stop 46: under the bounds declared then
(``torch>=2.5``) dist-checkpoint failed 59 of its tests on torch 2.6 (``dcp.save`` had no
``no_dist``), and moe-router's transformers integration failed on every transformers release
before 5.19 that its ``>=5.0`` admitted.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PREFIX = "shardwork-"


def _split(requirement: str) -> tuple[str, frozenset[str], str]:
    """(name, extras, the rest: version bounds and marker) of one requirement string."""
    match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?\s*(.*)", requirement)
    if match is None:
        raise ValueError(f"cannot read requirement {requirement!r}")
    name, extras, rest = match.groups()
    wanted = frozenset(e.strip() for e in (extras or "").split(",") if e.strip())
    return name.lower(), wanted, rest.strip()


def _project(root: pathlib.Path, name: str) -> dict:
    path = root / "packages" / name / "pyproject.toml"
    if not path.is_file():
        raise ValueError(f"no package {name!r}: {path} does not exist")
    return tomllib.loads(path.read_text())


def _wheel(wheel_dir: pathlib.Path, name: str) -> pathlib.Path:
    module = name.replace("-", "_")
    found = sorted(wheel_dir.glob(f"shardwork_{module}-*.whl"))
    if len(found) != 1:
        raise ValueError(
            f"expected one wheel of shardwork-{name} in {wheel_dir}, found {len(found)}: "
            f"build it with `uv build --package shardwork-{name} --wheel --out-dir {wheel_dir}`"
        )
    return found[0]


def lowest_requirements(name: str, wheel_dir: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Requirement lines (sorted, without duplicates) for package ``name``; see the module doc."""
    data = _project(root, name)
    pending = [(PREFIX + name, frozenset())]
    pending += [_split(r)[:2] for r in data.get("dependency-groups", {}).get("test", [])]
    lines: set[str] = set()
    extras_of: dict[str, set[str]] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement_name, extras = pending.pop()
        if not requirement_name.startswith(PREFIX):
            continue
        package = requirement_name.removeprefix(PREFIX)
        if (package, extras) in seen:
            continue
        seen.add((package, extras))
        extras_of.setdefault(package, set()).update(extras)
        project = _project(root, package)["project"]
        requirements = list(project.get("dependencies", []))
        for extra in extras:
            requirements += project.get("optional-dependencies", {}).get(extra, [])
        for requirement in requirements:
            dependency, wanted, _ = _split(requirement)
            if dependency.startswith(PREFIX):
                pending.append((dependency, wanted))
            else:
                lines.add(requirement)
    for requirement in data.get("dependency-groups", {}).get("test", []):
        if not _split(requirement)[0].startswith(PREFIX):
            lines.add(requirement)
    for package, extras in extras_of.items():
        suffix = f"[{','.join(sorted(extras))}]" if extras else ""
        lines.add(f"{PREFIX}{package}{suffix} @ {_wheel(wheel_dir, package).resolve().as_uri()}")
    return sorted(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tools/lowest_requirements.py NAME WHEEL_DIR", file=sys.stderr)
        return 2
    try:
        lines = lowest_requirements(argv[0], pathlib.Path(argv[1]))
    except ValueError as error:
        print(f"lowest_requirements: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
