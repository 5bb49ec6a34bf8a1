"""The hand-written routing autograd (routing_fn, routing_dense) against plain autograd.

- gradcheck (fp64, finite differences) of ``TopKProbs`` and ``DenseTopKProbs`` in every
  mode, with the selection held fixed (random, ties-free logits); ``AuxLossGradient`` and
  ``aux_score_sums`` against the same statistic written with plain autograd;
- ``route_topk`` equals ``scoring.topk_routing`` (the plain-autograd formula): same map,
  same probs, same logits gradient, over score functions, K, groups, bias, scaling and E on
  both the dense (few experts) and the top-k path;
- the whole ``TopKRouter.route`` (aux / seq aux / global aux losses, padding mask, capacity
  dropping, group-limited routing) against a loss written here with plain autograd from
  ``scoring.topk_routing`` + ``aux_loss_scores`` + ``switch_aux_loss``.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.moe_router import AuxLossScale, RouterConfig, TopKRouter
from shardwork.moe_router.aux_loss import switch_aux_loss
from shardwork.moe_router.routing_dense import DenseTopKProbs, dense_threshold_map
from shardwork.moe_router.routing_fn import (
    AuxLossGradient,
    TopKProbs,
    aux_score_sums,
    normalised_scores,
    route_topk,
)
from shardwork.moe_router.scoring import activate as _activate
from shardwork.moe_router.scoring import (
    aux_loss_scores,
    drop_to_capacity,
    topk_indices_nonnegative,
    topk_routing,
)

# Cross-implementation (fast path vs a plain formula, fp64): CI reruns these with other
# CPU kernels forced (.ci/run).
pytestmark = pytest.mark.golden


def _logits(T, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g, dtype=torch.float64) * 2


def _scores(logits, mode):
    if mode in ("softmax_pre", "softmax"):
        return torch.softmax(logits, -1)
    if mode == "softmax_post":
        return None
    return _activate(logits, mode)


@pytest.mark.parametrize("mode", ["softmax_post", "softmax_pre", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("k,scaling", [(1, None), (3, 2.5)])
def test_topk_probs_gradcheck(mode, k, scaling):
    logits = _logits(6, 10, seed=1).requires_grad_(True)
    top = torch.topk(logits.detach(), k, dim=1)[1]

    def fn(x):  # scores follow x, so finite differences see the score function
        return TopKProbs.apply(x, _scores(x.detach(), mode), top, mode, scaling)

    assert torch.autograd.gradcheck(fn, (logits,))


@pytest.mark.parametrize("mode", ["softmax_pre", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("k,scaling", [(1, None), (2, 2.5)])
def test_dense_topk_probs_gradcheck(mode, k, scaling):
    logits = _logits(7, 8, seed=2).requires_grad_(True)
    rmap = dense_threshold_map(_scores(logits.detach(), mode), k)
    assert rmap is not None and bool((rmap.sum(1) == k).all())

    def fn(x):
        return DenseTopKProbs.apply(x, rmap, mode, scaling, k, _scores(x.detach(), mode))

    assert torch.autograd.gradcheck(fn, (logits,))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("batch,padded", [(1, False), (3, True)])
def test_aux_loss_gradient_matches_plain_autograd(score_function, batch, padded):
    """The injected gradient is scale * d(sum(sums_BE * dloss_BE))/d(logits), with sums_BE the
    masked per-sequence sums of the normalised scores written here with plain autograd, for a
    per-sequence [B, E] coefficient (seq aux loss) and a shared [1, E] one (aux / global); the
    probs pass through with their own gradient; and the sums' value is checked too."""
    S, E = 4, 6
    logits = _logits(S * batch, E, seed=3)
    valid = torch.tensor([True, False, True] * S)[: S * batch] if padded else None
    g = torch.Generator().manual_seed(4)
    dloss_BE = torch.rand(batch, E, generator=g, dtype=torch.float64) + 0.1
    probs = torch.randn(S * batch, E, generator=g, dtype=torch.float64)
    grad_probs = torch.randn(S * batch, E, generator=g, dtype=torch.float64)
    scale = AuxLossScale(0.375)  # exact in fp32 (the scale is held in fp32)
    scores = _scores(logits, score_function)
    normalised = normalised_scores(scores, score_function)

    def plain_sums(x):
        if score_function == "softmax":
            norm = torch.softmax(x, -1)
        else:
            act = _activate(x, score_function)
            norm = act / (act.sum(-1, keepdim=True) + 1e-20)
        if valid is not None:
            norm = norm * valid.unsqueeze(-1)
        return norm.view(S, batch, E).sum(0)

    for dloss in (dloss_BE, dloss_BE[:1]):
        x = logits.clone().requires_grad_(True)
        p = probs.clone().requires_grad_(True)
        out = AuxLossGradient.apply(
            p, x, scores, normalised, dloss, score_function, batch, valid, scale
        )
        assert torch.equal(out, probs)
        (out * grad_probs).sum().backward()

        ref_x = logits.clone().requires_grad_(True)
        (plain_sums(ref_x) * dloss).sum().mul(0.375).backward()
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(p.grad, grad_probs, rtol=0, atol=0)

    value = aux_score_sums(normalised[0], batch, valid)
    torch.testing.assert_close(value, plain_sums(logits), rtol=1e-12, atol=1e-12)


CASES = [
    dict(score_function="softmax", top_k=2),
    dict(score_function="softmax", top_k=2, pre_softmax=True),
    dict(score_function="softmax", top_k=1, pre_softmax=True, scaling_factor=2.0),
    dict(score_function="softmax", top_k=4, num_groups=4, group_top_k=2),
    dict(score_function="softmax", top_k=4, pre_softmax=True, num_groups=4, group_top_k=2),
    dict(score_function="sigmoid", top_k=1),
    dict(score_function="sigmoid", top_k=2, bias=True),
    dict(
        score_function="sigmoid",
        top_k=8,
        num_groups=8,
        group_top_k=4,
        bias=True,
        scaling_factor=2.5,
    ),
    dict(score_function="sqrtsoftplus", top_k=2),
    dict(score_function="sqrtsoftplus", top_k=4, num_groups=4, group_top_k=2, bias=True),
]


@pytest.mark.parametrize("num_experts", [8, 64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_route_topk_matches_plain_autograd(case, num_experts):
    case = dict(case)
    groups = case.get("num_groups")
    if groups and num_experts // groups < case["top_k"] // case["group_top_k"]:
        pytest.skip("groups smaller than top_k // group_top_k")
    bias = torch.randn(num_experts, dtype=torch.float64) * 0.1 if case.pop("bias", False) else None
    kwargs = dict(case, expert_bias=bias)
    k = kwargs.pop("top_k")
    logits = _logits(40, num_experts, seed=num_experts + k)
    grad_out = torch.randn(40, num_experts, dtype=torch.float64)
    results = []
    for fn in (route_topk, topk_routing):
        x = logits.clone().requires_grad_(True)
        probs, rmap, _, _ = fn(x, k, **kwargs)
        (probs * grad_out).sum().backward()
        results.append((probs.detach(), rmap, x.grad))
    (p1, m1, g1), (p2, m2, g2) = results
    assert torch.equal(m1, m2)
    torch.testing.assert_close(p1, p2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-13)


def _plain_loss(logits, cfg, seq_len, batch, padding_mask, grad_out):
    """(probs * grad_out).sum() + every aux loss, by plain autograd (no router code)."""
    E, K = cfg.num_experts, cfg.top_k
    probs, rmap, _, _ = topk_routing(
        logits,
        K,
        score_function=cfg.score_function,
        pre_softmax=cfg.pre_softmax,
        num_groups=cfg.num_groups,
        group_top_k=cfg.group_top_k,
        scaling_factor=cfg.top_k_scaling_factor,
    )
    if cfg.capacity_factor is not None:
        probs, rmap = drop_to_capacity(probs, rmap, top_k=K, capacity_factor=cfg.capacity_factor)
    amap, scores = aux_loss_scores(logits, K, cfg.score_function)
    valid = torch.ones(logits.shape[0], dtype=torch.bool)
    if padding_mask is not None:
        valid = ~padding_mask
    amap, scores = amap & valid.unsqueeze(-1), scores * valid.unsqueeze(-1)
    # Token counts: Python ints without padding, tensors (fp32 quotients) with it, as the
    # router and Megatron-Core use them.
    n = valid.sum() if padding_mask is not None else logits.shape[0]
    total = (probs * grad_out).sum()
    for name in ("aux_loss", "global_aux_loss"):
        coeff = cfg.aux_loss_coeff_for(name)
        if coeff > 0:
            total = total + switch_aux_loss(
                scores, amap.sum(0), total_num_tokens=n, top_k=K, num_experts=E, coeff=coeff
            )
    coeff = cfg.aux_loss_coeff_for("seq_aux_loss")
    if coeff > 0:
        s_seq, m_seq = scores.reshape(seq_len, -1), amap.reshape(seq_len, -1)
        n_seq = m_seq.sum() / (K * batch) if padding_mask is not None else seq_len
        loss = switch_aux_loss(
            s_seq, m_seq.sum(0), total_num_tokens=n_seq, top_k=K, num_experts=E, coeff=coeff
        )
        total = total + loss / batch
    return probs, rmap, total


ROUTER_CASES = {
    "softmax_aux_padding": dict(num_experts=8, top_k=2, aux_loss_coeff=0.1),
    "softmax_pre_capacity": dict(
        num_experts=8, top_k=2, pre_softmax=True, capacity_factor=0.75, aux_loss_coeff=0.1
    ),
    "sigmoid_seq_aux_groups": dict(
        num_experts=64,
        top_k=8,
        score_function="sigmoid",
        num_groups=8,
        group_top_k=4,
        top_k_scaling_factor=2.5,
        load_balancing_type="seq_aux_loss",
        aux_loss_coeff=0.1,
    ),
    "sigmoid_losses_list_padding": dict(
        num_experts=16,
        top_k=2,
        score_function="sigmoid",
        load_balancing_type=("aux_loss", "seq_aux_loss", "global_aux_loss"),
        aux_loss_coeff=(0.1, 0.05, 0.02),
    ),
    "sqrtsoftplus_seq_capacity": dict(
        num_experts=32,
        top_k=4,
        score_function="sqrtsoftplus",
        load_balancing_type="seq_aux_loss",
        aux_loss_coeff=0.1,
        capacity_factor=1.0,
    ),
}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", sorted(ROUTER_CASES))
def test_router_route_matches_plain_autograd(name, padded):
    cfg = RouterConfig(hidden_size=4, router_dtype="fp64", **ROUTER_CASES[name])
    router = TopKRouter(cfg, loss_scale=AuxLossScale(1.0)).double()
    S, B, E = 6, 3, cfg.num_experts
    logits = _logits(S * B, E, seed=len(name))
    grad_out = torch.randn(S * B, E, dtype=torch.float64)
    mask = (torch.rand(S * B, generator=torch.Generator().manual_seed(5)) < 0.3) if padded else None
    x = logits.clone().requires_grad_(True)
    probs, rmap = router.route(x, seq_len=S, batch=B, padding_mask=mask)
    (probs * grad_out).sum().backward()
    y = logits.clone().requires_grad_(True)
    ref_probs, ref_map, total = _plain_loss(y, cfg, S, B, mask, grad_out)
    total.backward()
    assert torch.equal(rmap, ref_map)
    torch.testing.assert_close(probs.detach(), ref_probs.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-13)


def test_dense_path_falls_back_on_ties():
    """Rows whose scores tie at the K-th place make the threshold map ambiguous: the dense
    path must hand over to the top-k path (same selection as the plain formula)."""
    logits = _logits(16, 8, seed=9)
    logits[3, 1] = logits[3, 5] = logits[3].max() + 1.0  # two equal maxima
    logits[7, 2] = logits[7, 6] = torch.topk(logits[7], 2)[0][1]  # tie at the 2nd place
    ranked = torch.sigmoid(logits)
    assert dense_threshold_map(ranked, 2) is None
    p1, m1, top, _ = route_topk(logits, 2, score_function="sigmoid")
    p2, m2, _, _ = topk_routing(logits, 2, score_function="sigmoid")
    assert top is not None  # the top-k path ran
    assert torch.equal(m1, m2) and bool((m1.sum(1) == 2).all())
    torch.testing.assert_close(p1, p2, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", sorted(ROUTER_CASES))
def test_router_route_under_non_reentrant_checkpoint(name, padded):
    """Activation recompute (``torch.utils.checkpoint``, non-reentrant) lets a backward read
    ``ctx.saved_tensors`` only once; every hand-written routing function must get the same
    gradient under it as without (dense few-expert path and top-k path both covered)."""
    cfg = RouterConfig(hidden_size=4, router_dtype="fp64", **ROUTER_CASES[name])
    S, B, E = 6, 3, cfg.num_experts
    logits = _logits(S * B, E, seed=len(name) + 1)
    grad_out = torch.randn(S * B, E, dtype=torch.float64)
    mask = (torch.rand(S * B, generator=torch.Generator().manual_seed(6)) < 0.3) if padded else None
    grads = []
    for recompute in (False, True):
        router = TopKRouter(cfg, loss_scale=AuxLossScale(1.0)).double()
        x = logits.clone().requires_grad_(True)

        def route(t, router=router):
            return router.route(t, seq_len=S, batch=B, padding_mask=mask)[0]

        if recompute:
            probs = torch.utils.checkpoint.checkpoint(route, x, use_reentrant=False)
        else:
            probs = route(x)
        (probs * grad_out).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_indices_nonnegative_equals_float_topk(dtype, k):
    """Same indices, in the same order, as torch.topk over the floats: random scores, scores
    quantised to a few levels (many ties), zeros, and saturated sigmoids (ties at 1.0)."""
    g = torch.Generator().manual_seed(k)
    rows = [
        torch.rand(64, 40, generator=g, dtype=dtype),
        torch.randint(0, 4, (64, 40), generator=g).to(dtype) / 3,
        torch.zeros(4, 40, dtype=dtype),
        torch.sigmoid(torch.randn(64, 40, generator=g, dtype=dtype) * 40),
    ]
    scores = torch.cat(rows)
    expected = torch.topk(scores, k=k, dim=1)[1]
    assert torch.equal(topk_indices_nonnegative(scores, k), expected)
