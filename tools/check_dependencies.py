"""Check the package dependency graph: acyclic, torch-only packages stay torch-only, imports declared.

Run from the repository root: ``python tools/check_dependencies.py``. Reads each
``packages/*/pyproject.toml`` and every module under ``src/`` and ``tests/``:

- the graph of shardwork runtime dependencies and optional extras must be a DAG;
- parallel-state, moe-router, dist-checkpoint and fused-kernels declare no
  shardwork runtime dependency (optional extras are allowed);
- every known package depends (at run time or through an extra) only on the packages the
  design's layering allows it (``LAYERS``): skipping a layer fails even without a cycle;
- a source module may import ``shardwork.<x>`` only if ``x`` is the package
  itself, a runtime dependency, or an optional extra whose import is gated:
  inside a ``try`` that catches ImportError, inside a function (imported on
  first use), or under ``if TYPE_CHECKING:``;
- a test module may also import its ``test`` group's packages (and their
  runtime dependencies); any other shardwork package only behind
  ``pytest.importorskip("shardwork.<x>...")``, so the package's isolated CI
  job skips instead of failing: a module-level import needs a module-level
  importorskip above it (or a try/except ImportError); an import inside a
  function needs an importorskip of that package somewhere in the module
  (typically in the test that calls the function; not proven to run first).

With ``--structure [packages/<name> ...]`` it checks instead the module-structure rules of
``structure_rules`` (issue 18: no import cycle inside a package, no import of another module's
private name, imports at module top except optional dependencies, function bodies of at most
80 lines) over the named packages' ``src/`` (every package when none is named).

What it reads is the source text: ``import shardwork.x``, ``from shardwork.x import ...``
and ``from shardwork import x``; imports made by name at run time
(``importlib.import_module``) are not seen. Tests call :func:`find_problems` with
another repository root.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib
from dataclasses import dataclass

from structure_rules import deferred_imports, structure_problems

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_ONLY = {"parallel-state", "moe-router", "dist-checkpoint", "fused-kernels"}
LAYERS = {
    "parallel-state": set(),
    "fused-kernels": set(),
    "moe-router": {"fused-kernels"},  # the optional [fused] extra
    "dist-checkpoint": set(),
    "dist-optimizer": {"parallel-state", "dist-checkpoint"},
    "models": {"parallel-state", "fused-kernels", "moe-router", "dist-checkpoint"},
    "trainer": {
        "parallel-state",
        "fused-kernels",
        "moe-router",
        "dist-checkpoint",
        "dist-optimizer",
        "models",
    },
}
"""The design's layering (docs/architecture.md): the shardwork packages each known package may
depend on, at run time or through an extra. An edge outside it fails even without a cycle
(e.g. dist-optimizer -> models). Packages not listed (fixture workspaces) are not checked."""
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", None}


@dataclass(frozen=True)
class Declared:
    """A package's shardwork dependencies by kind (package folder names)."""

    runtime: frozenset[str]
    extras: frozenset[str]
    test: frozenset[str]


@dataclass(frozen=True)
class Use:
    """``import shardwork.<module>`` (or an importorskip of it) at ``line``."""

    module: str
    line: int
    gated: bool  # inside a try catching ImportError, a function, or `if TYPE_CHECKING:`
    scope: ast.AST | None  # the enclosing function; None at module level


def _names(requirements: list[str]) -> frozenset[str]:
    out = set()
    for requirement in requirements:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
        if name.startswith("shardwork-"):
            out.add(name.removeprefix("shardwork-"))
    return frozenset(out)


def read_packages(root: pathlib.Path = ROOT) -> dict[str, Declared]:
    """Every ``packages/<name>/pyproject.toml``'s declared shardwork dependencies."""
    packages = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        extras: set[str] = set()
        for requirements in project.get("optional-dependencies", {}).values():
            extras |= _names(requirements)
        packages[pyproject.parent.name] = Declared(
            runtime=_names(project.get("dependencies", [])),
            extras=frozenset(extras),
            test=_names(data.get("dependency-groups", {}).get("test", [])),
        )
    return packages


def graph_problems(packages: dict[str, Declared]) -> list[str]:
    """Unknown packages, torch-only packages with shardwork dependencies, edges outside
    ``LAYERS``, and cycles."""
    problems = []
    for name, deps in packages.items():
        unknown = (deps.runtime | deps.extras | deps.test) - set(packages)
        if unknown:
            problems.append(f"{name}: depends on unknown shardwork packages {sorted(unknown)}")
        if name in TORCH_ONLY and deps.runtime:
            problems.append(
                f"{name}: must depend on torch only, but declares {sorted(deps.runtime)}"
            )
        elif name in LAYERS and (
            outside := sorted((deps.runtime | deps.extras) - LAYERS[name] - unknown)
        ):
            problems.append(
                f"{name}: depends on {outside}, outside the design's layering "
                f"(allowed: {sorted(LAYERS[name]) or 'torch only'})"
            )
    # Runtime + extras: an extra that closes a cycle is still a cycle.
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == "open":
            problems.append("dependency cycle: " + " -> ".join([*trail, node]))
            return
        if state.get(node) == "done":
            return
        state[node] = "open"
        for dep in sorted(packages[node].runtime | packages[node].extras):
            if dep in packages:
                visit(dep, [*trail, node])
        state[node] = "done"

    for name in packages:
        visit(name, [])
    return problems


def _catches_import_error(node: ast.Try) -> bool:
    caught: set[str | None] = set()
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        caught |= {None if t is None else getattr(t, "id", getattr(t, "attr", None)) for t in types}
    return bool(caught & _IMPORT_ERRORS)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == (
        "TYPE_CHECKING"
    )


def _skip_target(node: ast.Call) -> str | None:
    """``x`` of ``pytest.importorskip("shardwork.x...")``, else None."""
    func = node.func
    if getattr(func, "attr", getattr(func, "id", None)) != "importorskip" or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        parts = first.value.split(".")
        if parts[0] == "shardwork" and len(parts) > 1:
            return parts[1]
    return None


def uses(tree: ast.AST, *, skips_too: bool = True) -> tuple[list[Use], list[Use]]:
    """Shardwork imports and ``importorskip`` calls of a module, with their context.

    With ``skips_too=False`` (a module whose text has no "importorskip") expressions are
    not visited, which is most of the tree.
    """
    imports: list[Use] = []
    skips: list[Use] = []

    def walk(node: ast.AST, gated: bool, scope: ast.AST | None) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "shardwork" and len(parts) > 1:
                    imports.append(Use(parts[1], node.lineno, gated, scope))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "shardwork":
                modules = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
                imports.extend(Use(m, node.lineno, gated, scope) for m in modules)
        elif isinstance(node, ast.Call) and (target := _skip_target(node)):
            skips.append(Use(target, node.lineno, gated, scope))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for child in ast.iter_child_nodes(node):
                walk(child, True, node)
        elif isinstance(node, ast.Try | ast.TryStar) and _catches_import_error(node):
            for child in node.body:
                walk(child, True, scope)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                walk(child, gated, scope)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                walk(child, True, scope)
            for child in node.orelse:
                walk(child, gated, scope)
        else:
            for child in ast.iter_child_nodes(node):
                if skips_too or not isinstance(child, ast.expr):
                    walk(child, gated, scope)

    walk(tree, False, None)
    return imports, skips


def _uses_of(path: pathlib.Path) -> tuple[list[Use], list[Use]]:
    text = path.read_text()
    if "shardwork" not in text:
        return [], []
    return uses(ast.parse(text, filename=str(path)), skips_too="importorskip" in text)


def _skipped(use: Use, skips: list[Use]) -> bool:
    """Whether a test module's import of ``use.module`` runs only where the package exists.

    At module level (collection time) it needs a module-level importorskip above it or an
    ImportError gate; in a function (a test or a rank function it calls) an importorskip of
    the package anywhere in the module is trusted to run first.
    """
    same = [skip for skip in skips if skip.module == use.module]
    if use.scope is None:
        return use.gated or any(skip.scope is None and skip.line < use.line for skip in same)
    return bool(same)


def import_problems(root: pathlib.Path, packages: dict[str, Declared]) -> list[str]:
    """Source and test imports of shardwork packages that the importer does not declare."""
    module_to_package = {name.replace("-", "_"): name for name in packages}
    problems = []
    for name, deps in packages.items():
        base = root / "packages" / name
        for path in sorted((base / "src").rglob("*.py")):
            imports, _ = _uses_of(path)
            for use in imports:
                target = module_to_package.get(use.module)
                if target is None or target == name or target in deps.runtime:
                    continue
                if target in deps.extras and use.gated:
                    continue
                how = (
                    "an optional extra imported without a gate (try/except ImportError, "
                    "a function, or if TYPE_CHECKING)"
                    if target in deps.extras
                    else "not a declared runtime dependency"
                )
                where = path.relative_to(root)
                problems.append(f"{where}:{use.line}: imports shardwork.{use.module}, {how}")
        allowed = {name} | deps.runtime | deps.test
        for dep in deps.runtime | deps.test:
            allowed |= packages[dep].runtime if dep in packages else set()
        for path in sorted((base / "tests").rglob("*.py")):
            imports, skips = _uses_of(path)
            for use in imports:
                target = module_to_package.get(use.module)
                if target is None or target in allowed:
                    continue
                if _skipped(use, skips):
                    continue
                problems.append(
                    f"{path.relative_to(root)}:{use.line}: test imports shardwork.{use.module} "
                    f"without declaring it (add shardwork-{target} to the test group, or call "
                    f'pytest.importorskip("shardwork.{use.module}") before it)'
                )
    return problems


def find_problems(root: pathlib.Path = ROOT) -> list[str]:
    """Every problem of the workspace at ``root`` (empty: the check passes)."""
    packages = read_packages(root)
    return graph_problems(packages) + import_problems(root, packages)


def main(root: pathlib.Path = ROOT) -> int:
    problems = find_problems(root)
    for problem in problems:
        print(f"dependency check: {problem}")
    if not problems:
        packages = read_packages(root)
        graph = ", ".join(f"{n} <- {sorted(d.runtime) or '[torch]'}" for n, d in packages.items())
        print(f"dependency check: {len(packages)} packages, acyclic, imports declared ({graph})")
    return 1 if problems else 0


def main_structure(folders: list[str], root: pathlib.Path = ROOT) -> int:
    """The structure rules over ``folders`` (package folders; every package when empty)."""
    packages = [root / f for f in folders] or sorted(root.glob("packages/*/"))
    problems, deferred = [], []
    for package in packages:
        if not (package / "pyproject.toml").is_file() or not (package / "src").is_dir():
            print(f"structure check: {package} is not a package folder (packages/<name>)")
            return 2
        problems += structure_problems(package.resolve(), root)
        deferred += deferred_imports(package.resolve(), root)
    for line in deferred:
        print(f"deferred import (allowed, reason given): {line}")
    for problem in problems:
        print(problem)
    names = ", ".join(package.name for package in packages)
    print(f"structure check: {len(problems)} problem(s) in {names}")
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--structure"]:
        sys.exit(main_structure(sys.argv[2:]))
    sys.exit(main())
