"""Every test that starts gloo ranks carries the ``multirank`` marker.

``pytest -m "not multirank"`` must deselect every test that uses the rank pool, so this
reads (with ``ast``, no imports) every test module under ``packages/*/tests`` and
``tests-integration`` and finds the tests that call ``run_on_ranks``.

What counts as calling it, within one module:
- a call of ``run_on_ranks`` by that name, of an alias imported as
  ``from ... import run_on_ranks as other``, or of ``<anything>.run_on_ranks``;
- a call of a module-level function that (directly or through further module-level
  functions) calls it;
- asking, by parameter name, for a module-level fixture that calls it.

What counts as marked: ``@pytest.mark.multirank`` (or ``@mark.multirank``, called or not) on
the test or its class, or a ``pytestmark`` at module or class level that is the marker or a
list/tuple holding it.

Not seen: helpers imported from another module (a conftest fixture, a package's own
testing helpers), calls made by name at run time, and marks applied through
``pytest.param(..., marks=...)`` or hooks.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
MARKER = "multirank"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_marker(node: ast.AST) -> bool:
    return _dotted(node) in (f"pytest.mark.{MARKER}", f"mark.{MARKER}")


def _pytestmark_has_marker(body: list[ast.stmt]) -> bool:
    for stmt in body:
        if isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(getattr(t, "id", None) == "pytestmark" for t in targets):
                value = stmt.value
                items = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
                if any(_is_marker(item) for item in items):
                    return True
    return False


def _called_names(function: ast.AST) -> set[str]:
    """Names called anywhere inside ``function``; ``x.run_on_ranks(...)`` gives "run_on_ranks"."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                names.add(node.func.id)
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "run_on_ranks":
                names.add("run_on_ranks")
    return names


def unmarked_rank_tests(source: str, filename: str = "<test>") -> list[str]:
    """Names (``test_x`` or ``TestY.test_x``) of tests in ``source`` that call
    ``run_on_ranks`` without the ``multirank`` marker."""
    tree = ast.parse(source, filename=filename)
    starters = {"run_on_ranks"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            starters |= {a.asname for a in node.names if a.name == "run_on_ranks" and a.asname}
    functions = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    calls = {name: _called_names(node) for name, node in functions.items()}
    changed = True
    while changed:  # module-level helpers that reach run_on_ranks, to a fixed point
        changed = False
        for name, called in calls.items():
            if name not in starters and called & starters:
                starters.add(name)
                changed = True
    fixtures = {
        name
        for name, node in functions.items()
        if name in starters
        and any(_dotted(d).startswith("pytest.fixture") for d in node.decorator_list)
    }

    def starts_ranks(test: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        requested = {arg.arg for arg in test.args.args + test.args.kwonlyargs}
        return bool(_called_names(test) & starters or requested & fixtures)

    def marked(test: ast.AST, outer: list[ast.ClassDef]) -> bool:
        decorators = [d for node in [test, *outer] for d in node.decorator_list]
        return any(_is_marker(d) for d in decorators) or any(
            _pytestmark_has_marker(c.body) for c in outer
        )

    if _pytestmark_has_marker(tree.body):
        return []
    unmarked = []

    def visit(body: list[ast.stmt], outer: list[ast.ClassDef]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, [*outer, node])
            elif (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name.startswith("test")
                and starts_ranks(node)
                and not marked(node, outer)
            ):
                unmarked.append(".".join([*(c.name for c in outer), node.name]))

    visit(tree.body, [])
    return unmarked


def _rank_test_modules() -> dict[str, str]:
    """Relative path -> text of every test module that mentions run_on_ranks."""
    paths = [*REPO.glob("packages/*/tests/**/*.py"), *REPO.glob("tests-integration/**/*.py")]
    texts = {str(path.relative_to(REPO)): path.read_text() for path in sorted(paths)}
    return {path: text for path, text in texts.items() if "run_on_ranks" in text}


def test_every_rank_test_in_the_repository_is_marked():
    modules = _rank_test_modules()
    assert len(modules) >= 20
    unmarked = {}
    blind = []
    for path, text in modules.items():
        if names := unmarked_rank_tests(text, path):
            unmarked[path] = names
        # With its markers renamed, every one of these modules must be reported: the
        # detection sees how each of them reaches run_on_ranks.
        if not unmarked_rank_tests(text.replace(f"mark.{MARKER}", "mark.renamed"), path):
            blind.append(path)
    assert unmarked == {}, f"add @pytest.mark.{MARKER} (or a module-level pytestmark) to {unmarked}"
    assert blind == []


MISSING = """
import pytest
from shardwork.parallel_state.testing import run_on_ranks as _run_on_ranks
from shardwork.parallel_state import testing


def _on_ranks():
    return 1


def run_twice(fn):
    return _run_on_ranks(fn, 2) + _run_on_ranks(fn, 2)


def _through_a_helper():
    return run_twice(_on_ranks)


@pytest.fixture
def ranks_result():
    return testing.run_on_ranks(_on_ranks, 2)


def test_direct():
    assert _run_on_ranks(_on_ranks, 2) == [1, 1]


def test_through_two_helpers():
    assert _through_a_helper() == [1] * 4


def test_through_a_fixture(ranks_result):
    assert ranks_result == [1, 1]


@pytest.mark.slow
def test_other_marker_only():
    testing.run_on_ranks(_on_ranks, 2)


@pytest.mark.multirank
def test_marked():
    testing.run_on_ranks(_on_ranks, 2)


def test_single_process():
    assert _on_ranks() == 1


class TestGroup:
    def test_in_a_class(self):
        testing.run_on_ranks(_on_ranks, 2)


@pytest.mark.multirank
class TestMarkedGroup:
    def test_in_a_marked_class(self):
        testing.run_on_ranks(_on_ranks, 2)


class TestGroupWithPytestmark:
    pytestmark = [pytest.mark.slow, pytest.mark.multirank]

    def test_in_a_class_with_pytestmark(self):
        testing.run_on_ranks(_on_ranks, 2)
"""


def test_fixture_module_missing_the_marker_is_reported():
    assert unmarked_rank_tests(MISSING) == [
        "test_direct",
        "test_through_two_helpers",
        "test_through_a_fixture",
        "test_other_marker_only",
        "TestGroup.test_in_a_class",
    ]


def test_module_level_pytestmark_covers_every_test():
    for mark in ("pytest.mark.multirank", "[pytest.mark.slow, pytest.mark.multirank]"):
        assert unmarked_rank_tests(MISSING + f"\npytestmark = {mark}\n") == []
    assert len(unmarked_rank_tests(MISSING + "\npytestmark = pytest.mark.slow\n")) == 5
