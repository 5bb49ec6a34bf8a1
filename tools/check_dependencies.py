"""Check the package dependency graph: acyclic, torch-only packages stay torch-only, imports declared.

Run from the repository root: ``python tools/check_dependencies.py``. Reads each
``packages/*/pyproject.toml`` and every module under ``src/`` and ``tests/``:

- the graph of shardwork runtime dependencies must be a DAG;
- parallel-state, moe-router, dist-checkpoint and fused-kernels declare no
  shardwork runtime dependency (optional extras are allowed);
- a source module may import ``shardwork.<x>`` only if ``x`` is the package
  itself, a runtime dependency, or an optional extra imported inside a
  ``try``/``except ImportError`` block or a function (so the import is gated);
- a test module may also import its ``test`` group's packages, and any other
  shardwork package only through ``pytest.importorskip``.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_ONLY = {"parallel-state", "moe-router", "dist-checkpoint", "fused-kernels"}


def _names(requirements: list[str]) -> set[str]:
    out = set()
    for requirement in requirements:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
        if name.startswith("shardwork-"):
            out.add(name.removeprefix("shardwork-"))
    return out


def _module_of(package: str) -> str:
    return package.replace("-", "_")


def _gated_lines(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside try/except ImportError blocks or inside functions."""
    gated: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            catches: set[str | None] = set()
            for handler in node.handlers:
                types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                catches |= {getattr(t, "id", None) for t in types}
            if catches & {"ImportError", "ModuleNotFoundError", "Exception", None}:
                for inner in node.body:
                    gated.update(n.lineno for n in ast.walk(inner) if hasattr(n, "lineno"))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            gated.update(n.lineno for n in ast.walk(node) if hasattr(n, "lineno") and n is not node)
    return gated


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    gated = _gated_lines(tree)
    found = []
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "shardwork" and len(parts) > 1:
                found.append((parts[1], node.lineno, node.lineno in gated))
    return found


def main() -> int:
    packages = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        name = pyproject.parent.name
        project = data["project"]
        extras = set()
        for requirements in project.get("optional-dependencies", {}).values():
            extras |= _names(requirements)
        packages[name] = {
            "runtime": _names(project.get("dependencies", [])),
            "extras": extras,
            "test": _names(data.get("dependency-groups", {}).get("test", [])),
        }
    errors = []
    for name, deps in packages.items():
        unknown = (deps["runtime"] | deps["extras"] | deps["test"]) - set(packages)
        if unknown:
            errors.append(f"{name}: depends on unknown shardwork packages {sorted(unknown)}")
        if name in TORCH_ONLY and deps["runtime"]:
            errors.append(
                f"{name}: must depend on torch only, but declares {sorted(deps['runtime'])}"
            )

    # Cycle check on runtime + extras (an extra that closes a cycle is still a cycle).
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 1:
            errors.append("dependency cycle: " + " -> ".join([*trail, node]))
            return
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in sorted(packages[node]["runtime"] | packages[node]["extras"]):
            if dep in packages:
                visit(dep, [*trail, node])
        state[node] = 2

    for name in packages:
        visit(name, [])

    module_to_package = {_module_of(name): name for name in packages}
    for name, deps in packages.items():
        base = ROOT / "packages" / name
        for path in sorted((base / "src").rglob("*.py")):
            for module, line, gated in _imports(path):
                target = module_to_package.get(module)
                if target is None or target == name or target in deps["runtime"]:
                    continue
                if target in deps["extras"] and gated:
                    continue
                how = (
                    "an optional extra imported without a try/except ImportError gate"
                    if target in deps["extras"]
                    else "not a declared runtime dependency"
                )
                errors.append(f"{path.relative_to(ROOT)}:{line}: imports shardwork.{module}, {how}")
        for path in sorted((base / "tests").rglob("*.py")):
            text = path.read_text()
            skipped = set(re.findall(r"importorskip\(\s*[\"']shardwork\.(\w+)", text))
            for module, line, _ in _imports(path):
                target = module_to_package.get(module)
                allowed = {name} | deps["runtime"] | deps["test"]
                for dep in deps["runtime"] | deps["test"]:
                    allowed |= packages.get(dep, {}).get("runtime", set())
                if target is None or target in allowed or module in skipped:
                    continue
                errors.append(
                    f"{path.relative_to(ROOT)}:{line}: test imports shardwork.{module} without declaring it "
                    "(add it to the test group or use pytest.importorskip)"
                )
    for error in errors:
        print(f"dependency check: {error}")
    if not errors:
        graph = ", ".join(
            f"{n} <- {sorted(d['runtime']) or '[torch]'}" for n, d in packages.items()
        )
        print(f"dependency check: {len(packages)} packages, acyclic, imports declared ({graph})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
