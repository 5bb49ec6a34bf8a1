"""Router replay: recorded top-k choices come back exactly in a later forward.

Record two layers over two micro-batches, perturb the gating weights so natural routing
changes, replay: each map equals its record, the probabilities and the weight gradient equal
a formula written here (current logits at the recorded experts), and without replay the
maps differ. Also: records move between objects, misuse raises ValueError.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.utils.checkpoint

from shardwork.moe_router import RouterConfig, RouterReplay, TopKRouter

H = 16
EPS32 = torch.finfo(torch.float32).eps

CASES = {
    # groups + expert bias + scaling: the top-k path (indices recorded directly)
    "sigmoid-groups": dict(
        num_experts=16,
        top_k=4,
        score_function="sigmoid",
        num_groups=4,
        group_top_k=2,
        enable_expert_bias=True,
        top_k_scaling_factor=2.5,
    ),
    # 8 experts, K = 2, pre-softmax: the dense path (indices recovered from the map)
    "presoftmax-dense": dict(num_experts=8, top_k=2, pre_softmax=True),
    "postsoftmax": dict(num_experts=8, top_k=2),
}


def formula_probs(logits_TE, idx_TK, cfg):
    """Combine weights at the given experts, written from the routing definitions."""
    if cfg.score_function == "sigmoid":
        w = torch.sigmoid(logits_TE).gather(1, idx_TK)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    elif cfg.pre_softmax:
        w = torch.softmax(logits_TE, -1).gather(1, idx_TK)
    else:
        w = torch.softmax(logits_TE.gather(1, idx_TK), -1)
    w = w * (cfg.top_k_scaling_factor or 1.0)
    return torch.zeros_like(logits_TE).scatter(1, idx_TK, w)


def to_map(idx_TK, num_experts):
    return torch.zeros(idx_TK.shape[0], num_experts, dtype=torch.bool).scatter_(1, idx_TK, True)


def make_layers(kw, replay, n=2):
    cfg = RouterConfig(hidden_size=H, load_balancing_type="aux_loss", aux_loss_coeff=1e-2, **kw)
    torch.manual_seed(0)
    layers = [TopKRouter(cfg, layer_index=i, replay=replay) for i in range(n)]
    for r in layers:
        with torch.no_grad():
            r.weight.normal_(0, 1.0)
            if r.expert_bias is not None:
                r.expert_bias.normal_(0, 0.1)
    return cfg, layers


@pytest.mark.parametrize("name", list(CASES))
def test_replay_reproduces_recorded_routing(name):
    replay = RouterReplay()
    cfg, layers = make_layers(CASES[name], replay)
    gen = torch.Generator().manual_seed(1)
    micro = [torch.randn(24, 2, H, generator=gen) for _ in range(2)]
    replay.record()
    recorded_maps = [[r(x)[1] for x in micro] for r in layers]
    replay.stop()
    with torch.no_grad():
        for r in layers:
            r.weight.add_(torch.randn(r.weight.shape, generator=gen))
    natural = [[r(x)[1] for x in micro] for r in layers]
    replay.replay()
    for li, r in enumerate(layers):
        for mb, x in enumerate(micro):
            r.weight.grad = None
            probs, routing_map = r(x)
            assert torch.equal(routing_map, recorded_maps[li][mb])
            idx = replay.indices(li)[mb]
            assert torch.equal(to_map(idx, cfg.num_experts), recorded_maps[li][mb])
            want = formula_probs(x.reshape(-1, H) @ r.weight.detach().T, idx, cfg)
            # probs <= 2.5; 8 fp32 ulp of that covers the different summation orders
            torch.testing.assert_close(probs.detach(), want, rtol=0, atol=8 * EPS32 * 2.5)
            probs.pow(2).sum().backward()  # with the aux loss: checked exactly in the next test
            assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    # the perturbation changed natural routing, so the equalities above are not trivial
    assert any(
        not torch.equal(n, m) for ln, lm in zip(natural, recorded_maps) for n, m in zip(ln, lm)
    )


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_gradient_matches_formula(name):
    replay = RouterReplay()
    kw = CASES[name]
    cfg = RouterConfig(hidden_size=H, load_balancing_type="none", **kw)
    torch.manual_seed(0)
    router = TopKRouter(cfg, layer_index=0, replay=replay)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    x = torch.randn(32, 1, H, generator=torch.Generator().manual_seed(2))
    replay.record()
    router(x)
    with torch.no_grad():
        router.weight.mul_(-1.0)  # reverses every preference: natural routing changes
    replay.stop()
    assert not torch.equal(router(x)[1], to_map(replay.indices(0)[0], cfg.num_experts))
    replay.replay()
    probs, _ = router(x)
    upstream = torch.randn(probs.shape, generator=torch.Generator().manual_seed(3))
    (probs * upstream).sum().backward()
    weight = router.weight.detach().clone().requires_grad_(True)
    (
        formula_probs(x.reshape(-1, H) @ weight.T, replay.indices(0)[0], cfg) * upstream
    ).sum().backward()
    scale = weight.grad.abs().max().item()
    torch.testing.assert_close(router.weight.grad, weight.grad, rtol=1e-5, atol=16 * EPS32 * scale)


def test_records_move_between_replay_objects_and_rewind():
    source = RouterReplay()
    _, (src,) = make_layers(CASES["sigmoid-groups"], source, n=1)
    x = torch.randn(20, 1, H, generator=torch.Generator().manual_seed(4))
    source.record()
    _, m = src(x)
    target = RouterReplay()
    target.load({0: source.indices(0)})
    target.replay()
    _, (dst,) = make_layers(CASES["sigmoid-groups"], target, n=1)
    with torch.no_grad():
        dst.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(dst(x)[1], m)
    with pytest.raises(ValueError, match="all were replayed"):
        dst(x)
    target.rewind()
    assert torch.equal(dst(x)[1], m)


def test_replay_misuse_raises_clear_errors():
    replay = RouterReplay()
    cfg, (r,) = make_layers(CASES["postsoftmax"], replay, n=1)
    x = torch.randn(10, 1, H)
    replay.record()
    r(x)
    replay.replay()
    with pytest.raises(ValueError, match=r"needs \[12, 2\]"):
        r(torch.randn(12, 1, H))
    bad = RouterReplay()
    bad.load({0: [torch.tensor([[1, 1]] * 10)]})
    bad.replay()
    r.replay = bad
    with pytest.raises(ValueError, match="names an expert twice"):
        r(x)
    with pytest.raises(ValueError, match="expected \\[T, K\\] int64"):
        bad.load({0: [torch.zeros(10, 2)]})
    with pytest.raises(ValueError, match="layer_index=None"):
        TopKRouter(cfg, replay=replay)
    sink = RouterConfig(hidden_size=H, num_experts=8, top_k=1, load_balancing_type="sinkhorn")
    with pytest.raises(ValueError, match="load_balancing_type='sinkhorn'"):
        TopKRouter(sink, replay=replay, layer_index=0)
    late = TopKRouter(sink, layer_index=0)
    late.replay = replay  # set after construction: refused at the forward
    with pytest.raises(ValueError, match="load_balancing_type='sinkhorn'"):
        late(x)


@pytest.mark.skipif(
    importlib.util.find_spec("shardwork.fused_kernels") is None,
    reason="fused_backend needs shardwork-fused-kernels (the [fused] extra)",
)
def test_replay_refuses_the_fused_path():
    fused = RouterConfig(hidden_size=H, num_experts=8, fused_backend="torch")
    with pytest.raises(ValueError, match="fused_backend='torch'"):
        TopKRouter(fused, replay=RouterReplay(), layer_index=0)


def test_seek_replays_under_activation_checkpointing():
    """Recomputation in backward re-runs the forward; ``seek`` inside the checkpointed
    function gives it the same record, so gradients equal those of a plain replayed run."""
    replay = RouterReplay()
    _, (router,) = make_layers(CASES["sigmoid-groups"], replay, n=1)
    gen = torch.Generator().manual_seed(6)
    micro = [torch.randn(16, 1, H, generator=gen) for _ in range(3)]
    replay.record()
    maps = [router(x)[1] for x in micro]
    with torch.no_grad():
        router.weight.add_(torch.randn(router.weight.shape, generator=gen))
    upstream = torch.randn(16, 16, generator=gen)
    replay.replay()
    grads = []
    for checkpointed in (False, True):
        router.weight.grad = None
        for i in (2, 0, 1):  # out of order: seek picks the record

            def run(x, i=i):
                replay.seek(i)
                return router(x)[0]

            if checkpointed:
                probs = torch.utils.checkpoint.checkpoint(run, micro[i], use_reentrant=False)
            else:
                probs = run(micro[i])
            assert torch.equal(probs.detach() != 0, maps[i])
            (probs * upstream).sum().backward()  # recomputes run() when checkpointed
        grads.append(router.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])
    with pytest.raises(ValueError, match="entry=-1"):
        replay.seek(-1)
