"""The planner against published training recipes (tests/fixtures/plan_recipes.toml).

Goal per recipe (issue 20): the published parallel layout among the planner's top 3, and a
predicted MFU within 5 points of a published one (on the paper's FLOPs basis). Recipes that
miss are listed in ``RANK_MISSES`` / ``MFU_MISSES`` with the reason in docs/planner.md
("Misses"); the tests require that they still miss, so the lists stay true. The bound is not
loosened for anyone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwork.trainer.plan.calibrate import fit_efficiency, leave_one_out, load_recipes, predict
from shardwork.trainer.plan.cluster import EFFICIENCY

RECIPES = load_recipes(Path(__file__).parent / "fixtures" / "plan_recipes.toml")
BY_NAME = {r.name: r for r in RECIPES}

#: Published layout not in the top 3 (docs/planner.md, "Misses": why each one misses).
RANK_MISSES = {
    "llama3-405b-8k-8192gpu",
    "llama3-405b-8k-16384gpu",
    "llama3-405b-131k-16384gpu",
    "megatron-gpt-1t",
    "bloom-176b",
    "deepseek-v3",
}
#: Published MFU not within 5 points (docs/planner.md, "Misses").
MFU_MISSES = {"llama3-405b-8k-8192gpu", "llama3-405b-8k-16384gpu", "llama3-405b-131k-16384gpu"}
TOLERANCE = 0.05


def _eff(recipe):
    return EFFICIENCY[(recipe.cluster.gpu.name, "bf16")]


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_published_layout_rank(name):
    recipe = BY_NAME[name]
    p = predict(recipe, _eff(recipe))
    assert p.rank is not None, f"{name}: the published layout was refused"
    if name in RANK_MISSES:
        assert p.rank > 3, f"{name} now ranks {p.rank}: remove it from RANK_MISSES and the docs"
    else:
        assert p.rank <= 3, f"{name}: published layout ranks {p.rank}; top 3: {p.top}"


@pytest.mark.parametrize("name", sorted(r.name for r in RECIPES if r.mfu is not None))
def test_published_mfu(name):
    recipe = BY_NAME[name]
    p = predict(recipe, _eff(recipe))
    error = abs(p.mfu - recipe.mfu)
    if name in MFU_MISSES:
        assert error > TOLERANCE, f"{name} now within {error:.3f}: update MFU_MISSES and docs"
    else:
        assert error <= TOLERANCE, f"{name}: predicted {p.mfu:.3f}, published {recipe.mfu}"


def test_recipes_are_sourced_and_consistent():
    for r in RECIPES:
        assert r.source and "20" in r.source  # an author-year citation
        sizes = r.layout
        assert sizes["tp"] * sizes["cp"] * sizes["pp"] * sizes["dp"] == r.cluster.num_gpus
        assert r.global_batch % sizes["dp"] == 0
        assert r.mfu_basis in ("model", "narayanan")


@pytest.mark.slow
def test_committed_constants_are_the_fits_and_leave_one_out():
    """A100: the committed constant is the fit over both A100 MFUs; leaving either out still
    predicts it within 5 points. H100: the fit runs to its bound (the documented reason the
    A100 value is carried over)."""
    a100 = [r for r in RECIPES if r.cluster.gpu.name == "a100-80gb"]
    h100 = [r for r in RECIPES if r.cluster.gpu.name == "h100-sxm"]
    assert fit_efficiency(a100) == EFFICIENCY[("a100-80gb", "bf16")]
    for name, (eff, mfu) in leave_one_out(a100).items():
        assert abs(eff - EFFICIENCY[("a100-80gb", "bf16")]) < 0.02
        assert abs(mfu - BY_NAME[name].mfu) <= TOLERANCE
    assert fit_efficiency(h100) == 1.0
    assert EFFICIENCY[("h100-sxm", "bf16")] == EFFICIENCY[("a100-80gb", "bf16")]
