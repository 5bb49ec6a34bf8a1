"""MoE layers with squared-ReLU experts (``mlp_activation="relu2"``, Nemotron-H): the layer
against the same routing written in plain torch (the router's own choices, then
``down(relu(up(x))²)`` per expert, weighted, plus the squared-ReLU shared expert), its
checkpoint keys and shapes, the parameter calculator against the built model, and EP/ETP
layouts against world size 1 (the memory formulas: ``test_calculator_memory.py``)."""

from __future__ import annotations

import pytest
import torch

from shardwork.models import GPTModel, preset
from shardwork.models.calculator_moe import moe_param_counts
from shardwork.models.moe import MoELayer
from shardwork.models.moe.testing import compare_moe_layout
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.golden

# Qwen2-MoE twin: softmax routing, shared expert with a sigmoid gate; DeepSeek-V3 twin:
# sigmoid scores, group-limited selection on score + expert bias, scaling factor.
NAMES = ("tiny-qwen2-57b-a14b", "tiny-deepseek-v3")


def _layer(name: str) -> tuple[MoELayer, int]:
    cfg = preset(name, params_dtype=torch.float64, mlp_activation="relu2")
    torch.manual_seed(0)
    model = GPTModel(cfg)
    with torch.no_grad():  # a non-zero expert bias, so selection differs from the scores' top-k
        for p in model.parameters():
            if p.dim() == 1 and p.numel() == cfg.moe.router.num_experts:
                p.copy_(0.05 * torch.randn(p.shape, dtype=p.dtype))
    return next(m for m in model.modules() if isinstance(m, MoELayer)), cfg.hidden_size


def _plain_relu2(x, up, down):
    return torch.relu(x @ up.t()).square() @ down.t()


@pytest.mark.parametrize("name", NAMES)
def test_relu2_moe_layer_matches_plain_torch(name):
    layer, h = _layer(name)
    x = torch.randn(6, 2, h, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    probs, routing_map = layer.router(x)  # [T, E]: the weights of the chosen experts, else 0
    assert int(routing_map.sum()) == x.shape[0] * x.shape[1] * layer.router.inner.config.top_k
    up_w, down_w = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    tokens = x.detach().clone().requires_grad_().reshape(-1, h)
    ref = torch.zeros_like(tokens)
    for e in range(up_w.shape[0]):
        rows = routing_map[:, e].nonzero().squeeze(1)
        y = _plain_relu2(tokens[rows], up_w[e], down_w[e])
        ref = ref.index_add(0, rows, y * probs[rows, e, None].detach())
    shared = layer.shared_experts
    if shared is not None:
        s = _plain_relu2(tokens, shared.fc1.weight, shared.fc2.weight)
        if layer.shared_experts_gate is not None:
            s = s * torch.sigmoid(tokens @ layer.shared_experts_gate.weight.t())
        ref = ref + s
    torch.testing.assert_close(out, ref.view_as(x), rtol=1e-10, atol=1e-12)
    # weight gradients through the grouped GEMMs equal autograd through the plain formula
    g = torch.randn(out.shape, dtype=torch.float64)
    w_grads = torch.autograd.grad((out * g).sum(), (up_w, down_w), retain_graph=True)
    ref_grads = torch.autograd.grad((ref.view_as(x) * g).sum(), (up_w, down_w))
    for got, want in zip(w_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_relu2_expert_keys_are_per_expert_without_blocks():
    cfg = preset("tiny-qwen2-57b-a14b", mlp_activation="relu2")
    model = GPTModel(cfg, device="meta")
    state = model.sharded_state_dict()
    E, F, S, h = 8, cfg.moe.ffn_hidden_size, cfg.moe.shared_expert_ffn_hidden_size, 64
    fc1 = sorted(k for k in state if "decoder.layers.0.mlp.experts.linear_fc1" in k)
    assert fc1 == sorted(f"decoder.layers.0.mlp.experts.linear_fc1.weight.{e}" for e in range(E))
    assert all(tuple(state[k].global_shape) == (F, h) for k in fc1)
    assert tuple(state["decoder.layers.0.mlp.experts.linear_fc2.weight.3"].global_shape) == (h, F)
    assert tuple(state["decoder.layers.0.mlp.shared_experts.fc1.weight"].global_shape) == (S, h)


@pytest.mark.parametrize("name", NAMES)
def test_calculators_count_two_matrices_per_relu2_expert(name):
    cfg = preset(name, mlp_activation="relu2")
    swiglu = preset(name)
    model = GPTModel(cfg, device="meta")
    pad = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size
    pad *= 1 if cfg.tie_word_embeddings else 2
    built = sum(p.numel() for p in model.parameters()) - pad
    counts = moe_param_counts(cfg)
    assert counts.total == built
    # one h·F matrix less per expert (routed and MTP layers) and one h·S less per shared MLP
    m, h = cfg.moe, cfg.hidden_size
    moe_layers = sum(isinstance(x, MoELayer) for x in model.modules())
    dense_layers = sum(1 for k in model.state_dict() if k.endswith("mlp.fc2.weight"))
    fewer = moe_layers * (m.router.num_experts * h * m.ffn_hidden_size)
    fewer += moe_layers * h * (m.shared_expert_ffn_hidden_size or 0)
    fewer += dense_layers * h * cfg.ffn_hidden_size
    assert moe_param_counts(swiglu).total - counts.total == fewer
    active_fewer = fewer - moe_layers * (m.router.num_experts - m.router.top_k) * h * (
        m.ffn_hidden_size
    )
    assert moe_param_counts(swiglu).active - counts.active == active_fewer


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "world", "kwargs"),
    [
        ("tiny-qwen2-57b-a14b", 2, {"ep": 2, "etp": 1, "mlp_activation": "relu2"}),
        ("tiny-qwen2-57b-a14b", 4, {"ep": 2, "etp": 2, "mlp_activation": "relu2"}),
        ("tiny-nemotron-h-moe", 2, {"ep": 2, "etp": 1}),
    ],
    ids=["ep2", "ep2-etp2", "nemotron-h-moe-ep2"],
)
def test_relu2_moe_layout_matches_single_rank(name, world, kwargs):
    losses = run_on_ranks(compare_moe_layout, world, args=(name,), kwargs=kwargs, timeout=400)
    assert len(set(losses)) == 1
