"""tools/structure_rules.py (``check_dependencies.py --structure``) on fixture packages.

Each fixture is a package ``packages/pkg`` (runtime dependencies torch, numpy and
shardwork-dep; optional extras triton and shardwork-opt) with the modules a test writes; the
allowed patterns must pass and each planted violation must be reported once, at its line.
"""

import pathlib

import check_dependencies
import pytest
import structure_rules

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = """[project]
name = "shardwork-pkg"
version = "0.1.0"
dependencies = ["torch>=2.5", "numpy>=1.26", "shardwork-dep"]
[project.optional-dependencies]
triton = ["triton>=3.1"]
opt = ["shardwork-opt"]
"""
SRC = "packages/pkg/src/shardwork/pkg"


def problems_of(root, files):
    """Structure problems of the fixture package holding ``files`` (path under SRC -> text)."""
    package = root / "packages" / "pkg"
    (package / "src" / "shardwork" / "pkg").mkdir(parents=True)
    (package / "pyproject.toml").write_text(PYPROJECT)
    files = {"__init__.py": '"""Fixture."""\n'} | files
    for name, text in files.items():
        path = package / "src" / "shardwork" / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return structure_rules.structure_problems(package, root)


def body(lines):
    """A function whose body is ``lines`` lines long after its docstring."""
    return 'def f():\n    """Doc."""\n' + "".join(f"    x{i} = {i}\n" for i in range(lines))


def test_allowed_patterns_pass(tmp_path):
    files = {
        # the package re-exports its submodules; submodules import each other one way
        "__init__.py": "from shardwork.pkg.a import A\nfrom shardwork.pkg.sub import S\n",
        "a.py": "from shardwork.pkg import b\nfrom shardwork.pkg.b import B\nA = 1\n",
        "b.py": (
            "from typing import TYPE_CHECKING\nimport torch\nfrom shardwork.dep import d\n"
            "if TYPE_CHECKING:\n    from shardwork.pkg.c import C\nB = 2\n"
        ),
        "c.py": "C = 3\n",
        "sub/__init__.py": "from shardwork.pkg.sub.s import S\n",
        "sub/s.py": "from shardwork.pkg.c import C\nS = C\n",
        # optional dependencies on first use: third-party, shardwork extra, and package
        # modules that need one (directly, or through another such module)
        "tri.py": "import triton\nK = triton\n",
        "tri_user.py": "from shardwork.pkg.tri import K\n",
        "lazy.py": (
            "def f():\n    import triton\n    from shardwork.opt import o\n"
            "    from torch.utils.tensorboard import SummaryWriter\n"
            "    from shardwork.pkg import tri_user\n    import shardwork.pkg.tri\n"
            "    return triton, o, tri_user\n"
        ),
        # a module-top import behind an ImportError gate is at module top
        "gated.py": "try:\n    import tokenizers\nexcept ImportError:\n    tokenizers = None\n",
        # a private module of the same package; dunder names are not private
        "_impl.py": "X = 1\n",
        "uses_impl.py": (
            "from shardwork.pkg import _impl\nfrom shardwork.pkg import c\n"
            "NAME = c.__name__\nY = _impl.X\n"
        ),
        "long.py": body(structure_rules.MAX_BODY_LINES),
    }
    assert problems_of(tmp_path, files) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # hidden in a function on one side
            {
                "a.py": "from shardwork.pkg.b import B\nA = 1\n",
                "b.py": "B = 2\n\ndef f():\n    from shardwork.pkg.a import A\n    return A\n",
            },
            "a.py:1: import-cycle: a -> b -> a (modules importing each other: a, b)",
        ),
        (  # hidden under TYPE_CHECKING, and spelled `from pkg import submodule`
            {
                "a.py": "from shardwork.pkg import b\n",
                "b.py": (
                    "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                    "    from shardwork.pkg.a import A\n"
                ),
            },
            "a.py:1: import-cycle: a -> b -> a (modules importing each other: a, b)",
        ),
        (  # three modules around a loop, the last edge written as `import ...`
            {
                "a.py": "\nfrom shardwork.pkg.b import B\n",
                "b.py": "from shardwork.pkg.c import C\n",
                "c.py": "import shardwork.pkg.a\n",
            },
            "a.py:2: import-cycle: a -> b -> c -> a (modules importing each other: a, b, c)",
        ),
        (  # a submodule importing a name back from the package that imports it
            {
                "__init__.py": "from shardwork.pkg.a import A\n",
                "a.py": "from shardwork.pkg import B\n",
            },
            "__init__.py:1: import-cycle: __init__ -> a -> __init__ "
            "(modules importing each other: __init__, a)",
        ),
        (  # relative imports, from a subpackage's __init__ and from a module beside it
            {
                "sub/__init__.py": "from . import x\n",
                "sub/x.py": "from ..c import C\n",
                "c.py": "from .sub import S\n",
            },
            "c.py:1: import-cycle: c -> sub -> sub.x -> c "
            "(modules importing each other: c, sub, sub.x)",
        ),
    ],
    ids=["in-function", "type-checking", "three-modules", "through-init", "relative"],
)
def test_import_cycle(tmp_path, files, expected):
    # the in-function case is also an import-in-function problem; only the cycle is checked here
    (problem,) = [p for p in problems_of(tmp_path, files) if ": import-cycle: " in p]
    assert problem.startswith(f"{SRC}/{expected}; move what they share")


@pytest.mark.parametrize(
    ("source", "line", "what"),
    [
        ("from shardwork.pkg.c import _helper\n", 1, "_helper from shardwork.pkg.c"),
        ("from shardwork.other.m import OK, _hidden\n", 1, "_hidden from shardwork.other.m"),
        ("import shardwork.pkg.c as c\n\nY = c._helper\n", 3, "shardwork.pkg.c._helper read"),
        ("from shardwork.pkg import c\n\n\ndef f():\n    return c._helper()\n", 5, "c._helper"),
        ("import shardwork.pkg.c\n\nY = shardwork.pkg.c._helper\n", 3, "c._helper read"),
        ("from .c import _helper\n", 1, "_helper from shardwork.pkg.c"),
        ("from . import c\n\nY = c._helper\n", 3, "shardwork.pkg.c._helper read"),
    ],
    ids=[
        "from-import",
        "other-package",
        "module-alias",
        "from-package",
        "dotted",
        "relative",
        "relative-module",
    ],
)
def test_private_import(tmp_path, source, line, what):
    files = {"c.py": "def _helper():\n    return 1\n", "user.py": source}
    (problem,) = problems_of(tmp_path, files)
    assert problem.startswith(f"{SRC}/user.py:{line}: private-import: ")
    assert what in problem


@pytest.mark.parametrize(
    ("statement", "target"),
    [
        ("import json", "json"),
        ("import torch.nn.functional as F", "torch.nn.functional"),
        ("import numpy", "numpy"),
        ("from shardwork.dep import d", "shardwork.dep"),
        ("from shardwork.pkg import c", "shardwork.pkg.c"),
        ("from shardwork.pkg.c import C", "shardwork.pkg.c"),
    ],
    ids=["stdlib", "torch", "numpy", "runtime-shardwork", "own-submodule", "own-name"],
)
def test_import_in_function(tmp_path, statement, target):
    source = f"class K:\n    def f(self):\n        {statement}\n"
    (problem,) = problems_of(tmp_path, {"c.py": "C = 1\n", "user.py": source})
    assert problem.startswith(f"{SRC}/user.py:3: import-in-function: {target} is required ")


DEFERRED_SOURCE = """def main():
    setup()
    # deferred import: torch must load after setup() set its environment
    import json

    from shardwork.dep import d
    import numpy
    return json, d, numpy


def other():
    # a comment without the marker
    import json
    return json
"""


def test_deferred_import_comment_allows_the_imports_below_it(tmp_path):
    """The written exception covers the run of imports (blank lines included) right below it,
    names its reason, and nothing else: the same import in another function still fails, and
    the marker without a reason allows nothing."""
    (problem,) = problems_of(tmp_path, {"entry.py": DEFERRED_SOURCE})
    assert problem.startswith(f"{SRC}/entry.py:13: import-in-function: json is required ")
    listed = structure_rules.deferred_imports(tmp_path / "packages" / "pkg", tmp_path)
    reason = "torch must load after setup() set its environment"
    assert listed == [f"{SRC}/entry.py:{line}: {reason}" for line in (4, 6, 7)]
    without_reason = DEFERRED_SOURCE.replace(f": {reason}", ":")
    other_root = tmp_path / "bare"
    other_root.mkdir()
    found = problems_of(other_root, {"entry.py": without_reason})
    assert [p.split(": import-in-function")[0] for p in found] == [
        f"{SRC}/entry.py:{line}" for line in (4, 6, 7, 13)
    ]


@pytest.mark.parametrize("lines", [structure_rules.MAX_BODY_LINES + 1, 120])
def test_long_function(tmp_path, lines):
    source = "class K:\n    pass\n\n\nclass L:\n" + "".join(
        f"    {line}\n" for line in body(lines).splitlines()
    )
    (problem,) = problems_of(tmp_path, {"long.py": source})
    assert problem == (
        f"{SRC}/long.py:6: long-function: L.f has {lines} lines of body (at most "
        f"{structure_rules.MAX_BODY_LINES}); split it into named steps"
    )


def test_body_without_docstring_counts_from_its_first_line(tmp_path):
    source = "def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(81))
    (problem,) = problems_of(tmp_path, {"long.py": source})
    assert "f has 81 lines of body" in problem


def test_command_line_reports_and_fails(tmp_path, capsys):
    problems_of(tmp_path, {"a.py": "def f():\n    import json\n"})
    assert check_dependencies.main_structure(["packages/pkg"], tmp_path) == 1
    out = capsys.readouterr().out
    assert f"{SRC}/a.py:2: import-in-function: json is required" in out
    assert out.endswith("structure check: 1 problem(s) in pkg\n")
    assert check_dependencies.main_structure(["packages/none"], tmp_path) == 2


@pytest.mark.parametrize(
    "package",
    [
        "parallel-state",
        "fused-kernels",
        "moe-router",
        "dist-checkpoint",
        "dist-optimizer",
        "models",
        "trainer",
    ],
)
def test_the_real_packages_pass(package):
    assert structure_rules.structure_problems(REPO / "packages" / package, REPO) == []
