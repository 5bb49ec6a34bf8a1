"""Published training recipes: predict them, fit the efficiency constants, leave one out.

A :class:`Recipe` is a published run (model shape, cluster, batch, sequence, the layout it
used, the knobs it published, the MFU it reported and on which basis). :func:`predict` plans
the recipe's problem and returns the published layout's rank among the planner's parallel
layouts and its predicted MFU on the paper's basis. The MFU prices the published layout with
its published knobs (recompute, micro-batch, vpp, virtual-stage split); a knob the paper does
not publish is the planner's fastest choice that fits shardwork's memory. When the published
knobs themselves do not fit shardwork's memory (Llama 3 trained 8K sequences without
recompute, which shardwork's saves do not allow at its layout), the step time is still priced
from them — the run happened — and :attr:`Prediction.fits` says so.

- ``model``: training FLOPs without recompute (the calculator's ``flops_per_token``, causal
  attention): the Llama 3 paper's "BF16 MFU".
- ``narayanan``: Narayanan et al. 2021's count, ``96·B·s·l·h²·(1 + s/6h + V/16lh)``: four
  passes of the layers (recompute included, i.e. hardware FLOPs) and non-causal attention;
  here ``flops_per_token(causal=False, full_recompute=True)``.

:func:`fit_efficiency` picks the one constant per GPU that minimises the squared MFU error
over all that GPU's recipes with a published MFU (a grid of step 0.001); :func:`leave_one_out`
refits without each recipe and predicts it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from shardwork.models import GPTConfig, preset
from shardwork.models.calculator import flops_per_token
from shardwork.trainer.plan.cluster import CLUSTERS, Cluster
from shardwork.trainer.plan.layouts import Layout, parallel_layouts, variants
from shardwork.trainer.plan.planner import Plan, plan, planning_model
from shardwork.trainer.plan.step_time import step_time

__all__ = ["Prediction", "Recipe", "fit_efficiency", "leave_one_out", "load_recipes", "predict"]

LAYOUT_KEYS = ("tp", "cp", "pp", "dp", "ep")
FIXED_KEYS = (
    "recompute",
    "micro_batch",
    "vpp",
    "first_virtual_stage_layers",
    "last_virtual_stage_layers",
)


@dataclass(frozen=True)
class Recipe:
    """One published training configuration (``source``: where each number comes from)."""

    name: str
    source: str
    model: GPTConfig
    cluster: Cluster
    global_batch: int
    seq_length: int
    layout: dict
    """The published parallel sizes (tp, cp, pp, dp, ep)."""
    fixed: dict = field(default_factory=dict)
    """Published knobs the prediction must use (recompute, micro_batch, vpp, virtual-stage
    split)."""
    mfu: float | None = None
    mfu_basis: str = "model"
    notes: str = ""


@dataclass(frozen=True)
class Prediction:
    recipe: Recipe
    rank: int | None
    """1-based rank of the published layout among the planner's layouts; None: refused."""
    mfu: float | None
    """Predicted MFU of the published layout on the paper's basis."""
    top: list
    """The planner's three best parallel layouts (descriptions)."""
    fits: bool = True
    """Whether the published layout with its published knobs fits shardwork's memory."""


def _model(spec: dict) -> GPTConfig:
    spec = dict(spec)
    name = spec.pop("preset", None)
    return preset(name, **spec) if name is not None else GPTConfig(**spec)


def load_recipes(path: str | Path) -> list[Recipe]:
    """Recipes from a TOML file of ``[[recipe]]`` tables (see tests/fixtures/plan_recipes.toml)."""
    out = []
    for r in tomllib.loads(Path(path).read_text())["recipe"]:
        cluster = Cluster(num_gpus=r["num_gpus"], **CLUSTERS[r["cluster"]])
        out.append(
            Recipe(
                name=r["name"],
                source=r["source"],
                model=_model(r["model"]),
                cluster=cluster,
                global_batch=r["global_batch"],
                seq_length=r["seq_length"],
                layout={k: r["layout"].get(k, 1) for k in LAYOUT_KEYS},
                fixed={k: r["layout"][k] for k in FIXED_KEYS if k in r["layout"]},
                mfu=r.get("mfu"),
                mfu_basis=r.get("mfu_basis", "model"),
                notes=r.get("notes", ""),
            )
        )
    return out


def _basis_flops(recipe: Recipe) -> float:
    m, s = planning_model(recipe.model), recipe.seq_length
    if recipe.mfu_basis == "narayanan":
        per_token = flops_per_token(m, s, causal=False, full_recompute=True)
    else:
        per_token = flops_per_token(m, s)
    return per_token * recipe.global_batch * s


def _published(recipe: Recipe, result: Plan) -> tuple[list[Layout], bool]:
    """The published layout's variants with the published knobs: those that fit shardwork's
    memory (True), else all of them, priced for time only (False)."""
    want = recipe.layout | recipe.fixed

    def matches(lay: Layout) -> bool:
        return all(getattr(lay, k) == v for k, v in want.items())

    fitting = [r.layout for r in result.rows if matches(r.layout)]
    if fitting:
        return fitting, True
    c = recipe.cluster
    bases = parallel_layouts(
        result.model, num_gpus=c.num_gpus, gpus_per_node=c.gpus_per_node,
        global_batch=recipe.global_batch, seq_length=recipe.seq_length,
    )  # fmt: skip
    every = (
        lay for base in bases for sizes in variants(base, recipe.global_batch) for lay in sizes
    )
    return [lay for lay in every if matches(lay)], False


def _mfu_at(recipe: Recipe, layouts: list[Layout], eff: float) -> float | None:
    if not layouts:
        return None
    kw = dict(global_batch=recipe.global_batch, seq_length=recipe.seq_length, efficiency=eff)
    model = planning_model(recipe.model)
    best = min(step_time(model, lay, recipe.cluster, **kw).total for lay in layouts)
    c = recipe.cluster
    return _basis_flops(recipe) / (best * c.num_gpus * c.gpu.peak_bf16)


def _plan(recipe: Recipe, eff: float) -> Plan:
    return plan(
        recipe.model,
        recipe.cluster,
        global_batch=recipe.global_batch,
        seq_length=recipe.seq_length,
        eff=eff,
    )


def predict(recipe: Recipe, eff: float) -> Prediction:
    """Rank and MFU of the recipe's published layout at efficiency ``eff``."""
    result = _plan(recipe, eff)
    rank = result.rank_of(**recipe.layout)
    top = [r.layout.describe() for r in result.ranked()[:3]]
    layouts, fits = _published(recipe, result)
    return Prediction(recipe, rank, _mfu_at(recipe, layouts, eff), top, fits)


def fit_efficiency(recipes: list[Recipe]) -> float:
    """The constant minimising the squared MFU error over ``recipes`` (all one GPU)."""
    measured = [r for r in recipes if r.mfu is not None]
    if not measured:
        raise ValueError("no recipe with a published MFU to fit the efficiency to")
    # which layouts fit does not depend on the efficiency: plan once, re-time on the grid
    pairs = [(r, _published(r, _plan(r, 0.5))[0]) for r in measured]
    pairs = [(r, rs) for r, rs in pairs if rs]  # a layout the trainer refuses has no time
    if not pairs:
        raise ValueError("no published layout can be priced: nothing to fit the efficiency to")
    best = None
    for step in range(200, 1001):
        eff = step / 1000
        err = sum((_mfu_at(r, rs, eff) - r.mfu) ** 2 for r, rs in pairs)
        if best is None or err < best[0]:
            best = (err, eff)
    return best[1]


def leave_one_out(recipes: list[Recipe]) -> dict[str, tuple[float, float | None]]:
    """For each recipe with an MFU: (constant fitted without it, its MFU predicted with that)."""
    out = {}
    for r in recipes:
        if r.mfu is None:
            continue
        others = [
            o
            for o in recipes
            if o is not r and o.mfu is not None and o.cluster.gpu.name == r.cluster.gpu.name
        ]
        if not others:
            out[r.name] = (float("nan"), None)
            continue
        eff = fit_efficiency(others)
        out[r.name] = (eff, _mfu_at(r, _published(r, _plan(r, eff))[0], eff))
    return out
