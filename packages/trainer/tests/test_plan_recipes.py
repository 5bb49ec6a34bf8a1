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
    "bloom-176b",
    "deepseek-v3",
}
#: Published MFU not within 5 points (docs/planner.md, "Misses").
MFU_MISSES = {"llama3-405b-131k-16384gpu"}
#: Published layouts whose published knobs do not fit shardwork's memory: their MFU is priced
#: for time only (Llama 3 trained 8K sequences without recompute; docs/planner.md, "Misses").
BEYOND_SHARDWORK_MEMORY = {"llama3-405b-8k-8192gpu", "llama3-405b-8k-16384gpu"}
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
    assert p.fits == (name not in BEYOND_SHARDWORK_MEMORY)
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
@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-sxm"])
def test_committed_constants_are_the_fits_and_leave_one_out(gpu):
    """Each committed constant is the fit over every MFU published for its GPU, inside the
    grid (not at a bound); leaving one recipe out and refitting predicts it within 5 points,
    except the expected MFU misses, which miss out of sample too (docs/planner.md, leave-one-out
    table). H800 carries the H100 value (no published H800 MFU)."""
    recipes = [r for r in RECIPES if r.cluster.gpu.name == gpu]
    committed = EFFICIENCY[(gpu, "bf16")]
    assert fit_efficiency(recipes) == committed
    assert 0.2 < committed < 1.0
    for name, (eff, mfu) in leave_one_out(recipes).items():
        assert 0.2 < eff < 1.0
        error = abs(mfu - BY_NAME[name].mfu)
        assert (error > TOLERANCE) == (name in MFU_MISSES), (name, eff, mfu)
    assert EFFICIENCY[("h800-sxm", "bf16")] == EFFICIENCY[("h100-sxm", "bf16")]
