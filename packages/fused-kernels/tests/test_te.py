"""Transformer Engine backend vs the torch reference (needs TE and a CUDA device; skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

import shardwork.fused_kernels as fk
from shardwork.fused_kernels import te_support

pytestmark = pytest.mark.gpu


def _require(op: str) -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine backend needs a CUDA device")
    reason = te_support.unavailable_reason(op)
    if reason is not None:
        pytest.skip(f"Transformer Engine unavailable for {op}: {reason}")
    return torch.device("cuda")


def _grads(y, inputs, gy):
    return (y, *torch.autograd.grad(y, inputs, gy))


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norms(kind, zero_centered, tol):
    dev = _require(kind)
    x = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.rand(1024, device=dev) * 0.2).to(torch.bfloat16).requires_grad_(True)
    gy = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    f = getattr(fk, kind)
    out = {
        b: _grads(f(x, w, zero_centered_gamma=zero_centered, backend=b), [x, w], gy)
        for b in ("te", "torch")
    }
    torch.testing.assert_close(out["te"][0].float(), out["torch"][0].float(), **tol(torch.bfloat16))
    torch.testing.assert_close(out["te"][1].float(), out["torch"][1].float(), **tol(torch.bfloat16))


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_glu(kind, tol):
    dev = _require(kind)
    x = torch.randn(1024, 2 * 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
    tw = torch.rand(1024, device=dev, requires_grad=True)
    gy = torch.randn(1024, 768, device=dev, dtype=torch.bfloat16)
    f = getattr(fk, kind)
    out = {b: _grads(f(x, token_weights=tw, backend=b), [x, tw], gy) for b in ("te", "torch")}
    for a, b in zip(out["te"], out["torch"]):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(smoothing):
    dev = _require("cross_entropy")
    logits = torch.randn(256, 32000, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32000, (256,), device=dev)
    labels[::7] = -100
    gy = torch.rand(256, device=dev)
    out = {
        b: _grads(
            fk.cross_entropy(
                logits, labels, reduction="none", label_smoothing=smoothing, backend=b
            ),
            [logits],
            gy,
        )
        for b in ("te", "torch")
    }
    torch.testing.assert_close(out["te"][0], out["torch"][0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out["te"][1].float(), out["torch"][1].float(), atol=1e-4, rtol=2e-2)


@pytest.mark.parametrize(
    "cfg",
    [
        {"topk": 2},
        {
            "topk": 8,
            "score_function": "sigmoid",
            "num_groups": 8,
            "group_topk": 4,
            "scaling_factor": 2.5,
        },
    ],
    ids=str,
)
def test_router(cfg):
    dev = _require("router_topk")
    logits = torch.randn(4096, 64, device=dev)
    kw = dict(cfg)
    if kw.get("score_function") == "sigmoid":
        kw["expert_bias"] = torch.randn(64, device=dev) * 0.01
    te_out = fk.router_topk(logits, backend="te", **kw)
    ref = fk.router_topk(logits, backend="torch", **kw)
    assert torch.equal(te_out.routing_map, ref.routing_map)
    torch.testing.assert_close(te_out.probs, ref.probs)
    torch.testing.assert_close(te_out.scores_for_aux, ref.scores_for_aux)
    assert torch.equal(te_out.tokens_per_expert, ref.tokens_per_expert)
