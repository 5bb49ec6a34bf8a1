"""MoEBlock / GroupedMLP on one rank against the dense reference (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch

from shardwork.moe_router import GroupedMLP, MoEBlock, RouterConfig
from shardwork.moe_router.testing import dense_moe_reference

# Cross-implementation (fast path vs a plain formula, fp64): CI reruns these with other
# CPU kernels forced (.ci/run).
pytestmark = pytest.mark.golden


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("capacity", [None, 0.75])
def test_block_matches_dense_reference(dispatcher, capacity):
    torch.manual_seed(0)
    cfg = RouterConfig(
        num_experts=6,
        hidden_size=8,
        top_k=2,
        load_balancing_type="none",
        capacity_factor=capacity,
        init_std=0.5,
    )
    block = MoEBlock(cfg, ffn_hidden_size=12, dispatcher=dispatcher).double()
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    out = block(x)
    g = torch.randn_like(out)
    (out * g).sum().backward()

    x_ref = x.detach().clone().requires_grad_(True)
    w = {n: p.detach().clone().requires_grad_(True) for n, p in block.experts.named_parameters()}
    router_w = block.router.weight.detach().clone()
    block.router.weight.data = router_w
    probs, _ = block.router(x_ref)
    ref = dense_moe_reference(x_ref.view(-1, 8), probs, **w).view_as(out)
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for n, p in block.experts.named_parameters():
        torch.testing.assert_close(p.grad, w[n].grad, rtol=1e-12, atol=1e-12)


def test_grouped_mlp_handles_empty_experts_and_from_full():
    E, H, F = 4, 6, 8
    w_up, w_gate = torch.randn(E, H, F), torch.randn(E, H, F)
    w_down = torch.randn(E, F, H)
    full = GroupedMLP.from_full(w_up, w_down, w_gate)
    counts = torch.tensor([3, 0, 2, 0])
    x = torch.randn(5, H)
    expert = [0, 0, 0, 2, 2]
    ref = torch.stack(
        [
            (torch.nn.functional.silu(x[i] @ w_gate[e]) * (x[i] @ w_up[e])) @ w_down[e]
            for i, e in enumerate(expert)
        ]
    )
    torch.testing.assert_close(full(x, counts), ref, rtol=1e-5, atol=1e-5)
    # ETP shards sum to the full output.
    parts = [
        GroupedMLP.from_full(w_up, w_down, w_gate, etp_rank=r, etp_size=2)(x, counts)
        for r in range(2)
    ]
    torch.testing.assert_close(parts[0] + parts[1], ref, rtol=1e-5, atol=1e-5)
    assert all(p.is_expert for p in full.parameters())
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        GroupedMLP(num_local_experts=2, hidden_size=4, ffn_hidden_size=5, etp_size=2)
