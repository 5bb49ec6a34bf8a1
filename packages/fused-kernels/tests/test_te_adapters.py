"""Plumbing of the ``te`` adapters, on CPU, against stand-ins that follow TE's documented APIs.

The stand-ins compute with the torch reference, so these tests check only what ``te_ops``
adds (argument order, reshapes, autograd wiring, the copy that protects the caller's logits
from TE's in-place forward, the normalisation gate). Real TE runs in ``test_te.py`` (GPU).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import shardwork.fused_kernels as fk
from shardwork.fused_kernels import te_ops, te_support


def _norm_fwd(x, w, b, eps, zero_centered, rms):
    xf = x.float()
    mu = None if rms else xf.mean(-1)
    xc = xf if rms else xf - mu[:, None]
    rsigma = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    weff = w.float() + 1 if zero_centered else w.float()
    y = xc * rsigma[:, None] * weff + (0 if b is None else b.float())
    return y.to(x.dtype), mu, rsigma


def _norm_bwd(dz, x, mu, rsigma, w, zero_centered, rms):
    with torch.enable_grad():  # called from inside an autograd backward
        xl = x.detach().float().requires_grad_(True)
        wl = w.detach().float().requires_grad_(True)
        bl = None if rms else torch.zeros_like(wl, requires_grad=True)
        xc = xl if rms else xl - xl.mean(-1, keepdim=True)
        weff = wl + 1 if zero_centered else wl
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-5) * weff
        if bl is not None:
            y = y + bl
        leaves = [xl, wl] if bl is None else [xl, wl, bl]
        grads = torch.autograd.grad(y, leaves, dz.float())
    return tuple(g.to(t.dtype) for g, t in zip(grads, [x, w, w]))


@pytest.fixture
def fake_te(monkeypatch):
    tex = types.ModuleType("transformer_engine_torch")
    tex.rmsnorm_fwd = lambda x, w, eps, out, q, otype, sm, zc: _norm_fwd(x, w, None, eps, zc, True)
    tex.rmsnorm_bwd = lambda dz, x, rs, w, sm, zc: _norm_bwd(dz, x, None, rs, w, zc, True)
    tex.layernorm_fwd = lambda x, w, b, eps, out, q, otype, sm, zc: _norm_fwd(
        x, w, b, eps, zc, False
    )
    tex.layernorm_bwd = lambda dz, x, mu, rs, w, sm, zc: _norm_bwd(dz, x, mu, rs, w, zc, False)
    constants = types.ModuleType("transformer_engine.pytorch.constants")
    constants.TE_DType = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

    def parallel_cross_entropy(inp, target, smoothing, reduce_loss, group, ignore_idx):
        loss = F.cross_entropy(
            inp[0].float(),
            target[0],
            reduction="none",
            label_smoothing=smoothing,
            ignore_index=ignore_idx,
        )
        inp.data.fill_(float("nan"))  # TE stores its gradient into the input in forward
        return loss[None]

    ce = types.ModuleType("transformer_engine.pytorch.cross_entropy")
    ce.parallel_cross_entropy = parallel_cross_entropy
    router = types.ModuleType("transformer_engine.pytorch.router")

    def fused_topk(
        *,
        logits,
        topk,
        use_pre_softmax,
        num_groups,
        group_topk,
        scaling_factor,
        score_function,
        expert_bias,
    ):
        r = fk.router_topk(logits, topk=topk, score_function=score_function, pre_softmax=use_pre_softmax,
                           num_groups=num_groups, group_topk=group_topk, expert_bias=expert_bias,
                           scaling_factor=scaling_factor, backend="torch")  # fmt: skip
        return r.probs, r.routing_map.int()

    def fused_aux(*, logits, topk, score_function):
        r = fk.router_topk(logits, topk=topk, score_function=score_function, backend="torch")
        aux_map = torch.zeros_like(r.routing_map).scatter(
            1, r.scores_for_aux.topk(topk, -1).indices, True
        )
        return aux_map, r.scores_for_aux

    router.fused_topk_with_score_function = fused_topk
    router.fused_compute_score_for_moe_aux_loss = fused_aux
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.ops = types.SimpleNamespace(
        SwiGLU=lambda: lambda x: fk.swiglu(x, backend="torch"),
        GEGLU=lambda: lambda x: fk.geglu(x, backend="torch"),
    )
    for name, mod in {
        "transformer_engine_torch": tex,
        "transformer_engine.pytorch.constants": constants,
        "transformer_engine.pytorch.cross_entropy": ce,
        "transformer_engine.pytorch.router": router,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(te_support, "_load", lambda: (pt, (2, 13), None))


@pytest.mark.parametrize("rms", [True, False])
def test_norm_adapter_autograd(fake_te, rms):
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    gy = torch.randn(3, 5, 16)
    if rms:
        y = te_ops.rms_norm(x, w, eps=1e-5, zero_centered_gamma=True)
        y_ref = fk.rms_norm(x, w, eps=1e-5, zero_centered_gamma=True, backend="torch")
    else:
        y = te_ops.layer_norm(x, w, None, eps=1e-5, zero_centered_gamma=False)
        y_ref = fk.layer_norm(x, w, eps=1e-5, backend="torch")
    assert y.shape == x.shape
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(torch.autograd.grad(y, [x, w], gy), torch.autograd.grad(y_ref, [x, w], gy)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_glu_adapter_token_weights(fake_te):
    x, tw = torch.randn(4, 6, 10), torch.rand(4, 6)
    torch.testing.assert_close(
        te_ops.glu(x, tw, kind="swiglu"), fk.swiglu(x, token_weights=tw, backend="torch")
    )


@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_adapter_protects_logits_unless_inplace(fake_te, inplace):
    logits = torch.randn(6, 20)
    labels = torch.randint(0, 20, (6,))
    labels[2] = -100
    keep = logits.clone()
    losses = te_ops.cross_entropy(
        logits, labels, tp_group=None, ignore_index=-100, label_smoothing=0.1, inplace=inplace
    )
    torch.testing.assert_close(
        losses, F.cross_entropy(keep, labels, reduction="none", label_smoothing=0.1)
    )
    assert torch.equal(logits, keep) != inplace


def test_router_adapter_and_normalize_gate(fake_te):
    logits = torch.randn(9, 16)
    kw = dict(topk=4, score_function="sqrtsoftplus", pre_softmax=False, num_groups=4, group_topk=2,
              expert_bias=torch.randn(16) * 0.1, scaling_factor=2.0)  # fmt: skip
    out = te_ops.router_topk(logits, normalize=None, **kw)
    ref = fk.router_topk(logits, backend="torch", **kw)
    assert out.routing_map.dtype == torch.bool and torch.equal(out.routing_map, ref.routing_map)
    assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert)
    with pytest.raises(ValueError, match="normalize=False"):
        te_ops.router_topk(logits, normalize=False, **kw)
