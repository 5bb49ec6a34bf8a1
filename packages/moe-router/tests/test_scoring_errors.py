"""The public pure functions refuse bad arguments before any work, with RouterConfig's rules:
each error names the function, the argument and its value; a valid boundary value still works.
"""

from __future__ import annotations

import re

import pytest
import torch

from shardwork.moe_router import (
    drop_to_capacity,
    expert_capacity,
    group_limited_topk,
    sinkhorn,
    topk_routing,
    z_loss,
)

LOGITS = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))


def _raises(error, fragment):
    return pytest.raises(error, match=re.escape(fragment))


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"top_k": 0}, ValueError, "topk_routing: top_k=0 is invalid"),
        ({"top_k": 5}, ValueError, "topk_routing: top_k=5 is invalid: it must be <= num_experts=4"),
        ({"top_k": 2.0}, ValueError, "topk_routing: top_k=2.0 is invalid"),
        ({"logits_TE": LOGITS[0]}, ValueError, "topk_routing: logits_TE of shape (4,)"),
        ({"logits_TE": LOGITS.long()}, TypeError, "topk_routing: logits_TE of dtype torch.int64"),
        ({"score_function": "relu"}, ValueError, "topk_routing: score_function='relu'"),
        ({"pre_softmax": "False"}, TypeError, "topk_routing: pre_softmax='False'"),
        ({"num_groups": 2}, ValueError, "topk_routing: num_groups=2 and group_top_k=None"),
        (
            {"num_groups": 3, "group_top_k": 1},
            ValueError,
            "topk_routing: num_groups=3 is invalid: num_experts=4",
        ),
        ({"scaling_factor": float("inf")}, ValueError, "topk_routing: scaling_factor=inf"),
        (
            {"score_function": "sigmoid", "expert_bias": torch.zeros(5)},
            ValueError,
            "topk_routing: expert_bias of shape (5,) is invalid",
        ),
        (
            {"expert_bias": torch.zeros(4)},
            ValueError,
            "topk_routing: expert_bias is invalid with score_function='softmax'",
        ),
    ],
)
def test_topk_routing_refuses(kwargs, error, fragment):
    args = {"logits_TE": LOGITS, "top_k": 2, **kwargs}
    with _raises(error, fragment):
        topk_routing(args.pop("logits_TE"), args.pop("top_k"), **args)


def test_topk_routing_boundaries_still_route():
    probs, rmap, _, _ = topk_routing(LOGITS, 4, pre_softmax=True)  # top_k == E
    assert rmap.all() and torch.allclose(probs.sum(-1), torch.ones(5))
    _, rmap, _, _ = topk_routing(
        LOGITS, 2, score_function="sigmoid", num_groups=2, group_top_k=2, expert_bias=torch.zeros(4)
    )
    assert (rmap.sum(-1) == 2).all()


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"num_groups": 4, "group_top_k": 2}, "group_limited_topk: num_groups=4 is invalid"),
        ({"num_groups": 3, "group_top_k": 4}, "group_limited_topk: group_top_k=4 is invalid"),
        ({"num_groups": 3, "group_top_k": 0}, "group_limited_topk: group_top_k=0 is invalid"),
        ({"num_groups": None, "group_top_k": 1}, "group_limited_topk: num_groups=None"),
        ({"top_k": 7}, "group_limited_topk: top_k=7 is invalid: it must be <= num_experts=6"),
        # Megatron's group score needs top_k a multiple of group_top_k, as RouterConfig says
        ({"top_k": 3}, "group_limited_topk: group_top_k=2 is invalid with top_k=3"),
        ({"group_score_top_n": 3}, "group_limited_topk: group_score_top_n=3 is invalid"),
    ],
)
def test_group_limited_topk_refuses(kwargs, fragment):
    args = {"top_k": 2, "num_groups": 3, "group_top_k": 2, **kwargs}
    with _raises(ValueError, fragment):
        group_limited_topk(torch.rand(5, 6), args.pop("top_k"), **args)


def test_group_limited_topk_boundary_group_top_k_equals_num_groups():
    scores = torch.rand(5, 6)
    values, idx = group_limited_topk(scores, 6, num_groups=3, group_top_k=3)
    assert torch.equal(idx.sort(-1).values, torch.arange(6).expand(5, 6))
    assert torch.equal(values, scores.topk(6).values)


@pytest.mark.parametrize(
    "args,fragment",
    [
        ((-10, 4, 2, 1.0), "expert_capacity: num_tokens=-10 is invalid"),
        ((10, 0, 2, 1.0), "expert_capacity: num_experts=0 is invalid"),
        ((10, 4, 5, 1.0), "expert_capacity: top_k=5 is invalid"),
        ((10, 4, 2, 0.0), "expert_capacity: capacity_factor=0.0 is invalid"),
        ((10, 4, 2, float("inf")), "expert_capacity: capacity_factor=inf is invalid"),
        ((10.5, 4, 2, 1.0), "expert_capacity: num_tokens=10.5 is invalid"),
    ],
)
def test_expert_capacity_refuses(args, fragment):
    with _raises(ValueError, fragment):
        expert_capacity(*args)


def test_expert_capacity_boundaries():
    assert expert_capacity(0, 4, 2, 1.0) == 0
    assert expert_capacity(10, 4, 4, 1.0) == 10


def _probs_map():
    probs, rmap, _, _ = topk_routing(torch.randn(8, 4), 2, pre_softmax=True)
    return probs, rmap


@pytest.mark.parametrize(
    "change,error,fragment",
    [
        ({"capacity_factor": -1.0}, ValueError, "drop_to_capacity: capacity_factor=-1.0"),
        ({"capacity_factor": float("nan")}, ValueError, "drop_to_capacity: capacity_factor=nan"),
        ({"top_k": 0}, ValueError, "drop_to_capacity: top_k=0"),
        ({"drop_policy": "random"}, ValueError, "drop_to_capacity: drop_policy='random'"),
        ({"pad_to_capacity": 1}, TypeError, "drop_to_capacity: pad_to_capacity=1"),
        ({"map": "short"}, ValueError, "drop_to_capacity: routing_map_TE of shape (7, 4)"),
        ({"map": "float"}, TypeError, "drop_to_capacity: routing_map_TE of dtype torch.float32"),
    ],
)
def test_drop_to_capacity_refuses(change, error, fragment):
    probs, rmap = _probs_map()
    kind = change.pop("map", None)
    if kind == "short":
        rmap = rmap[:7]
    elif kind == "float":
        rmap = rmap.float()
    args = {"top_k": 2, "capacity_factor": 1.0, **change}
    with _raises(error, fragment):
        drop_to_capacity(probs, rmap, **args)


def test_drop_to_capacity_checks_policy_even_when_nothing_is_dropped():
    probs, rmap = _probs_map()
    # capacity 8 * 2 / 4 * 10 > T: formerly returned before looking at the policy
    with _raises(ValueError, "drop_policy='random'"):
        drop_to_capacity(probs, rmap, top_k=2, capacity_factor=10.0, drop_policy="random")
    kept_probs, kept = drop_to_capacity(probs, rmap, top_k=2, capacity_factor=10.0)
    assert torch.equal(kept, rmap) and torch.equal(kept_probs, probs)


def test_sinkhorn_refuses():
    with _raises(ValueError, "sinkhorn: cost_TE of shape (4,) is invalid"):
        sinkhorn(torch.randn(4))
    with _raises(TypeError, "sinkhorn: cost_TE of dtype torch.int64"):
        sinkhorn(torch.zeros(4, 2, dtype=torch.long))
    with _raises(ValueError, "sinkhorn: tol=-1.0"):
        sinkhorn(torch.randn(4, 2), tol=-1.0)
    with _raises(ValueError, "sinkhorn: max_iters=0"):
        sinkhorn(torch.randn(4, 2), max_iters=0)
    plan = sinkhorn(torch.randn(1, 1), max_iters=1)  # one token, one expert, one iteration
    assert plan.shape == (1, 1)


def test_z_loss_refuses_a_mask_of_another_shape():
    logits = torch.randn(6, 4)
    with _raises(ValueError, "z_loss: padding_mask_T of shape (5,) is invalid: it must be (6,)"):
        z_loss(logits, 0.1, torch.zeros(5, dtype=torch.bool))
    with _raises(TypeError, "z_loss: padding_mask_T of type torch.int64"):
        z_loss(logits, 0.1, torch.zeros(6, dtype=torch.long))
    # the right shape: an all-real mask gives the unmasked loss
    torch.testing.assert_close(
        z_loss(logits, 0.1, torch.zeros(6, dtype=torch.bool)), z_loss(logits, 0.1)
    )
