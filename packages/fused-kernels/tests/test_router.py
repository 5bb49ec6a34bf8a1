"""Router top-k: torch and Triton backends vs a Megatron-Core 0.19 fixture, Triton vs reference."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.launches import count_launches
from shardwork.parallel_state.testing import assert_close_at_scale

# Golden / cross-implementation: CI reruns these with other CPU kernels (.ci/run).
pytestmark = pytest.mark.golden

FIXTURE = pathlib.Path(__file__).parent / "data" / "mcore_router.pt"
MCORE_CASES = torch.load(FIXTURE, weights_only=True)["cases"]


def _route_and_grad(logits, backend, grad_probs, grad_aux, **kw):
    x = logits.detach().clone().requires_grad_(True)
    out = fk.router_topk(x, backend=backend, **kw)
    (grad,) = torch.autograd.grad(
        [out.probs, out.scores_for_aux], [x], [grad_probs.to(out.probs), grad_aux]
    )
    return out, grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "case", range(len(MCORE_CASES)), ids=lambda i: str(MCORE_CASES[i]["config"])
)
def test_matches_megatron_core(case, backend, request):
    device = torch.device("cpu")
    if backend == "triton":
        # CUDA where present (the interpreter is only on without CUDA), else the interpreter.
        device = request.getfixturevalue("triton_device")
        request.getfixturevalue("poison")
    _check_against_fixture(MCORE_CASES[case], backend, device=device)


def _check_against_fixture(
    c: dict, backend: str, *, device=None, logit_scale=1.0, aux_sign=1.0, **changes
):
    """Route the fixture's logits (optionally with a planted bug) on ``device`` and compare
    with Megatron on the CPU: map and counts exactly, floats at 8 fp32 ulp of each tensor's
    max|ref| + rtol 1e-6."""
    device = device or torch.device("cpu")
    bias = c["expert_bias"]
    out, grad = _route_and_grad(
        (c["logits"] * logit_scale).to(device),
        backend,
        c["grad_probs"].to(device),
        (c["grad_aux"] * aux_sign).to(device),
        expert_bias=None if bias is None else bias.to(device),
        **{**c["config"], **changes},
    )
    out = type(out)(*(t.cpu() for t in out))
    grad = grad.cpu()
    assert torch.equal(out.routing_map, c["routing_map"])
    assert torch.equal(out.tokens_per_expert, c["tokens_per_expert"].long())
    # Measured against the fixture (2026-11-24, ulp of max|ref|; torch backend with AVX-512,
    # AVX2 and default kernels / Triton interpreter): probs <= 0.83 / 1.28, aux scores
    # <= 1.48 / 1.58, logits gradient <= 2.70 / 1.62. 8 ulp + rtol 1e-6 leaves ~3x margin.
    for what, got, ref in (
        ("probs", out.probs, c["probs"]),
        ("scores_for_aux", out.scores_for_aux, c["aux_scores"]),
        ("grad_logits", grad, c["grad_logits"]),
    ):
        assert_close_at_scale(got, ref, rtol=1e-6, ulps=8, name=f"{backend} {what}")


# Planted bugs the fixture comparison must still catch (torch backend): scaling factor off by
# 1e-4 relative, logits scaled by 1 + 1e-5 (a temperature bug), the aux scores' upstream
# gradient sign flipped. Measured max errors: 838, 19 and 1.6e7 ulp of max|ref| (tolerance 8).
PLANTED = [
    ("scaling+1e-4", 1, {"scaling_factor": 1.5 * (1 + 1e-4)}, "probs"),
    ("logits*(1+1e-5)", 0, {"logit_scale": 1 + 1e-5}, "probs"),
    ("aux_grad_sign", 0, {"aux_sign": -1.0}, "grad_logits"),
]


@pytest.mark.parametrize(
    ("case", "bug", "caught_by"), [p[1:] for p in PLANTED], ids=[p[0] for p in PLANTED]
)
def test_planted_bug_is_caught(case, bug, caught_by):
    with pytest.raises(AssertionError, match=f"torch {caught_by}"):
        _check_against_fixture(MCORE_CASES[case], "torch", **bug)


def _distinct_logits(n, e, dtype, seed=0):
    """Rows of distinct values exactly representable in fp16 (no top-k ties)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(e, generator=g) for _ in range(n)]).float()
    return ((rows - e / 2) / 4).to(dtype)


CONFIGS = [
    {"topk": 3},
    {"topk": 2, "pre_softmax": True, "normalize": True, "scaling_factor": 2.0},
    {"topk": 4, "num_groups": 6, "group_topk": 3},
    {"topk": 3, "score_function": "sigmoid", "normalize": False},
    {"topk": 4, "score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "bias": True},
    {"topk": 3, "score_function": "sqrtsoftplus", "bias": True, "scaling_factor": 1.5},
]


# 21 tokens × 24 experts: 16-token blocks -> 2 programs (second partial), 24 of 32 expert lanes.
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [21, 1])
def test_triton_matches_reference(cfg, dtype, n, triton_device, tol, poison):
    e = 24
    kw = {k: v for k, v in cfg.items() if k != "bias"}
    if cfg.get("bias"):
        kw["expert_bias"] = (torch.randn(e, generator=torch.Generator().manual_seed(5)) * 0.05).to(
            triton_device
        )
    logits = _distinct_logits(n, e, dtype).to(triton_device)
    gp = torch.randn(n, e, generator=torch.Generator().manual_seed(1)).to(triton_device)
    ga = torch.randn(n, e, generator=torch.Generator().manual_seed(2)).to(triton_device)
    with count_launches() as launches:
        out, grad = _route_and_grad(logits, "triton", gp, ga, **kw)
    assert launches["router_topk_fwd"] == 1 and launches["router_topk_bwd"] == 1
    ref, ref_grad = _route_and_grad(logits, "torch", gp, ga, **kw)
    assert torch.equal(out.routing_map, ref.routing_map)
    assert bool((out.routing_map.sum(1) == kw["topk"]).all())
    assert torch.equal(out.tokens_per_expert, ref.tokens_per_expert)
    torch.testing.assert_close(out.probs.float(), ref.probs.float(), **tol(dtype))
    torch.testing.assert_close(out.scores_for_aux, ref.scores_for_aux, **tol(torch.float32))
    torch.testing.assert_close(grad.float(), ref_grad.float(), **tol(dtype))


def test_group_limit_keeps_routes_inside_chosen_groups():
    logits = torch.randn(50, 32)
    out = fk.router_topk(logits, topk=4, num_groups=8, group_topk=2, backend="torch")
    groups_used = out.routing_map.view(50, 8, 4).any(dim=-1).sum(dim=-1)
    assert bool((groups_used <= 2).all())


def test_expert_bias_steers_selection_not_probs():
    logits = torch.randn(30, 8)
    bias = torch.zeros(8)
    bias[3] = 100.0
    out = fk.router_topk(
        logits, topk=2, score_function="sigmoid", expert_bias=bias, backend="torch"
    )
    assert bool(out.routing_map[:, 3].all())
    s = torch.sigmoid(logits)
    expect = torch.where(out.routing_map, s, 0.0)
    torch.testing.assert_close(out.probs, expect / expect.sum(-1, keepdim=True))


def test_number_arguments_are_checked_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match=re.escape("topk=True must be an int")):
        fk.router_topk(x, topk=True)
    with pytest.raises(TypeError, match=re.escape("topk='2' must be an int")):
        fk.router_topk(x, topk="2")
    with pytest.raises(TypeError, match=re.escape("num_groups=2.0 must be an int")):
        fk.router_topk(x, topk=2, num_groups=2.0, group_topk=1)
    with pytest.raises(TypeError, match=re.escape("scaling_factor='2.5' must be a number")):
        fk.router_topk(x, topk=2, scaling_factor="2.5")
    with pytest.raises(
        ValueError, match=re.escape("scaling_factor=inf must be a finite number > 0")
    ):
        fk.router_topk(x, topk=2, scaling_factor=float("inf"))
    assert fk.router_topk(x, topk=8, scaling_factor=2).routing_map.all()  # topk = num_experts


def test_bad_inputs_name_the_field():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="topk=9"):
        fk.router_topk(x, topk=9)
    with pytest.raises(ValueError, match="score_function='relu'"):
        fk.router_topk(x, topk=2, score_function="relu")
    with pytest.raises(ValueError, match="num_groups=3"):
        fk.router_topk(x, topk=2, num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="must be given together"):
        fk.router_topk(x, topk=2, num_groups=2)
    with pytest.raises(
        ValueError, match="expert_bias is used with score_function='sigmoid' or 'sqrtsoftplus'"
    ):
        fk.router_topk(x, topk=2, expert_bias=torch.zeros(8))


@pytest.mark.gpu
def test_triton_bf16_on_gpu(cuda_device, tol):
    logits = torch.randn(8192, 64, device=cuda_device).to(torch.bfloat16)
    bias = torch.randn(64, device=cuda_device) * 0.01
    kw = {
        "topk": 8,
        "score_function": "sigmoid",
        "num_groups": 8,
        "group_topk": 4,
        "expert_bias": bias,
    }
    out = fk.router_topk(logits, backend="triton", **kw)
    ref = fk.router_topk(logits, backend="torch", **kw)
    same = (out.routing_map == ref.routing_map).all(dim=1)
    assert same.float().mean() > 0.999  # bf16 logits may tie; ties may break differently
    torch.testing.assert_close(
        out.probs[same].float(), ref.probs[same].float(), **tol(torch.bfloat16)
    )
