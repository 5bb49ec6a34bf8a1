"""Group scoring (``RouterConfig.group_score_top_n``): the sum of each group's top-n scores.

- Against a formula written here in plain torch (group scores, mask the other groups, top-k)
  for every n and both the router's fast path and the plain-autograd reference.
- Against transformers' DeepSeek-V3 router (top-2 rule) and DeepSeek-V2 router (group maximum)
  on tiny random configs where ``top_k // group_top_k`` differs from their n; the default
  (Megatron-Core's rule) is shown to pick other experts there.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.moe_router import RouterConfig, TopKRouter, group_score_top_n_for_hf, topk_routing

E, G, GK, K, H = 16, 4, 2, 6, 32  # 4 experts per group; K // GK = 3
# fp32 probabilities in [0, 2.5]. Measured max differences over 5 seeds x 512 tokens: 0 against
# the formula below, 1.8e-7 (under 1 ulp of 2.5) against transformers, which divides in place
# in another order; 4 ulp of 2.5 leaves room for other CPU kernels (the golden rerun).
PROB_ATOL = 4 * torch.finfo(torch.float32).eps * 2.5


def formula_route(scores_TE, bias_E, n, top_k=K, num_groups=G, group_top_k=GK, scale=2.5):
    """Sigmoid group-limited routing written out: (map_TE, probs_TE)."""
    ranked = scores_TE + bias_E
    T = ranked.shape[0]
    group_scores = ranked.view(T, num_groups, -1).topk(n, dim=-1).values.sum(-1)
    keep_TG = torch.zeros(T, num_groups, dtype=torch.bool)
    keep_TG.scatter_(1, group_scores.topk(group_top_k, dim=-1).indices, True)
    keep_TE = keep_TG.repeat_interleave(E // num_groups, dim=1)
    idx = ranked.masked_fill(~keep_TE, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores_TE.gather(1, idx)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale
    map_TE = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    return map_TE, torch.zeros(T, E).scatter(1, idx, weights)


def make_router(n, seed=0, **extra):
    cfg = RouterConfig(
        num_experts=E,
        hidden_size=H,
        top_k=K,
        score_function="sigmoid",
        num_groups=G,
        group_top_k=GK,
        group_score_top_n=n,
        top_k_scaling_factor=2.5,
        enable_expert_bias=True,
        load_balancing_type="none",
        **extra,
    )
    torch.manual_seed(seed)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.expert_bias.normal_(0, 0.1)
    return router


@pytest.mark.golden
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_router_matches_formula_for_each_n(n):
    router = make_router(n)
    x = torch.randn(64, 2, H, generator=torch.Generator().manual_seed(1))
    probs, routing_map = router(x)
    scores = torch.sigmoid(x.reshape(-1, H) @ router.weight.detach().T)
    want_map, want_probs = formula_route(scores, router.expert_bias, n)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs.detach(), want_probs, rtol=0, atol=PROB_ATOL)
    # The plain-autograd reference takes the same option.
    ref = topk_routing(
        x.reshape(-1, H) @ router.weight.detach().T,
        K,
        score_function="sigmoid",
        num_groups=G,
        group_top_k=GK,
        group_score_top_n=n,
        scaling_factor=2.5,
        expert_bias=router.expert_bias,
    )
    assert torch.equal(ref[1], want_map)


@pytest.mark.golden
def test_top_k_not_a_multiple_of_group_top_k_with_an_explicit_group_score():
    """transformers' rule lets DeepSeek-style configs keep 4 groups for a top-6: allowed when
    the group score is explicit, refused under Megatron's rule, which needs top_k / group_top_k."""
    gk = 4
    cfg = dict(num_experts=E, hidden_size=H, top_k=K, score_function="sigmoid", num_groups=G,
               group_top_k=gk, top_k_scaling_factor=2.5, enable_expert_bias=True,
               load_balancing_type="none")  # fmt: skip
    with pytest.raises(ValueError, match=r"top_k=6: with group_score_top_n=None"):
        RouterConfig(**cfg)
    with pytest.raises(ValueError, match=r"top_k=6 is invalid: group_top_k=1 groups of 4"):
        RouterConfig(**{**cfg, "group_top_k": 1}, group_score_top_n=2)
    torch.manual_seed(0)
    router = TopKRouter(RouterConfig(**cfg, group_score_top_n=2))
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.expert_bias.normal_(0, 0.1)
    x = torch.randn(64, 2, H, generator=torch.Generator().manual_seed(5))
    probs, routing_map = router(x)
    scores = torch.sigmoid(x.reshape(-1, H) @ router.weight.detach().T)
    want_map, want_probs = formula_route(scores, router.expert_bias, 2, group_top_k=gk)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs.detach(), want_probs, rtol=0, atol=PROB_ATOL)


def test_gradient_flows_with_top2_rule():
    router = make_router(2)
    x = torch.randn(32, 1, H, generator=torch.Generator().manual_seed(2))
    probs, _ = router(x)
    probs.pow(2).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_none_is_megatron_rule_bit_for_bit():
    """None and n = top_k // group_top_k give the same floats (the golden fixtures pin None)."""
    x = torch.randn(64, 2, H, generator=torch.Generator().manual_seed(3))
    default, explicit = make_router(None), make_router(K // GK)
    p0, m0 = default(x)
    p1, m1 = explicit(x)
    assert torch.equal(m0, m1) and torch.equal(p0, p1)


def test_rules_disagree_on_this_shape():
    """Planted-bug style: on this config Megatron's rule (n=3) selects other experts than n=2,
    so the tests above and below can tell the two apart."""
    x = torch.randn(256, 1, H, generator=torch.Generator().manual_seed(4))
    _, m_default = make_router(None)(x)
    _, m_top2 = make_router(2)(x)
    assert not torch.equal(m_default, m_top2)


def _hf_deepseek_v3_router(transformers):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=G,
        topk_group=GK,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    return config, DeepseekV3TopkRouter(config)


@pytest.mark.golden
def test_matches_transformers_deepseek_v3_and_default_does_not():
    transformers = pytest.importorskip("transformers")
    config, hf = _hf_deepseek_v3_router(transformers)
    n = group_score_top_n_for_hf(config.to_dict())
    assert n == 2 != K // GK
    ours = make_router(n)
    with torch.no_grad():
        hf.weight.copy_(ours.weight)
        hf.e_score_correction_bias.copy_(ours.expert_bias)
    x = torch.randn(128, 2, H, generator=torch.Generator().manual_seed(5))
    _, hf_weights, hf_idx = hf(x)
    hf_map = torch.zeros(x.shape[0] * x.shape[1], E, dtype=torch.bool).scatter_(1, hf_idx, True)
    hf_probs = torch.zeros(hf_map.shape).scatter(1, hf_idx, hf_weights)
    probs, routing_map = ours(x)
    assert torch.equal(routing_map, hf_map)
    torch.testing.assert_close(probs.detach(), hf_probs, rtol=0, atol=PROB_ATOL)
    _, default_map = make_router(None)(x)
    assert not torch.equal(default_map, hf_map)


@pytest.mark.golden
def test_matches_transformers_deepseek_v2_group_maximum():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    config = transformers.DeepseekV2Config(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=G,
        topk_group=GK,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        moe_intermediate_size=8,
        n_shared_experts=1,
    )
    hf = DeepseekV2Moe(config).gate
    n = group_score_top_n_for_hf(config.to_dict())
    assert n == 1
    torch.manual_seed(6)
    cfg = dict(num_experts=E, hidden_size=H, top_k=K, num_groups=G, group_top_k=GK)
    cfg |= dict(pre_softmax=True, top_k_scaling_factor=1.5, load_balancing_type="none")
    ours = TopKRouter(RouterConfig(**cfg, group_score_top_n=n))
    with torch.no_grad():
        ours.weight.normal_(0, 1.0)
        hf.weight.copy_(ours.weight)
    x = torch.randn(128, 2, H, generator=torch.Generator().manual_seed(7))
    _, hf_weights, hf_idx = hf(x)
    hf_map = torch.zeros(x.shape[0] * x.shape[1], E, dtype=torch.bool).scatter_(1, hf_idx, True)
    probs, routing_map = ours(x)
    assert torch.equal(routing_map, hf_map)
    hf_probs = torch.zeros(hf_map.shape).scatter(1, hf_idx, hf_weights)
    torch.testing.assert_close(probs.detach(), hf_probs, rtol=0, atol=PROB_ATOL)
    default = TopKRouter(RouterConfig(**cfg))
    default.load_state_dict(ours.state_dict())
    assert not torch.equal(default(x)[1], hf_map)


@pytest.mark.parametrize(
    ("hf_config", "want"),
    [
        ({"model_type": "deepseek_v3", "n_group": 8, "topk_group": 4}, 2),
        ({"model_type": "kimi_k2", "n_group": 8, "topk_group": 4}, 2),
        ({"model_type": "kimi_k2", "n_group": 1, "topk_group": 1}, None),
        ({"model_type": "glm4_moe", "n_group": 1, "topk_group": 1}, None),
        ({"model_type": "mixtral"}, None),
        (
            {
                "model_type": "kimi_k25",
                "text_config": {"model_type": "kimi_k2", "n_group": 4, "topk_group": 2},
            },
            2,
        ),
        ({"model_type": "deepseek_v2", "n_group": 8, "topk_group": 3}, None),
        (
            {
                "model_type": "deepseek_v2",
                "n_group": 8,
                "topk_group": 3,
                "topk_method": "group_limited_greedy",
            },
            1,
        ),
    ],
)
def test_hf_rule_table(hf_config, want):
    assert group_score_top_n_for_hf(hf_config) == want


def test_hf_rule_refuses_unknown_group_limited_model():
    with pytest.raises(ValueError, match=r"model_type='mystery_moe'.*group_score_top_n"):
        group_score_top_n_for_hf({"model_type": "mystery_moe", "n_group": 4, "topk_group": 2})
    with pytest.raises(ValueError, match="topk_method='noaux'"):
        group_score_top_n_for_hf(
            {"model_type": "deepseek_v2", "n_group": 4, "topk_group": 2, "topk_method": "noaux"}
        )
