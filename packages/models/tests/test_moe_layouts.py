"""MoE models at expert-parallel layouts: loss, every gradient, expert loads and expert-bias
updates equal the single-rank model's (float64, stochastic parts off).

Each case runs one training step through the pipeline schedule and ``finalize_model_grads``
(with ``moe_finalize_kwargs``) and compares with a world-1 reference that sees the same
per-rank token groups (``shardwork.models.moe.testing.compare_moe_layout``).
"""

from __future__ import annotations

import dataclasses

import pytest

from shardwork.models.moe.testing import compare_moe_layout
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank
AUX = {"router": {"load_balancing_type": "aux_loss", "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}}


def _compare(name, kwargs):
    kwargs = dict(kwargs)
    moe = dict(kwargs.pop("moe", {}))
    if moe:
        from shardwork.models import preset

        base = preset(name).moe
        router = dataclasses.replace(base.router, **moe.pop("router", {}))
        kwargs["moe"] = base.replace(router=router, **moe)
    return compare_moe_layout(name, **kwargs)


@pytest.mark.parametrize(
    ("name", "world", "kwargs"),
    [
        ("tiny-mixtral-8x7b", 2, {"ep": 2, "etp": 1, "moe": AUX}),
        ("tiny-qwen3-30b-a3b", 4, {"ep": 4, "etp": 1}),
        ("tiny-qwen2-57b-a14b", 4, {"tp": 2, "ep": 2, "etp": 2, "moe": AUX}),
        ("tiny-mixtral-8x7b", 4, {"tp": 2, "ep": 2, "etp": 2, "sequence_parallel": True}),
        ("tiny-deepseek-v3", 4, {"ep": 2, "etp": 2, "moe": {"dispatcher": "allgather"}}),
        (
            "tiny-mixtral-8x7b",
            2,
            {
                "ep": 2,
                "etp": 1,
                "moe": {"router": {"capacity_factor": 1.0, "aux_loss_coeff": 1e-2}},
            },
        ),
    ],
    ids=[
        "ep2-aux",
        "ep4",
        "ep2-etp2-tp2-gate",
        "ep2-etp2-tp2-sp",
        "ep2-etp2-dsv3-allgather",
        "ep2-capacity",
    ],
)
def test_moe_layout_matches_single_rank(name, world, kwargs):
    losses = run_on_ranks(_compare, world, args=(name, kwargs))
    assert len(set(losses)) == 1


def test_pp2_stage_without_moe_layers_joins_reduction():
    """PP=2 where stage 0 holds only dense layers: it still joins the tracker reduction, and
    the reduced expert loads and gradients equal world 1's."""
    kwargs = {
        "pp": 2,
        "num_layers": 4,
        "moe": {"layer_freq": (0, 0, 1, 1), "router": {"aux_loss_coeff": 1e-2}},
    }
    losses = run_on_ranks(_compare, 2, args=("tiny-mixtral-8x7b", kwargs))
    assert len(set(losses)) == 1


@pytest.mark.slow
def test_ep2_tp2_pp2_matches_single_rank():
    """EP=2 × TP=2 × PP=2 on 8 ranks through the 1F1B schedule (DeepSeek-V3 twin: MLA, MTP
    on the last stage, dense first layer, expert bias)."""
    kwargs = {"tp": 2, "pp": 2, "ep": 2, "etp": 1, "num_layers": 4, "microbatches": 3}
    losses = run_on_ranks(_compare, 8, args=("tiny-deepseek-v3", kwargs), timeout=300)
    assert len(set(round(x, 12) for x in losses)) == 1
