"""Quantile balancing inside the models' MoE layer: the per-step update is wired into
``moe_finalize_kwargs``, activation recompute accumulates nothing twice, and ``qb_beta`` is
checkpoint state.

The router's own semantics are checked against Megatron-Core in moe-router's golden tests;
here the model-level wiring: a float64 tiny Mixtral with quantile balancing, three micro-batches
(also in 1F1B order), with full and selective recompute against none — the accumulated
quantiles and counts, the updated ``qb_beta`` after the finalize hook and every gradient equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwork.models import GPTModel, preset
from shardwork.models.moe import moe_finalize_kwargs, moe_routers
from shardwork.parallel_state import ProcessGroups
from shardwork.parallel_state.testing import assert_close_at_scale

EMA = 0.25


def _config(recompute: str):
    base = preset("tiny-mixtral-8x7b", params_dtype=torch.float64)
    router = dataclasses.replace(
        base.moe.router,
        load_balancing_type="quantile_balancing",
        aux_loss_coeff=0.0,
        z_loss_coeff=1e-3,
        quantile_balancing_ema=EMA,
    )
    return base.replace(moe=base.moe.replace(router=router), recompute=recompute, num_layers=3)


def _run(recompute: str, *, interleaved: bool) -> dict:
    cfg = _config(recompute)
    model = GPTModel(cfg)
    model.train()
    routers = moe_routers(model)
    with torch.no_grad():  # a non-zero start: selection depends on the offset from the start
        for r in routers:
            r.qb_beta.copy_(torch.linspace(-0.2, 0.2, r.qb_beta.numel()) * (r.layer_index + 1))
    start = torch.stack([r.qb_beta.clone() for r in routers])
    gen = torch.Generator().manual_seed(3)
    batches = [
        tuple(torch.randint(0, cfg.vocab_size, (2, 16), generator=gen) for _ in range(2))
        for _ in range(3)
    ]
    if interleaved:  # forward 0, forward 1, backward 0, forward 2, backward 1, backward 2
        losses = [model(ids, labels=labels)[0] for ids, labels in batches[:2]]
        losses[0].backward()
        losses.append(model(batches[2][0], labels=batches[2][1])[0])
        losses[1].backward()
        losses[2].backward()
    else:
        for ids, labels in batches:
            model(ids, labels=labels)[0].backward()
    state = {
        "accum": torch.stack([r.qb_beta_accum.clone() for r in routers]),
        "count": torch.stack([r.qb_beta_count.clone() for r in routers]),
    }
    (hook,) = moe_finalize_kwargs(model, ProcessGroups.single())["moe_hooks"]
    hook()
    state["qb_beta"] = torch.stack([r.qb_beta.clone() for r in routers])
    # the update written out in float64: blend with the mean quantile, centre over experts
    blended = EMA * start.double() + (1 - EMA) * state["accum"].double() / state["count"].unsqueeze(
        1
    )
    expected = blended - blended.mean(dim=1, keepdim=True)
    # qb_beta is an fp32 buffer whatever the model dtype: fp32 rounding of its scale
    assert_close_at_scale(state["qb_beta"].double(), expected, rtol=0, ulps=4, dtype=torch.float32)
    assert int(routers[0].qb_beta_count) == 0
    for name, p in model.named_parameters():
        state[f"grad:{name}"] = p.grad.clone()
    return state


@pytest.mark.parametrize("interleaved", [False, True], ids=["sequential", "1f1b"])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_equals_no_recompute(recompute, interleaved):
    ref = _run("none", interleaved=interleaved)
    got = _run(recompute, interleaved=interleaved)
    assert ref["count"].tolist() == [3] * 3  # one quantile per real forward
    assert set(got) == set(ref)
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=0, msg=key)


def test_qb_beta_is_checkpoint_state():
    model = GPTModel(_config("none"))
    routers = moe_routers(model)
    sharded = model.sharded_state_dict()
    keys = [k for k in sharded if k.endswith("mlp.router.qb_beta")]
    assert len(keys) == len(routers) == 3
    for r in routers:
        key = next(k for k in keys if f"layers.{r.layer_index}." in k)
        assert sharded[key].data is r.qb_beta  # the live buffer: a load writes it
