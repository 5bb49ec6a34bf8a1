"""An expert-parallel rank that receives no tokens still joins every backward all-to-all.

Every token is routed to the experts of EP rank 0, so rank 1's experts get zero rows. If the
empty expert output were cut off from its (empty) input, autograd would never reach the
dispatch all-to-all's backward on rank 1 while rank 0 runs it: the collective would hang or
abort. The input gradients must equal the single-process computation of the same experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwork.moe_router import AllToAllDispatcher, GroupedMLP

testing = pytest.importorskip("shardwork.parallel_state.testing")

E, H, F, T = 4, 5, 6, 7


def _weights():
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(E, a, b, generator=g, dtype=torch.float64) * 0.4
        for a, b in ((H, F), (H, F), (F, H))
    ]


def _tokens(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    probs = torch.rand(T, E, generator=g, dtype=torch.float64)
    routing = torch.zeros(T, E, dtype=torch.bool)
    routing[:, 0] = True  # expert 0 and 1 live on EP rank 0; experts 2, 3 on rank 1
    routing[::2, 1] = True
    return x, probs * routing, routing


def _expert_out(x, e, w_up, w_gate, w_down):
    return (torch.nn.functional.silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]


def _run():
    rank = dist.get_rank()
    w_up, w_gate, w_down = _weights()
    experts = GroupedMLP.from_full(
        w_up, w_down, w_gate, ep_rank=rank, ep_size=2, etp_rank=0, etp_size=1
    )
    experts = experts.double()
    dispatcher = AllToAllDispatcher(E, ep_group=dist.group.WORLD)
    x, probs, routing = _tokens(rank)
    x.requires_grad_(True)
    dispatched, handle = dispatcher.dispatch(x, probs, routing)
    out = dispatcher.combine(experts(dispatched.tokens, dispatched.tokens_per_expert), handle)
    out.sum().backward()
    return dispatched.tokens.shape[0], out.detach(), x.grad


@pytest.mark.multirank
def test_rank_without_tokens_joins_backward():
    results = testing.run_on_ranks(_run, world_size=2, timeout=60)
    assert results[1][0] == 0 and results[0][0] > 0
    w_up, w_gate, w_down = _weights()
    for rank, (_, out, grad) in enumerate(results):
        x, probs, routing = _tokens(rank)
        x.requires_grad_(True)
        ref = sum(
            probs[:, e : e + 1] * _expert_out(x, e, w_up, w_gate, w_down)
            for e in range(E)
            if routing[:, e].any()
        )
        ref_grad = torch.autograd.grad(ref.sum(), x)[0]
        torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
