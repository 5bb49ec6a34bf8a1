"""TopKRouter behaviour beyond the golden fixtures: dtypes, opt-in checks, random routing,
expert-bias bookkeeping, padding masks, group limits."""

from __future__ import annotations

import pytest
import torch

from shardwork.moe_router import RouterConfig, TopKRouter, group_limited_topk, update_expert_bias

BASE = {"num_experts": 8, "hidden_size": 16}


def test_expert_bias_stays_fp32_through_bf16_cast():
    router = TopKRouter(RouterConfig(**BASE, score_function="sigmoid", enable_expert_bias=True))
    router.expert_bias.copy_(torch.linspace(-1e-3, 1e-3, 8) + 1.0 / 3)
    before = router.expert_bias.clone()
    router = router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, before)
    assert router.local_tokens_per_expert.dtype == torch.float32
    sd = router.state_dict()
    assert "expert_bias" in sd and "local_tokens_per_expert" not in sd
    probs, _ = router(torch.randn(4, 2, 16, dtype=torch.bfloat16))
    assert probs.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "router_dtype,expected",
    [(None, torch.bfloat16), ("fp32", torch.float32), ("fp64", torch.float64)],
)
def test_router_dtype(router_dtype, expected):
    router = TopKRouter(RouterConfig(**BASE, router_dtype=router_dtype)).to(torch.bfloat16)
    x = torch.randn(3, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    probs, _ = router(x)
    assert probs.dtype == expected
    probs.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_finite_check_is_opt_in():
    x = torch.randn(2, 2, 16)
    x[0, 0, 0] = float("nan")
    TopKRouter(RouterConfig(**BASE))(x)  # no check, no sync
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        TopKRouter(RouterConfig(**BASE, check_finite=True))(x)


def test_random_routing_straight_through():
    cfg = RouterConfig(**BASE, force_load_balancing=True, pre_softmax=True)
    gen = torch.Generator().manual_seed(3)
    router = TopKRouter(cfg, generator=gen).double()
    x = torch.randn(64, 4, 16, dtype=torch.float64, requires_grad=True)
    probs, rmap = router(x)
    # Balanced in expectation: every expert gets a fair share of 512 routed pairs.
    counts = rmap.sum(0)
    assert counts.min() > 0.5 * counts.float().mean()
    # Straight-through: d(probs)/d(logits) flows to the gating weight as if logits were real.
    g = torch.randn_like(probs)
    (probs * g).sum().backward()
    gen2 = torch.Generator().manual_seed(3)
    noise = torch.randn(256, 8, dtype=torch.float64, generator=gen2).requires_grad_(True)
    p_ref = torch.softmax(noise, -1)
    mask = torch.zeros_like(p_ref, dtype=torch.bool).scatter(1, p_ref.topk(2, dim=1).indices, True)
    ((p_ref * mask) * g).sum().backward()
    torch.testing.assert_close(x.grad.view(-1, 16), noise.grad @ router.weight.detach())


def test_jitter_only_in_training():
    cfg = RouterConfig(**BASE, input_jitter_eps=0.5)
    router = TopKRouter(cfg)
    x = torch.randn(4, 2, 16)
    router.eval()
    a, _ = router(x)
    b, _ = router(x)
    assert torch.equal(a, b)
    router.train()
    c, _ = router(x)
    assert not torch.equal(a, c)


def test_expert_bias_counts_skip_padding_and_update_rule():
    cfg = RouterConfig(
        **BASE, score_function="sigmoid", enable_expert_bias=True, expert_bias_update_rate=0.1
    )
    router = TopKRouter(cfg)
    x = torch.randn(6, 3, 16)
    pad = torch.rand(6, 3) < 0.3
    _, rmap = router(x, padding_mask=pad)
    expected = rmap[~pad.reshape(-1)].sum(0).float()
    assert torch.equal(router.local_tokens_per_expert, expected)
    update_expert_bias([router])
    mean = expected.mean()
    torch.testing.assert_close(router.expert_bias, 0.1 * torch.sign(mean - expected))
    assert router.local_tokens_per_expert.sum() == 0
    # Eval-mode forwards neither count nor get updated.
    router.eval()
    router(x)
    assert router.local_tokens_per_expert.sum() == 0


def test_update_expert_bias_refuses_non_routers():
    router = TopKRouter(RouterConfig(**BASE, score_function="sigmoid", enable_expert_bias=True))
    with pytest.raises(
        TypeError, match=r"routers\[1\]=2 is invalid: every entry must be a TopKRouter"
    ):
        update_expert_bias([router, 2])
    update_expert_bias(r for r in [router])  # any iterable of routers
    assert router.local_tokens_per_expert.sum() == 0


def test_expert_bias_changes_selection_not_weights():
    cfg = RouterConfig(**BASE, score_function="sigmoid", enable_expert_bias=True, top_k=2)
    router = TopKRouter(cfg, device="cpu")
    x = torch.randn(5, 1, 16)
    router.expert_bias.copy_(torch.tensor([100.0, 100.0, 0, 0, 0, 0, 0, 0]))
    probs, rmap = router(x)
    assert rmap[:, :2].all() and rmap.sum() == 10
    s = torch.sigmoid(x.view(-1, 16) @ router.weight.detach().t())[:, :2]
    torch.testing.assert_close(probs[:, :2], s / s.sum(-1, keepdim=True))


def test_group_limited_topk_stays_in_best_groups():
    torch.manual_seed(0)
    scores = torch.rand(50, 16)
    _, idx = group_limited_topk(scores, 4, num_groups=4, group_top_k=2)
    groups = idx // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    # The kept groups are the two with the largest sum of their top-2 scores.
    gsum = scores.view(50, 4, 4).topk(2, dim=-1).values.sum(-1)
    best = gsum.topk(2, dim=-1).indices.sort(-1).values
    for row, b in zip(groups, best):
        assert set(row.tolist()) <= set(b.tolist())


def test_sinkhorn_balances_selection():
    cfg = RouterConfig(**BASE, load_balancing_type="sinkhorn", top_k=1)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 1)
        router.weight[0] += 0.5  # a preferred expert
    x = torch.randn(256, 1, 16).abs()
    router.eval()
    _, eval_map = router(x)
    router.train()
    _, train_map = router(x)
    assert train_map.sum(0).max() < eval_map.sum(0).max()


def test_sinkhorn_iterations_are_capped():
    from shardwork.moe_router import sinkhorn

    torch.manual_seed(0)
    w = torch.randn(8, 16)
    w[0] += 2.0
    cost = (torch.randn(256, 16).abs() @ w.t()).double()
    plan = sinkhorn(cost, max_iters=50)
    assert plan.shape == (256, 8) and torch.isfinite(plan).all()

    def scaled(iters):  # the Sinkhorn-Knopp scaling written out, exactly `iters` rounds
        k = torch.exp(cost)
        r, c = torch.ones(256, dtype=k.dtype), torch.ones(8, dtype=k.dtype)
        for _ in range(iters):
            r = 1 / (256 * ((k * c).sum(1) + 1e-8))
            c = 1 / (8 * ((k * r.unsqueeze(1)).sum(0) + 1e-8))
        return c * k * r.unsqueeze(1)

    # tol=0 never converges, so the cap alone decides the number of rounds.
    for cap in (1, 3):
        torch.testing.assert_close(sinkhorn(cost, tol=0.0, max_iters=cap), scaled(cap))
    assert not torch.allclose(scaled(3), scaled(4))  # the cap, not convergence, stopped it
    # Uncapped enough, the column marginals reach the uniform 1/E (milder logits converge fast).
    mild = torch.randn(256, 8, dtype=torch.float64) * 0.5
    torch.testing.assert_close(
        sinkhorn(mild, tol=1e-12, max_iters=10_000).sum(0),
        torch.full((8,), 1 / 8, dtype=mild.dtype),
        rtol=1e-6,
        atol=1e-8,
    )
