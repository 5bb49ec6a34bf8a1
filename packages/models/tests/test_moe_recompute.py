"""MoE under activation recompute: the router's side effects happen once per real forward.

A full-recompute layer runs its router again inside backward. These tests compare a model
with recompute against the same model without it (float64, same weights, same batches):
aux losses and their logged values, tracker token counts, the global aux loss's running
counts, expert-bias token counts and the bias update, and every gradient must be equal, also
when a second micro-batch's forward runs before the first one's backward (1F1B order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwork.models import GPTModel, preset
from shardwork.models.moe import moe_finalize_kwargs, moe_routers
from shardwork.parallel_state import ProcessGroups


def _config(recompute: str, balancing):
    base = preset("tiny-mixtral-8x7b", params_dtype=torch.float64)
    router = dataclasses.replace(
        base.moe.router,
        load_balancing_type=balancing,
        aux_loss_coeff=tuple(0.01 * (i + 1) for i in range(len(balancing))),
        z_loss_coeff=1e-3,
        score_function="sigmoid",
        enable_expert_bias=True,
    )
    moe = base.moe.replace(router=router)
    return base.replace(moe=moe, recompute=recompute, num_layers=3)


def _run(recompute: str, balancing, *, interleaved: bool):
    cfg = _config(recompute, balancing)
    model = GPTModel(cfg)
    model.train()
    model.aux_loss_scale.set(1.0 / 64)
    gen = torch.Generator().manual_seed(3)
    batches = [
        tuple(torch.randint(0, cfg.vocab_size, (2, 16), generator=gen) for _ in range(2))
        for _ in range(3)
    ]
    if interleaved:  # forward 0, forward 1, backward 0, forward 2, backward 1, backward 2
        losses = [model(ids, labels=labels)[0] for ids, labels in batches[:2]]
        (losses[0] / 64).backward()
        losses.append(model(batches[2][0], labels=batches[2][1])[0])
        (losses[1] / 64).backward()
        (losses[2] / 64).backward()
    else:
        losses = []
        for ids, labels in batches:
            loss = model(ids, labels=labels)[0]
            (loss / 64).backward()
            losses.append(loss)
    routers = moe_routers(model)
    state = {
        "losses": torch.stack([loss.detach() for loss in losses]),
        "logged": model.aux_loss_tracker.losses.clone(),
        "tracker_tokens": model.aux_loss_tracker.tokens_per_expert.clone(),
        "local_tokens": torch.stack([r.local_tokens_per_expert.clone() for r in routers]),
    }
    if routers[0].global_tokens_per_expert is not None:
        state["global_tokens"] = torch.stack([r.global_tokens_per_expert for r in routers])
        state["global_steps"] = torch.stack([r.global_aux_steps for r in routers])
    for hook in moe_finalize_kwargs(model, ProcessGroups.single())["moe_hooks"]:
        hook()  # expert-bias update from the counted tokens
    state["bias"] = torch.stack([r.expert_bias.clone() for r in routers])
    for name, p in model.named_parameters():
        state[f"grad:{name}"] = p.grad.clone()
    return state


@pytest.mark.parametrize(
    "balancing",
    [("global_aux_loss",), ("aux_loss", "seq_aux_loss", "global_aux_loss")],
    ids=["global", "all"],
)
@pytest.mark.parametrize("interleaved", [False, True], ids=["sequential", "1f1b"])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_equals_no_recompute(recompute, balancing, interleaved):
    ref = _run("none", balancing, interleaved=interleaved)
    got = _run(recompute, balancing, interleaved=interleaved)
    assert set(got) == set(ref)
    assert float(ref["global_steps"].min()) == 3  # one step per real forward
    assert bool((ref["bias"] != 0).any())  # the bias update did something
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=0, msg=key)
