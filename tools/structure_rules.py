"""Module-structure rules over ``packages/<name>/src`` (issue 18), one AST pass per module.

Run through ``python tools/check_dependencies.py --structure [packages/<name> ...]``. Tests'
modules are not checked. Each problem reads ``path:line: rule: what``:

- ``import-cycle``: modules of one package import each other, directly or around a loop.
  Every import counts as an edge: module level, inside a function, under ``if TYPE_CHECKING:``
  (a hidden cycle is still a cycle: the two modules cannot be understood or tested apart).
  ``from shardwork.p.a import b`` is an edge to the submodule ``a.b`` when ``a/b.py`` (or
  ``a/b/``) exists, else to ``a``. A package ``__init__`` is a node like any module: its
  imports of its own submodules are edges (the re-export pattern), and a module that imports
  *from the package* (``from shardwork.p.hf import load``) has an edge to that ``__init__``.
  The implicit import of every parent package that Python performs before a submodule is not
  an edge: counting it would make every re-exporting ``__init__`` a cycle with its
  submodules. A real cycle through an ``__init__`` (a submodule importing a name back from
  its own package) is still found, because that import is written out. One problem per
  strongly connected set of modules, at the first edge of one loop through it.
- ``private-import``: ``from shardwork.x.y import _name`` or ``y._name`` on a module bound by
  an import, where ``y`` is another module. Dunder names are not private. A private
  *module* of the same package (``from shardwork.p import _impl``) is allowed: the
  underscore makes it private to its package, not to a module.
- ``import-in-function``: an import inside a function (at any depth) of a module that is not an
  optional dependency of the package: the standard library, a ``[project] dependencies``
  requirement (shardwork packages included), or a module of the package itself. Optional
  dependencies (extras, test/dev-only packages such as transformers, triton,
  transformer_engine, and ``OPTIONAL_WRAPPERS`` such as ``torch.utils.tensorboard``) may be
  imported on first use, so the package works without them; so may a module of the package
  that needs one (it imports one outside any gate, directly or through another such module:
  ``fused_kernels.triton_router`` imports triton at its top). One written exception: a run of
  in-function imports directly under a comment line ``# deferred import: <reason>`` (the
  reason required), for an entry point that must act before a module loads (the CLIs set
  OpenMP's wait policy, which it reads once when torch loads it). ``--structure`` lists them.
- ``long-function``: a function body longer than ``MAX_BODY_LINES``, counted from the first
  statement after the docstring to the function's last line.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib
from dataclasses import dataclass, field

MAX_BODY_LINES = 80
_IMPORT_NAMES = {"pyyaml": "yaml", "pillow": "PIL", "scikit-learn": "sklearn"}
"""Distributions whose import name differs from the normalized distribution name."""
OPTIONAL_WRAPPERS = {"torch.utils.tensorboard": "tensorboard"}
"""Submodules of a required package that import an optional one (module -> what it needs):
importing them on first use is the optional-dependency pattern."""


@dataclass
class Module:
    """One source module of a package: its dotted name inside the package and its tree."""

    name: str  # "attention", "hf.checkpoint", "hf" for hf/__init__.py, "" for the root init
    path: pathlib.Path
    tree: ast.Module
    edges: dict[str, int] = field(default_factory=dict)  # module -> first line importing it


def required_imports(pyproject: pathlib.Path) -> frozenset[str]:
    """Top-level import names of a package's ``[project] dependencies`` (``shardwork.x`` for
    shardwork packages), plus the standard library's."""
    project = tomllib.loads(pyproject.read_text())["project"]
    names = set(sys.stdlib_module_names)
    for requirement in project.get("dependencies", []):
        dist = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()
        if dist.startswith("shardwork-"):
            names.add("shardwork." + dist.removeprefix("shardwork-").replace("-", "_"))
        else:
            names.add(_IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    return frozenset(names)


def read_modules(package: pathlib.Path) -> tuple[str, dict[str, Module]]:
    """``shardwork.<x>`` and every module under ``package/src/shardwork/<x>``, by dotted name."""
    (top,) = [p for p in (package / "src" / "shardwork").iterdir() if p.is_dir()]
    modules = {}
    for path in sorted(top.rglob("*.py")):
        parts = list(path.relative_to(top).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        tree = ast.parse(path.read_text(), filename=str(path))
        modules[".".join(parts)] = Module(".".join(parts), path, tree)
    return f"shardwork.{top.name}", modules


def _imports(tree: ast.AST):
    """Every import statement of a module and whether it sits inside a function."""

    def walk(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_function
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            yield from walk(child, inner)

    yield from walk(tree, False)


def _absolute(node: ast.ImportFrom, module: Module, root: str) -> str:
    """The absolute module name of a ``from`` import (resolving ``from .x import y``)."""
    if node.level == 0:
        return node.module or ""
    # in a package's __init__, "." is the package itself; in a module, its parent package
    is_init = module.path.name == "__init__.py"
    base = module.name.split(".") if module.name else []
    drop = node.level - 1 if is_init else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join([root, *base, *([node.module] if node.module else [])])


def _inside(full: str, root: str) -> str | None:
    """The dotted name inside the package for ``full`` (``""`` for the package), else None."""
    if full == root:
        return ""
    return full.removeprefix(root + ".") if full.startswith(root + ".") else None


def _nearest(name: str, modules: dict[str, Module]) -> str:
    """The longest prefix of ``name`` that is a module (``a.b.func`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def collect_edges(root: str, modules: dict[str, Module]) -> None:
    """Fill each module's ``edges`` with the package's modules it imports."""
    for module in modules.values():
        for node, _ in _imports(module.tree):
            for full in _targets(node, module, root, modules):
                inner = _inside(full, root)
                if inner is None:
                    continue
                target = _nearest(inner, modules)
                if target != module.name:
                    module.edges.setdefault(target, node.lineno)


def _components(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(modules[name].edges):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while (top := stack.pop()) != name:
                component.append(top)
            component.append(name)
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return sorted(found)


def _loop(start: str, members: set[str], modules: dict[str, Module]) -> list[str]:
    """A shortest import loop from ``start`` back to itself inside ``members`` (breadth-first)."""
    previous = {start: start}
    frontier = [start]
    while frontier:
        following = []
        for name in frontier:
            for target in sorted(modules[name].edges):
                if target == start:
                    path = [name]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target in members and target not in previous:
                    previous[target] = name
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected set but on no loop")


def cycle_problems(root: str, modules: dict[str, Module], where) -> list[str]:
    """One ``import-cycle`` problem per strongly connected set of modules."""
    collect_edges(root, modules)
    problems = []
    for component in _components(modules):
        loop = _loop(component[0], set(component), modules)
        first = modules[loop[0]]
        shown = [name or "__init__" for name in loop]
        problems.append(
            f"{where(first.path)}:{first.edges[loop[1]]}: import-cycle: "
            f"{' -> '.join(shown)} (modules importing each other: "
            f"{', '.join(n or '__init__' for n in component)}); move what they share to the "
            "module it belongs to"
        )
    return problems


def all_modules(repo: pathlib.Path) -> frozenset[str]:
    """Dotted names of every source module of every package in the workspace at ``repo``."""
    names = set()
    for path in repo.glob("packages/*/src/shardwork/**/*.py"):
        # packages/<name>/src/shardwork/... -> shardwork....
        dotted = list(path.relative_to(repo / "packages").with_suffix("").parts[2:])
        if dotted[-1] == "__init__":
            dotted.pop()
        names.add(".".join(dotted))
    return frozenset(names)


def _bound_modules(module: Module, root: str, known: frozenset[str]) -> dict[str, str]:
    """Local names bound to a shardwork module by an import: local name -> dotted module."""
    bound = {}
    for node, _ in _imports(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardwork."):
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else "shardwork"
        else:
            source = _absolute(node, module, root)
            for alias in node.names:
                if (full := f"{source}.{alias.name}") in known:
                    bound[alias.asname or alias.name] = full
    return bound


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_problems(
    root: str, modules: dict[str, Module], known: frozenset[str], where
) -> list[str]:
    """``private-import`` problems: another module's ``_name`` imported or read."""
    problems = []
    for module in modules.values():
        own = f"{root}.{module.name}" if module.name else root
        for node, _ in _imports(module.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(node, module, root)
            if not source.startswith("shardwork.") or source == own:
                continue
            for alias in node.names:
                inner = _inside(f"{source}.{alias.name}", root)
                if _is_private(alias.name) and inner not in modules:
                    problems.append(
                        f"{where(module.path)}:{node.lineno}: private-import: "
                        f"{alias.name} from {source}; make it public (and document it) "
                        "or move it to the module that uses it"
                    )
        bound = _bound_modules(module, root, known)
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            parts = _dotted(node.value)
            if parts and parts[0] in bound:
                target = ".".join([bound[parts[0]], *parts[1:]])
                if target != own and _inside(f"{target}.{node.attr}", root) not in modules:
                    problems.append(
                        f"{where(module.path)}:{node.lineno}: private-import: "
                        f"{target}.{node.attr} read from another module; make it public "
                        "(and document it) or move it"
                    )
    return problems


def _eager_imports(tree: ast.Module):
    """Imports that run when the module is imported: not in a function, not under
    ``if TYPE_CHECKING:``, not in a ``try`` body whose handlers catch ImportError."""

    def walk(nodes):
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try | ast.TryStar):
                caught = " ".join(ast.unparse(h.type) for h in node.handlers if h.type)
                gated = "ImportError" in caught or any(h.type is None for h in node.handlers)
                yield from walk([*([] if gated else node.body), *node.orelse, *node.finalbody])
                for handler in node.handlers:
                    yield from walk(handler.body)
            elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(ast.iter_child_nodes(node))

    yield from walk(tree.body)


def _targets(node: ast.Import | ast.ImportFrom, module: Module, root: str, modules) -> list[str]:
    """Absolute names an import loads: the submodule for ``from pkg import submodule``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _absolute(node, module, root)
    inner = _inside(base, root)
    if inner is None:
        return [base]
    subs = [f"{inner}.{a.name}" if inner else a.name for a in node.names]
    return sorted({f"{root}.{sub}" if sub in modules else base for sub in subs})


def optional_modules(
    root: str, modules: dict[str, Module], required: frozenset[str]
) -> frozenset[str]:
    """Modules of the package that need an optional dependency to be imported: they import one
    eagerly, directly (``import triton`` at the top of ``triton_router``) or through another
    such module. Importing them on first use is the optional-dependency pattern."""
    needs: dict[str, set[str]] = {}
    optional = set()
    for module in modules.values():
        for node in _eager_imports(module.tree):
            for full in _targets(node, module, root, modules):
                inner = _inside(full, root)
                if inner is not None:
                    needs.setdefault(module.name, set()).add(_nearest(inner, modules))
                elif not _is_required(full, required):
                    optional.add(module.name)
    grew = True
    while grew:  # a module importing an optional module eagerly is optional too
        grown = {name for name, deps in needs.items() if deps & optional} - optional
        optional |= grown
        grew = bool(grown)
    return frozenset(optional)


def _is_required(full: str, required: frozenset[str]) -> bool:
    """Whether importing ``full`` needs only the standard library and required packages."""
    for wrapper, needs in OPTIONAL_WRAPPERS.items():
        if (full == wrapper or full.startswith(wrapper + ".")) and needs not in required:
            return False
    parts = full.split(".")
    return parts[0] in required or ".".join(parts[:2]) in required


DEFERRED = re.compile(r"#\s*deferred import:\s*\S")
"""The comment that justifies the in-function imports right below it (with a reason)."""


def deferred_import_lines(module: Module) -> dict[int, str]:
    """Line of each in-function import justified by a ``# deferred import: <reason>`` comment
    (directly above it, or above the imports and blank lines directly above it) -> the
    reason."""
    lines = module.path.read_text().splitlines()
    spans = {}
    for node, in_function in _imports(module.tree):
        if in_function:
            spans[node.lineno] = node.end_lineno
    covered = {line for start, end in spans.items() for line in range(start, end + 1)}
    justified = {}
    for start in spans:
        above = start - 1
        while above in covered or (above >= 1 and not lines[above - 1].strip()):
            above -= 1
        comment = lines[above - 1].strip() if above >= 1 else ""
        if DEFERRED.match(comment):
            justified[start] = comment.split(":", 1)[1].strip()
    return justified


def function_import_problems(
    root: str, modules: dict[str, Module], required: frozenset[str], where
) -> list[str]:
    """``import-in-function`` problems: a required module imported on first use."""
    optional = optional_modules(root, modules, required)
    problems = []
    for module in modules.values():
        deferred = deferred_import_lines(module)
        for node, in_function in _imports(module.tree):
            if not in_function or node.lineno in deferred:
                continue
            for full in _targets(node, module, root, modules):
                inner = _inside(full, root)
                if inner is not None:
                    if _nearest(inner, modules) in optional:
                        continue
                elif not _is_required(full, required):
                    continue
                problems.append(
                    f"{where(module.path)}:{node.lineno}: import-in-function: {full} is "
                    "required by the package (standard library, [project] dependencies, or "
                    "its own module that needs no optional dependency); import it at module top"
                )
    return problems


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = function.body
    first = body[0]
    if (
        len(body) > 1
        and isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        first = body[1]
    return function.end_lineno - first.lineno + 1


def long_function_problems(modules: dict[str, Module], where) -> list[str]:
    """``long-function`` problems: bodies over ``MAX_BODY_LINES`` lines."""
    problems = []

    def walk(node: ast.AST, prefix: str, path: pathlib.Path) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if (
                    not isinstance(child, ast.ClassDef)
                    and (lines := _body_lines(child)) > MAX_BODY_LINES
                ):
                    problems.append(
                        f"{where(path)}:{child.lineno}: long-function: {name} has {lines} "
                        f"lines of body (at most {MAX_BODY_LINES}); split it into named steps"
                    )
                walk(child, f"{name}.", path)
            else:
                walk(child, prefix, path)

    for module in modules.values():
        walk(module.tree, "", module.path)
    return problems


def deferred_imports(package: pathlib.Path, repo: pathlib.Path) -> list[str]:
    """The written exceptions of ``import-in-function`` in ``package``: ``path:line: reason``."""
    _, modules = read_modules(package)
    return [
        f"{path.relative_to(repo) if path.is_relative_to(repo) else path}:{line}: {reason}"
        for module in modules.values()
        for path in [module.path]
        for line, reason in sorted(deferred_import_lines(module).items())
    ]


def structure_problems(package: pathlib.Path, repo: pathlib.Path) -> list[str]:
    """Every structure problem of the package folder ``package`` (paths shown from ``repo``)."""

    def where(path: pathlib.Path) -> pathlib.Path:
        return path.relative_to(repo) if path.is_relative_to(repo) else path

    root, modules = read_modules(package)
    required = required_imports(package / "pyproject.toml")
    return (
        cycle_problems(root, modules, where)
        + private_problems(root, modules, all_modules(repo), where)
        + function_import_problems(root, modules, required, where)
        + long_function_problems(modules, where)
    )
