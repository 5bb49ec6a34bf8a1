"""Quantile balancing against Megatron-Core 0.19.2's TopKRouter (committed fixtures).

Fixtures come from ``tools/moe_router_golden.py quantile``: Megatron's router with
``moe_router_load_balancing_type="quantile_balancing"`` runs several optimizer steps of several
micro-batches (forward, backward with a random upstream gradient), then Megatron's own step
update (``finalize_model_grads._update_router_qb_beta``) and reset. Cases: softmax (EMA 0),
sigmoid with scaling (EMA 0.9), pre-softmax with z-loss (EMA 0.5), sqrtsoftplus followed by an
eval-mode forward, and 4 ranks = TP 2 (the sequence split, logits gathered over TP) × DP 2
(quantiles averaged). Ours runs the same inputs through its own state from the same start
(``qb_beta`` included), so errors would compound over the steps.

Routing maps and micro-batch counts must match exactly; probs, input / weight gradients, the
accumulated quantile and the updated ``qb_beta`` within rtol 1e-6 plus 8 fp32 ulp of each
tensor's max|ref| (docs/moe-router.md, "Portable tolerances").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shardwork.moe_router import (
    AuxLossScale,
    RouterConfig,
    TopKRouter,
    update_quantile_balancing,
)
from shardwork.parallel_state.testing import assert_close_at_scale

pytestmark = pytest.mark.golden

FIXTURES = torch.load(
    Path(__file__).parent / "fixtures" / "megatron_quantile_balancing.pt", weights_only=False
)
CASES = FIXTURES["cases"]
SINGLE = [name for name, case in CASES.items() if case.get("world", 1) == 1]
RTOL, ULPS = 1e-6, 8


def close(actual, expected, what):
    assert_close_at_scale(actual, expected, rtol=RTOL, ulps=ULPS, dtype=torch.float32, name=what)


def compare_rank(
    config: RouterConfig, ref: dict, *, token_group=None, step_group=None, beta_sign: float = 1.0
) -> None:
    """Run ``ref``'s inputs through our router and compare every output Megatron recorded."""
    router = TopKRouter(config, tp_cp_group=token_group, loss_scale=AuxLossScale(0.5))
    with torch.no_grad():
        router.weight.copy_(ref["weight"])
        router.qb_beta.copy_(beta_sign * ref["qb_beta"])
    for s, step in enumerate(ref["steps"]):
        router.train()
        router.weight.grad = None
        for m, mb in enumerate(step["micro_batches"]):
            where = f"step {s} micro-batch {m}"
            x = mb["hidden"].clone().requires_grad_(True)
            probs, rmap = router(x)
            assert torch.equal(rmap, mb["routing_map"]), f"{where}: routing map"
            close(probs.detach(), mb["probs"], f"{where}: probs")
            (probs * mb["grad_probs"]).sum().backward()
            close(x.grad, mb["grad_hidden"], f"{where}: grad_hidden")
        close(router.weight.grad, step["grad_weight"], f"step {s}: grad_weight")
        assert int(router.qb_beta_count) == int(step["qb_beta_count"]), f"step {s}: count"
        close(router.qb_beta_accum, step["qb_beta_accum"], f"step {s}: qb_beta_accum")
        update_quantile_balancing([router], group=step_group)
        close(router.qb_beta, step["qb_beta_after"], f"step {s}: qb_beta after the update")
        assert int(router.qb_beta_count) == 0 and not router.qb_beta_accum.any()
    if "eval" in ref:
        router.eval()
        with torch.no_grad():
            probs, rmap = router(ref["eval"]["hidden"])
        assert torch.equal(rmap, ref["eval"]["routing_map"]), "eval: routing map"
        close(probs, ref["eval"]["probs"], "eval: probs")
        assert int(router.qb_beta_count) == int(ref["eval"]["qb_beta_count"]) == 0


@pytest.mark.parametrize("name", SINGLE)
def test_quantile_balancing_matches_megatron(name):
    case = CASES[name]
    compare_rank(RouterConfig(**case["config"]), case["ranks"][0])


def _rank_run(name: str) -> bool:
    ps = pytest.importorskip("shardwork.parallel_state")
    case = CASES[name]
    pg = ps.init_process_groups(ps.ParallelConfig(tp=case["tp"]))
    coords = (pg.rank("tp"), pg.rank("dp"))
    (ref,) = [r for r in case["ranks"] if (r["tp_rank"], r["dp_rank"]) == coords]
    compare_rank(
        RouterConfig(**case["config"]), ref, token_group=pg.tp_cp, step_group=pg.group("dp_cp")
    )
    return True


@pytest.mark.multirank
def test_quantile_balancing_tp2_dp2_matches_megatron():
    """TP 2 (each rank holds half of every sequence; the quantile sees both halves) × DP 2
    (other micro-batches; the step's quantiles averaged): every rank against its Megatron
    rank, for two steps."""
    testing = pytest.importorskip("shardwork.parallel_state.testing")
    assert testing.run_on_ranks(_rank_run, 4, args=("qb_tp2_dp2",)) == [True] * 4


@pytest.mark.parametrize(
    ("name", "planted", "caught_by"),
    [
        # the EMA's memory 1e-3 too large: only the updated offset can show it
        ("qb_softmax_ema0", {"quantile_balancing_ema": 1e-3}, "qb_beta after the update"),
        ("qb_sigmoid_scaled_ema", {"quantile_balancing_ema": 0.9 * (1 + 1e-4)}, "qb_beta after"),
        # the offset added instead of subtracted: the experts chosen change
        ("qb_presoftmax_z", "beta_sign", "routing map"),
    ],
)
def test_planted_bug_is_caught(name, planted, caught_by):
    case = CASES[name]
    config = RouterConfig(**case["config"])
    if planted == "beta_sign":
        run = dict(beta_sign=-1.0)
    else:
        config, run = dataclasses.replace(config, **planted), {}
    with pytest.raises(AssertionError, match=caught_by):
        compare_rank(config, case["ranks"][0], **run)
