"""tools/check_dependencies.py on small fixture workspaces, and on the real one.

Each fixture starts from a valid miniature of our graph (torch-only parallel-state,
fused-kernels and moe-router with an optional ``fused`` extra; models on top) and
breaks one rule.
"""

import pathlib

import check_dependencies
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BASE = {
    "parallel-state": {"runtime": [], "extras": {}, "test": []},
    "fused-kernels": {"runtime": [], "extras": {}, "test": ["shardwork-parallel-state"]},
    "moe-router": {
        "runtime": [],
        "extras": {"fused": ["shardwork-fused-kernels"]},
        "test": ["shardwork-parallel-state"],
    },
    "models": {
        "runtime": ["shardwork-parallel-state>=0.1", "shardwork-moe-router"],
        "extras": {},
        "test": [],
    },
}


def _toml_list(items):
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def write_workspace(root, packages=BASE, files=()):
    """``packages``: name -> runtime/extras/test requirement lists; ``files``: (path, text)."""
    for name, deps in packages.items():
        folder = root / "packages" / name
        module = folder / "src" / "shardwork" / name.replace("-", "_")
        module.mkdir(parents=True)
        (module / "__init__.py").write_text('"""A fixture package."""\n')
        (folder / "tests").mkdir()
        extras = "".join(f"{key} = {_toml_list(value)}\n" for key, value in deps["extras"].items())
        (folder / "pyproject.toml").write_text(
            f'[project]\nname = "shardwork-{name}"\nversion = "0.1.0"\n'
            f"dependencies = {_toml_list(['torch>=2.5', *deps['runtime']])}\n"
            f"[project.optional-dependencies]\n{extras}"
            f"[dependency-groups]\ntest = {_toml_list(['pytest', *deps['test']])}\n"
        )
    for path, text in files:
        (root / path).write_text(text)
    return root


def with_deps(name, **changes):
    packages = {key: dict(value) for key, value in BASE.items()}
    packages[name] = packages.get(name, {"runtime": [], "extras": {}, "test": []}) | changes
    return packages


def only_problem_in(tmp_path, path, source):
    """The base workspace plus ``path`` holding ``source`` has exactly one problem, reported at
    ``path``; return it."""
    problems = check_dependencies.find_problems(write_workspace(tmp_path, files=[(path, source)]))
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:")
    return problems[0]


def test_the_valid_fixture_passes(tmp_path, capsys):
    allowed = [
        # runtime dependencies, one level of their dependencies in tests, gated extras
        ("packages/models/src/shardwork/models/a.py", "from shardwork.moe_router import x\n"),
        (
            "packages/moe-router/src/shardwork/moe_router/a.py",
            "try:\n    import shardwork.fused_kernels\nexcept ImportError:\n    pass\n",
        ),
        (
            "packages/moe-router/src/shardwork/moe_router/b.py",
            "def f():\n    from shardwork.fused_kernels import k\n",
        ),
        (
            "packages/moe-router/src/shardwork/moe_router/c.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shardwork import fused_kernels\n",
        ),
        ("packages/moe-router/tests/test_a.py", "from shardwork.parallel_state import testing\n"),
        (
            "packages/moe-router/tests/test_b.py",
            'import pytest\npytest.importorskip("shardwork.models")\nfrom shardwork.models import m\n',
        ),
        (
            "packages/moe-router/tests/test_c.py",
            "import pytest\n\ndef _on_ranks():\n    from shardwork.fused_kernels import k\n\n"
            'def test_x():\n    pytest.importorskip("shardwork.fused_kernels")\n',
        ),
    ]
    root = write_workspace(tmp_path, files=allowed)
    assert check_dependencies.find_problems(root) == []
    assert check_dependencies.main(root) == 0
    assert "4 packages, acyclic, imports declared" in capsys.readouterr().out


def test_cycle_is_named(tmp_path, capsys):
    packages = with_deps("models", runtime=["shardwork-moe-router", "shardwork-trainer"])
    packages["trainer"] = {"runtime": ["shardwork-models"], "extras": {}, "test": []}
    root = write_workspace(tmp_path, packages)
    assert check_dependencies.find_problems(root) == [
        "models: depends on ['trainer'], outside the design's layering "
        "(allowed: ['dist-checkpoint', 'fused-kernels', 'moe-router', 'parallel-state'])",
        "dependency cycle: models -> trainer -> models",
    ]
    assert check_dependencies.main(root) == 1
    assert (
        "dependency check: dependency cycle: models -> trainer -> models" in capsys.readouterr().out
    )


def test_cycle_closed_by_an_optional_extra_is_a_cycle(tmp_path):
    root = write_workspace(tmp_path, with_deps("moe-router", extras={"m": ["shardwork-models"]}))
    assert check_dependencies.find_problems(root) == [
        "moe-router: depends on ['models'], outside the design's layering "
        "(allowed: ['fused-kernels'])",
        "dependency cycle: models -> moe-router -> models",
    ]


def test_torch_only_package_growing_a_shardwork_dependency(tmp_path):
    root = write_workspace(tmp_path, with_deps("moe-router", runtime=["shardwork-parallel-state"]))
    assert check_dependencies.find_problems(root) == [
        "moe-router: must depend on torch only, but declares ['parallel-state']"
    ]


def test_edge_outside_the_layering_without_a_cycle(tmp_path):
    packages = with_deps("dist-optimizer", runtime=["shardwork-models"])
    root = write_workspace(tmp_path, packages)
    assert check_dependencies.find_problems(root) == [
        "dist-optimizer: depends on ['models'], outside the design's layering "
        "(allowed: ['dist-checkpoint', 'parallel-state'])"
    ]


def test_unknown_shardwork_package(tmp_path):
    root = write_workspace(tmp_path, with_deps("models", test=["shardwork-nowhere"]))
    assert check_dependencies.find_problems(root) == [
        "models: depends on unknown shardwork packages ['nowhere']"
    ]


@pytest.mark.parametrize(
    "source",
    [
        "from shardwork.fused_kernels import rms_norm\n",
        "from shardwork import fused_kernels\n",
        "import shardwork.fused_kernels.ops as ops\n",
    ],
)
def test_undeclared_import_in_a_source_module(tmp_path, source):
    path = "packages/models/src/shardwork/models/layer.py"
    root = write_workspace(tmp_path, files=[(path, '"""Doc."""\n' + source)])
    assert check_dependencies.find_problems(root) == [
        f"{path}:2: imports shardwork.fused_kernels, not a declared runtime dependency"
    ]


@pytest.mark.parametrize(
    "source",
    [
        "import shardwork.fused_kernels\n",
        # a handler that does not catch ImportError is no gate; neither is the else branch
        "try:\n    import shardwork.fused_kernels\nexcept KeyError:\n    pass\n",
        "try:\n    pass\nexcept ImportError:\n    pass\nelse:\n    import shardwork.fused_kernels\n",
    ],
    ids=["top-level", "wrong-except", "else-branch"],
)
def test_ungated_optional_extra_import(tmp_path, source):
    path = "packages/moe-router/src/shardwork/moe_router/fused.py"
    problem = only_problem_in(tmp_path, path, source)
    assert "imports shardwork.fused_kernels, an optional extra imported without a gate" in problem


@pytest.mark.parametrize(
    "source",
    [
        "from shardwork.models import gpt\n",
        # the importorskip comes after the import: collection fails before it runs
        'import pytest\nfrom shardwork.models import gpt\npytest.importorskip("shardwork.models")\n',
        # an importorskip of another package does not cover this one
        'import pytest\npytest.importorskip("shardwork.fused_kernels")\nfrom shardwork.models import gpt\n',
    ],
    ids=["no-skip", "skip-after", "other-skip"],
)
def test_undeclared_import_in_a_test_module(tmp_path, source):
    path = "packages/moe-router/tests/test_models.py"
    problem = only_problem_in(tmp_path, path, source)
    assert "test imports shardwork.models without declaring it" in problem
    assert 'pytest.importorskip("shardwork.models")' in problem


def test_the_real_workspace_passes():
    assert check_dependencies.find_problems(REPO) == []
