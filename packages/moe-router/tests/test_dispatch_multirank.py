"""Dispatchers at EP=2, EP=4, EP=2×ETP=2 and (slow, 8 ranks) EP=4×ETP=2 (dropless and padded to capacity, and with a
TP-replicated input) on real gloo ranks; also with the probabilities sent along with the rows
(``with_probs``) and applied by the experts instead of the combine.

Every rank holds different tokens (as with sequence parallelism); the MoE block's outputs and
gradients must equal the single-process dense computation of the same experts over all ranks'
tokens (float64, no stochastic parts; capacity dropping is per rank, in the reference too).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwork.moe_router import GroupedMLP, MoEBlock, RouterConfig
from shardwork.moe_router.testing import dense_moe_reference

ps = pytest.importorskip("shardwork.parallel_state")
testing = pytest.importorskip("shardwork.parallel_state.testing")

E, H, F, S, B = 8, 6, 8, 4, 2


def _data(world: int, top_k: int):
    g = torch.Generator().manual_seed(1234)
    dd = {"dtype": torch.float64}
    return {
        "router": torch.randn(E, H, generator=g, **dd) * 0.5,
        "w_up": torch.randn(E, H, F, generator=g, **dd) * 0.3,
        "w_gate": torch.randn(E, H, F, generator=g, **dd) * 0.3,
        "w_down": torch.randn(E, F, H, generator=g, **dd) * 0.3,
        "x": torch.randn(world, S, B, H, generator=g, **dd),
        "grad": torch.randn(world, S, B, H, generator=g, **dd),
    }


def _config(top_k: int, padded: bool = False) -> RouterConfig:
    """Dropless, or capacity 1.0 padded to capacity (static shapes; dropping is per rank)."""
    return RouterConfig(
        num_experts=E,
        hidden_size=H,
        top_k=top_k,
        load_balancing_type="none",
        pre_softmax=top_k == 1,
        capacity_factor=1.0 if padded else None,
        pad_to_capacity=padded,
    )


def _reference(world: int, top_k: int, cfg: RouterConfig):
    from shardwork.moe_router import TopKRouter

    d = _data(world, top_k)
    router = TopKRouter(cfg).double()
    router.weight.data.copy_(d["router"])
    w = {k: d[k].clone().requires_grad_(True) for k in ("w_up", "w_gate", "w_down")}
    x = d["x"].clone().requires_grad_(True)
    outs = []
    for r in range(world):
        probs, _ = router(x[r])
        outs.append(dense_moe_reference(x[r].reshape(-1, H), probs, **w).view(S, B, H))
    out = torch.stack(outs)
    (out * d["grad"]).sum().backward()
    return out.detach(), x.grad, {k: v.grad for k, v in w.items()}, router.weight.grad


def _forward(block, x, with_probs: bool):
    """The block's forward; ``with_probs``: the rows' probabilities travel with them and scale
    the expert outputs, and the combine only sums (the MoE layer of shardwork.models)."""
    if not with_probs:
        return block(x)
    probs_TE, map_TE = block.router(x)
    dispatched, handle = block.dispatcher.dispatch(x, probs_TE, map_TE, with_probs=True)
    out = block.experts(dispatched.tokens, dispatched.tokens_per_expert)
    out = out * dispatched.probs.unsqueeze(-1)
    return block.dispatcher.combine(out, handle, apply_probs=False)


def _run_block(
    dispatcher: str, ep: int, etp: int, top_k: int, padded: bool = False, with_probs: bool = False
):
    world, rank = dist.get_world_size(), dist.get_rank()
    pg = ps.init_process_groups(ps.ParallelConfig(tp=etp, ep=ep, etp=etp))
    cfg = _config(top_k, padded)
    block = MoEBlock(
        cfg, ffn_hidden_size=F, dispatcher=dispatcher, ep_group=pg.ep, etp_group=pg.etp
    ).double()
    d = _data(world, top_k)
    ep_rank, etp_rank = ps.group_rank(pg.ep), ps.group_rank(pg.etp)
    with torch.no_grad():
        block.router.weight.copy_(d["router"])
        shard = GroupedMLP.from_full(
            d["w_up"],
            d["w_down"],
            d["w_gate"],
            ep_rank=ep_rank,
            ep_size=ep,
            etp_rank=etp_rank,
            etp_size=etp,
        )
        block.experts.load_state_dict(shard.state_dict())
    x = d["x"][rank].clone().requires_grad_(True)
    out = _forward(block, x, with_probs)
    (out * d["grad"][rank]).sum().backward()
    router_grad = block.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank saw its own tokens; the sum is the full gradient
    grads = {n: p.grad for n, p in block.experts.named_parameters()}
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "expert_grads": grads,
        "router_grad": router_grad,
        "ep_rank": ep_rank,
        "etp_rank": etp_rank,
    }


LAYOUTS = [
    pytest.param("alltoall", 2, 1, 2, False, id="a2a-ep2"),
    pytest.param("alltoall", 4, 1, 2, False, id="a2a-ep4"),
    pytest.param("alltoall", 2, 2, 2, False, id="a2a-ep2-etp2"),
    pytest.param("allgather", 2, 1, 2, False, id="ag-ep2"),
    pytest.param("allgather", 4, 1, 1, False, id="ag-ep4-top1"),
    pytest.param("allgather", 2, 2, 2, False, id="ag-ep2-etp2"),
    pytest.param("alltoall", 2, 2, 2, True, id="a2a-ep2-etp2-padded"),
    pytest.param("allgather", 4, 1, 2, True, id="ag-ep4-padded"),
    # 8 ranks: EP=4 × ETP=2 (each expert's FFN split over an ETP pair inside EP=4).
    pytest.param("alltoall", 4, 2, 2, False, id="a2a-ep4-etp2", marks=pytest.mark.slow),
    pytest.param("allgather", 4, 2, 2, True, id="ag-ep4-etp2-padded", marks=pytest.mark.slow),
]


@pytest.mark.multirank
@pytest.mark.parametrize("dispatcher,ep,etp,top_k,padded", LAYOUTS)
def test_block_equals_single_rank(dispatcher, ep, etp, top_k, padded):
    _check_against_reference(dispatcher, ep, etp, top_k, padded, with_probs=False)


# Probabilities exchanged with the rows: the router's gradient (through the probabilities) and
# every output must still equal the dense reference, with and without an ETP all-gather.
PROBS_LAYOUTS = [
    pytest.param("alltoall", 2, 2, 2, False, id="a2a-ep2-etp2"),
    pytest.param("alltoall", 2, 2, 2, True, id="a2a-ep2-etp2-padded"),
    pytest.param("allgather", 2, 2, 2, False, id="ag-ep2-etp2"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("dispatcher,ep,etp,top_k,padded", PROBS_LAYOUTS)
def test_probs_sent_with_rows_equal_single_rank(dispatcher, ep, etp, top_k, padded):
    _check_against_reference(dispatcher, ep, etp, top_k, padded, with_probs=True)


def _check_against_reference(dispatcher, ep, etp, top_k, padded, *, with_probs):
    world = ep * etp
    results = testing.run_on_ranks(
        _run_block, world, args=(dispatcher, ep, etp, top_k, padded, with_probs)
    )
    out, x_grad, w_grads, router_grad = _reference(world, top_k, _config(top_k, padded))
    tol = {"rtol": 1e-10, "atol": 1e-12}
    L, f = E // ep, F // etp
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["out"], out[rank], **tol)
        torch.testing.assert_close(res["x_grad"], x_grad[rank], **tol)
        torch.testing.assert_close(res["router_grad"], router_grad, **tol)
        e_sl = slice(res["ep_rank"] * L, (res["ep_rank"] + 1) * L)
        f_sl = slice(res["etp_rank"] * f, (res["etp_rank"] + 1) * f)
        torch.testing.assert_close(
            res["expert_grads"]["w_up"], w_grads["w_up"][e_sl, :, f_sl], **tol
        )
        torch.testing.assert_close(
            res["expert_grads"]["w_gate"], w_grads["w_gate"][e_sl, :, f_sl], **tol
        )
        torch.testing.assert_close(
            res["expert_grads"]["w_down"], w_grads["w_down"][e_sl, f_sl, :], **tol
        )


def _run_block_tp_replicated(dispatcher: str, ep: int):
    """hidden replicated over a dense TP group of 2 (no sequence parallelism), EP over it."""
    pg = ps.init_process_groups(ps.ParallelConfig(tp=2, ep=ep, etp=1))
    cfg = _config(2)
    block = MoEBlock(
        cfg, ffn_hidden_size=F, dispatcher=dispatcher, ep_group=pg.ep, tp_group=pg.tp
    ).double()
    num_sets = dist.get_world_size() // 2
    d = _data(num_sets, 2)
    ep_rank, dp_rank = ps.group_rank(pg.ep), ps.group_rank(pg.dp)
    with torch.no_grad():
        block.router.weight.copy_(d["router"])
        shard = GroupedMLP.from_full(
            d["w_up"], d["w_down"], d["w_gate"], ep_rank=ep_rank, ep_size=ep
        )
        block.experts.load_state_dict(shard.state_dict())
    x = d["x"][dp_rank].clone().requires_grad_(True)
    out = block(x)
    (out * d["grad"][dp_rank]).sum().backward()
    grads = {}
    for n, p in block.experts.named_parameters():
        grads[n] = p.grad.clone()
        if pg.edp is not None:
            dist.all_reduce(grads[n], group=pg.edp)  # expert replicas saw different tokens
    router_grad = block.router.weight.grad.clone()
    if pg.dp is not None:
        dist.all_reduce(router_grad, group=pg.dp)
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "expert_grads": grads,
        "router_grad": router_grad,
        "ep_rank": ep_rank,
        "dp_rank": dp_rank,
    }


@pytest.mark.multirank
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("ep", [1, 2])
def test_tp_replicated_input(dispatcher, ep):
    world = 2 * ep
    results = testing.run_on_ranks(_run_block_tp_replicated, world, args=(dispatcher, ep))
    out, x_grad, w_grads, router_grad = _reference(world // 2, 2, _config(2))
    tol = {"rtol": 1e-10, "atol": 1e-12}
    L = E // ep
    for res in results:
        torch.testing.assert_close(res["out"], out[res["dp_rank"]], **tol)
        torch.testing.assert_close(res["x_grad"], x_grad[res["dp_rank"]], **tol)
        torch.testing.assert_close(res["router_grad"], router_grad, **tol)
        e_sl = slice(res["ep_rank"] * L, (res["ep_rank"] + 1) * L)
        for n in ("w_up", "w_gate", "w_down"):
            torch.testing.assert_close(res["expert_grads"][n], w_grads[n][e_sl], **tol)


def _dispatch_with_rank_settings(dispatcher: str, settings: list[dict]):
    """Rank r dispatches with ``settings[r]`` (num_experts, hidden, dtype): every rank must get
    the same ValueError from the first dispatch's check, not an abort inside the exchange."""
    from shardwork.moe_router import AllGatherDispatcher, AllToAllDispatcher

    mine = settings[dist.get_rank()]
    cls = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}[dispatcher]
    d = cls(mine["num_experts"], ep_group=dist.group.WORLD)
    probs = torch.rand(4, mine["num_experts"], dtype=mine["dtype"])
    rmap = probs > 0.5
    try:
        d.dispatch(torch.randn(4, mine["hidden"], dtype=mine["dtype"]), probs * rmap, rmap)
    except ValueError as exc:
        return str(exc)
    return None


SAME = {"num_experts": 4, "hidden": 8, "dtype": torch.float32}
DISAGREEMENTS = [
    pytest.param("alltoall", {"num_experts": 6}, "num_experts=6", id="a2a-num-experts"),
    pytest.param("alltoall", {"hidden": 6}, "hidden size=6", id="a2a-hidden"),
    pytest.param("allgather", {"dtype": torch.float64}, "dtype=torch.float64", id="ag-dtype"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("dispatcher,change,fragment", DISAGREEMENTS)
def test_ranks_that_disagree_raise_on_every_rank(dispatcher, change, fragment):
    settings = [SAME, {**SAME, **change}]
    messages = testing.run_on_ranks(
        _dispatch_with_rank_settings, 2, args=(dispatcher, settings), timeout=60
    )
    assert messages[0] == messages[1]  # the same error on both ranks
    assert "the ranks of ep_group disagree" in messages[0]
    assert "ranks [0]: num_experts=4, hidden size=8" in messages[0]
    assert fragment in messages[0].split("ranks [1]: ")[1]  # rank 1's own setting


def _count_gathers_per_dispatch():
    """All-gathers issued by the first and the second dispatch of one dispatcher."""
    from shardwork.moe_router import AllToAllDispatcher

    original = dist.all_gather_into_tensor
    calls = []
    dist.all_gather_into_tensor = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        d = AllToAllDispatcher(4, ep_group=dist.group.WORLD)
        counts = []
        for _ in range(2):
            before = len(calls)
            probs = torch.rand(4, 4)
            d.dispatch(torch.randn(4, 8), probs, probs > 0.5)
            counts.append(len(calls) - before)
    finally:
        dist.all_gather_into_tensor = original
    return counts


@pytest.mark.multirank
def test_agreement_is_checked_once_per_dispatcher():
    for first, second in testing.run_on_ranks(_count_gathers_per_dispatch, 2, timeout=60):
        assert first == second + 1  # one extra all-gather at the first dispatch only
