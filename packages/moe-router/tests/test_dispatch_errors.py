"""Dispatchers and GroupedMLP refuse mismatched inputs on one process, before any work: each
error names the argument and the bad value; the matching input still runs."""

from __future__ import annotations

import re

import pytest
import torch

from shardwork.moe_router import AllGatherDispatcher, AllToAllDispatcher, GroupedMLP

E, H, T = 4, 8, 6


def _dispatched(dispatcher_cls):
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(T, E, generator=g)
    rmap = probs > 0.5
    rmap[:, 0] = True  # at least one row
    dispatcher = dispatcher_cls(E)
    dispatched, handle = dispatcher.dispatch(torch.randn(T, H, generator=g), probs * rmap, rmap)
    return dispatcher, dispatched, handle


@pytest.mark.parametrize("dispatcher_cls", [AllToAllDispatcher, AllGatherDispatcher])
def test_combine_refuses_rows_and_hidden_size_of_another_dispatch(dispatcher_cls):
    dispatcher, dispatched, handle = _dispatched(dispatcher_cls)
    n = dispatched.tokens.shape[0]
    name = dispatcher_cls.__name__
    for bad in (torch.randn(n - 1, H), torch.randn(n, H - 1), torch.randn(n * H)):
        shape = re.escape(str(tuple(bad.shape)))
        with pytest.raises(ValueError, match=rf"{name}\.combine: expert_out_NH of shape {shape}"):
            dispatcher.combine(bad, handle)
    with pytest.raises(TypeError, match=rf"{name}\.combine: handle=None is invalid"):
        dispatcher.combine(dispatched.tokens, None)
    out = dispatcher.combine(dispatched.tokens, handle)  # the dispatched rows themselves
    assert out.shape == (T, H)


@pytest.mark.parametrize("dispatcher_cls", [AllToAllDispatcher, AllGatherDispatcher])
def test_dispatcher_num_experts_must_be_an_int(dispatcher_cls):
    with pytest.raises(TypeError, match="num_experts=True is invalid: it must be an integer"):
        dispatcher_cls(True)
    with pytest.raises(ValueError, match="num_experts=0 is invalid"):
        dispatcher_cls(0)
    assert dispatcher_cls(1).num_local_experts == 1


def _mlp():
    return GroupedMLP(num_local_experts=4, hidden_size=H, ffn_hidden_size=16)


@pytest.mark.parametrize(
    "tokens,counts,error,fragment",
    [
        (torch.randn(12, H), [1, 1, 1, 1], ValueError, "(min 1, max 1, sum 4) is invalid for 12"),
        (torch.randn(12, H), [-1, 5, 5, 3], ValueError, "(min -1, max 5, sum 12) is invalid"),
        (torch.randn(12, 7), [3, 3, 3, 3], ValueError, "tokens_NH of shape (12, 7) is invalid"),
        (torch.randn(12, H, dtype=torch.bfloat16), [3] * 4, TypeError, "dtype torch.bfloat16"),
        (torch.randn(12, H), [4, 4, 4], ValueError, "tokens_per_expert of shape (3,)"),
        (torch.randn(12, H), [3.0] * 4, TypeError, "tokens_per_expert of dtype torch.float32"),
        (torch.randn(0, H), [0, 1, 0, 0], ValueError, "(min 0, max 1, sum 1) is invalid for 0"),
    ],
)
def test_grouped_mlp_forward_refuses(tokens, counts, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        _mlp()(tokens, torch.tensor(counts))


def test_grouped_mlp_forward_boundaries():
    mlp = _mlp()
    # every row on one expert, the others empty
    assert mlp(torch.randn(12, H), torch.tensor([0, 12, 0, 0])).shape == (12, H)
    assert mlp(torch.randn(0, H), torch.zeros(4, dtype=torch.long)).shape == (0, H)
    # int32 counts (as a framework may keep them)
    assert mlp(torch.randn(4, H), torch.ones(4, dtype=torch.int32)).shape == (4, H)
    # bf16 tokens with fp32 weights are fine under autocast, which casts both operands
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mlp(torch.randn(12, H, dtype=torch.bfloat16), torch.tensor([3, 3, 3, 3]))
    assert out.shape == (12, H)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"w_down": torch.randn(4, 12, 8)}, "w_down of shape (4, 12, 8) is invalid"),
        ({"w_gate": torch.randn(4, 8, 12)}, "w_gate of shape (4, 8, 12) is invalid"),
        ({"w_up": torch.randn(4, 8)}, "w_up of shape (4, 8) is invalid"),
        (
            {"ep_rank": 2, "ep_size": 2},
            "ep_rank=2 is invalid: it must be an integer in [0, ep_size=2)",
        ),
        ({"ep_rank": -1, "ep_size": 2}, "ep_rank=-1 is invalid"),
        ({"etp_rank": 1}, "etp_rank=1 is invalid"),
        ({"ep_size": 0}, "ep_size=0 is invalid"),
        ({"etp_size": True}, "etp_size=True is invalid"),
    ],
)
def test_from_full_refuses(kwargs, fragment):
    args = {"w_up": torch.randn(4, 8, 16), "w_down": torch.randn(4, 16, 8), **kwargs}
    with pytest.raises(ValueError, match=re.escape("GroupedMLP.from_full: " + fragment)):
        GroupedMLP.from_full(args.pop("w_up"), args.pop("w_down"), **args)


def test_from_full_last_rank_is_valid():
    w_up, w_down = torch.randn(4, 8, 16), torch.randn(4, 16, 8)
    mlp = GroupedMLP.from_full(w_up, w_down, ep_rank=1, ep_size=2, etp_rank=1, etp_size=2)
    assert torch.equal(mlp.w_up, w_up[2:, :, 8:]) and torch.equal(mlp.w_down, w_down[2:, 8:, :])


@pytest.mark.parametrize("name", ["num_local_experts", "hidden_size", "ffn_hidden_size"])
def test_grouped_mlp_sizes_must_be_ints(name):
    kwargs = {"num_local_experts": 2, "hidden_size": 4, "ffn_hidden_size": 6, name: True}
    with pytest.raises(TypeError, match=rf"GroupedMLP\.{name}=True is invalid"):
        GroupedMLP(**kwargs)
    with pytest.raises(TypeError, match=r"GroupedMLP\.gated='yes' is invalid"):
        GroupedMLP(num_local_experts=2, hidden_size=4, ffn_hidden_size=6, gated="yes")
