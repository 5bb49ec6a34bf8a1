"""Layer options of the hybrid families against transformers' own modules (world 1, fp64).

Each case builds a shardwork part, gives every parameter random values (norm weights too, so
that ``1 + w`` is not trivially 1), copies them into the transformers module and compares the
outputs (and, for the zero-centred norm, the weight gradient). transformers runs its eager
torch paths: the tests assert the attention / experts implementation in use.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.models import GPTConfig, GPTModel, RMSNorm, preset
from shardwork.models.hf.gated_attention_weights import merge_gated_q_proj
from shardwork.parallel_state import ProcessGroups
from shardwork.parallel_state.testing import assert_close_at_scale

transformers = pytest.importorskip("transformers")
from transformers.models.nemotron_h import modeling_nemotron_h as nemotron_h  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next  # noqa: E402

S, B, H, NQ, NKV, D = 12, 2, 64, 4, 2, 16
# fp64 end to end: differences are rounding of O(1) values over a few hundred terms.
TOL = dict(rtol=1e-10, atol=1e-12)
# transformers computes some steps in float32 whatever the input: Qwen3NextRMSNorm (``x.float()``),
# eager attention's and the Qwen3-Next router's softmax (``dtype=torch.float32``). Comparisons
# through them are at float32 rounding; measured max errors in units of eps32·max|ref|: 0.5
# (gated attention), 0.8 (NemotronH attention), 0.5 (MoE block), 1.0 / 1.3 (norm output / weight
# gradient).
FP32 = dict(dtype=torch.float32, rtol=0.0, ulps=8)


def _config(**fields) -> GPTConfig:
    base = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=NQ,
        num_query_groups=NKV,
        head_dim=D,
        ffn_hidden_size=96,
        vocab_size=64,
        make_vocab_size_divisible_by=16,
        rope_theta=10000.0,
        norm_epsilon=1e-6,
        params_dtype=torch.float64,
    )
    return GPTConfig(**(base | fields))


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _causal(b: int, s: int) -> torch.Tensor:
    """Additive causal mask ``[b, 1, s, s]`` for transformers' eager attention."""
    upper = torch.ones(s, s, dtype=torch.bool).triu(1)
    mask = torch.zeros(s, s, dtype=torch.float64).masked_fill(upper, torch.finfo(torch.float64).min)
    return mask.expand(b, 1, s, s)


def _attention(cfg: GPTConfig, seed: int = 7):
    model = GPTModel(cfg)
    attn = model.decoder.layers[0].self_attention
    _randomize(attn, seed)
    return model, attn


def _qwen3_next_config(rotary_factor: float, **fields):
    return transformers.Qwen3NextConfig(
        hidden_size=H,
        num_attention_heads=NQ,
        num_key_value_heads=NKV,
        head_dim=D,
        partial_rotary_factor=rotary_factor,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
        **fields,
    )


def _gated_hf(attn, hf_cfg, *, swap_gate: bool = False):
    hf = qwen3_next.Qwen3NextAttention(hf_cfg, layer_idx=0).double()
    assert hf.config._attn_implementation == "eager"
    q, k, v, gate = attn.linear_qkv.weight.detach().split((NQ * D, NKV * D, NKV * D, NQ * D))
    if swap_gate:  # planted bug: query and gate rows exchanged
        q, gate = gate, q
    with torch.no_grad():
        hf.q_proj.weight.copy_(merge_gated_q_proj(q, gate, num_heads=NQ, head_dim=D))
        hf.k_proj.weight.copy_(k)
        hf.v_proj.weight.copy_(v)
        hf.o_proj.weight.copy_(attn.linear_proj.weight)
        hf.q_norm.weight.copy_(attn.q_layernorm.weight)
        hf.k_norm.weight.copy_(attn.k_layernorm.weight)
    return hf


def _rope_tables(hf_cfg):
    """Qwen3NextRotaryEmbedding's tables with fp64 angles (transformers multiplies positions by
    its fp32 frequencies in fp32, which would bound the comparison at ~1e-6). Its frequencies are
    checked against ``base^(-2i/dim)``, ``dim = int(head_dim · partial_rotary_factor)``, each
    used for channels i and i + dim/2."""
    dim = int(D * hf_cfg.rope_parameters["partial_rotary_factor"])
    formula = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    hf_inv = qwen3_next.Qwen3NextRotaryEmbedding(hf_cfg).inv_freq
    torch.testing.assert_close(hf_inv, formula.float())
    # transformers' fp32 frequencies, as shardwork's (both define them in fp32).
    freqs = torch.arange(S, dtype=torch.float64)[:, None] * hf_inv.double()
    emb = torch.cat((freqs, freqs), dim=-1).expand(B, S, dim)
    return emb.cos(), emb.sin()


def _run_qwen3_next(hf, hf_cfg, x):
    xb = x.transpose(0, 1)  # [b, s, h]
    return hf(xb, _rope_tables(hf_cfg), _causal(B, S))[0].transpose(0, 1)


@pytest.mark.parametrize("rotary_percent", [1.0, 0.25, 0.5])
def test_gated_attention_matches_qwen3_next(rotary_percent):
    cfg = _config(
        qk_layernorm=True,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
        rotary_percent=rotary_percent,
    )
    model, attn = _attention(cfg)
    x = _x()
    out = attn(x, model._attention_inputs(S, None, x.device))
    hf_cfg = _qwen3_next_config(rotary_percent)
    ref = _run_qwen3_next(_gated_hf(attn, hf_cfg), hf_cfg, x)
    assert_close_at_scale(out, ref, name="attention output", **FP32)


def test_gated_attention_planted_bugs_are_caught():
    """Swapped query/gate rows, or the full head rotated instead of a quarter, change the output."""
    cfg = _config(
        qk_layernorm=True,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
        rotary_percent=0.25,
    )
    model, attn = _attention(cfg)
    x = _x()
    out = attn(x, model._attention_inputs(S, None, x.device))
    hf_cfg = _qwen3_next_config(0.25)
    swapped = _run_qwen3_next(_gated_hf(attn, hf_cfg, swap_gate=True), hf_cfg, x)
    assert (out - swapped).abs().max() > 1e-3
    full_cfg = _qwen3_next_config(1.0)
    full = _run_qwen3_next(_gated_hf(attn, full_cfg), full_cfg, x)
    assert (out - full).abs().max() > 1e-3


def test_no_rope_attention_matches_nemotron_h():
    cfg = _config(position_embedding_type="none")
    model, attn = _attention(cfg)
    x = _x()
    inputs = model._attention_inputs(S, None, x.device)
    assert inputs.cos is None and model.spec.rotary is None
    out = attn(x, inputs)
    hf_cfg = transformers.NemotronHConfig(
        hidden_size=H,
        num_attention_heads=NQ,
        num_key_value_heads=NKV,
        head_dim=D,
        attn_implementation="eager",
    )
    hf = nemotron_h.NemotronHAttention(hf_cfg, layer_idx=0).double()
    assert hf.config._attn_implementation == "eager"
    q, k, v = attn.linear_qkv.weight.detach().split((NQ * D, NKV * D, NKV * D))
    with torch.no_grad():
        for lin, w in zip((hf.q_proj, hf.k_proj, hf.v_proj), (q, k, v), strict=True):
            lin.weight.copy_(w)
        hf.o_proj.weight.copy_(attn.linear_proj.weight)
    ref = hf(x.transpose(0, 1), _causal(B, S))[0].transpose(0, 1)
    assert_close_at_scale(out, ref, name="attention output", **FP32)
    # Planted bug: the same weights with RoPE give a different output.
    rope_model = GPTModel(cfg.replace(position_embedding_type="rope"))
    rope_attn = rope_model.decoder.layers[0].self_attention
    rope_attn.load_state_dict(attn.state_dict())
    rotated = rope_attn(x, rope_model._attention_inputs(S, None, x.device))
    assert (rotated - ref).abs().max() > 1e-3


@pytest.mark.parametrize("bias", [False, True])
def test_relu2_mlp_matches_nemotron_h(bias):
    cfg = _config(mlp_activation="relu2", add_mlp_bias=bias)
    mlp = GPTModel(cfg).decoder.layers[0].mlp
    _randomize(mlp, 3)
    hf_cfg = transformers.NemotronHConfig(
        hidden_size=H, intermediate_size=96, mlp_hidden_act="relu2", mlp_bias=bias
    )
    hf = nemotron_h.NemotronHMLP(hf_cfg).double()
    assert type(hf.act_fn).__name__ == "ReLUSquaredActivation"
    with torch.no_grad():
        for ours, theirs in ((mlp.fc1, hf.up_proj), (mlp.fc2, hf.down_proj)):
            theirs.weight.copy_(ours.weight)
            assert (ours.bias is None) == (theirs.bias is None) == (not bias)
            if bias:
                theirs.bias.copy_(ours.bias)
    x = _x(2)
    torch.testing.assert_close(mlp(x), hf(x), **TOL)
    # Planted bug: relu without the square is far off.
    unsquared = mlp.fc2(torch.relu(mlp.fc1(x)))
    assert (unsquared - hf(x)).abs().max() > 1e-2


def test_swiglu_mlp_bias_matches_llama_mlp_bias():
    cfg = _config(add_mlp_bias=True)
    mlp = GPTModel(cfg).decoder.layers[0].mlp
    _randomize(mlp, 11)
    hf_cfg = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=96, hidden_act="silu", mlp_bias=True
    )
    hf = transformers.models.llama.modeling_llama.LlamaMLP(hf_cfg).double()
    gate_w, up_w = mlp.fc1.weight.detach().split(96)
    gate_b, up_b = mlp.fc1.bias.detach().split(96)
    with torch.no_grad():
        hf.gate_proj.weight.copy_(gate_w)
        hf.gate_proj.bias.copy_(gate_b)
        hf.up_proj.weight.copy_(up_w)
        hf.up_proj.bias.copy_(up_b)
        hf.down_proj.weight.copy_(mlp.fc2.weight)
        hf.down_proj.bias.copy_(mlp.fc2.bias)
    x = _x(12)
    torch.testing.assert_close(mlp(x), hf(x), **TOL)
    with torch.no_grad():
        hf.down_proj.bias.zero_()  # planted bug: fc2's bias dropped
    assert (mlp(x) - hf(x)).abs().max() > 1e-2


def test_zero_centered_rmsnorm_matches_qwen3_next_with_gradient():
    norm = RMSNorm(
        H,
        groups=ProcessGroups.single(),
        eps=1e-6,
        backend="torch",
        partial_grad=False,
        zero_centered_gamma=True,
        params_dtype=torch.float64,
    )
    _randomize(norm, 5)
    hf = qwen3_next.Qwen3NextRMSNorm(H, eps=1e-6).double()
    with torch.no_grad():
        hf.weight.copy_(norm.weight)
    x = _x(4)
    grad_out = _x(6)
    out, ref = norm(x), hf(x)
    assert_close_at_scale(out, ref, name="norm output", **FP32)
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    assert_close_at_scale(norm.weight.grad, hf.weight.grad, name="weight grad", **FP32)
    # Planted bug: the plain scale w instead of 1 + w.
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert (plain - ref).abs().max() > 1e-2


def _moe_block_hf(layer, moe):
    hf_cfg = transformers.Qwen3NextConfig(
        hidden_size=H,
        num_experts=moe.router.num_experts,
        num_experts_per_tok=moe.router.top_k,
        moe_intermediate_size=moe.ffn_hidden_size,
        shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        # The Qwen2-MoE twin's router is softmax then top-k without renormalising.
        norm_topk_prob=False,
        experts_implementation="eager",
    )
    hf = qwen3_next.Qwen3NextSparseMoeBlock(hf_cfg).double()
    assert hf_cfg._experts_implementation == "eager"
    f = moe.shared_expert_ffn_hidden_size
    shared_gate, shared_up = layer.shared_experts.fc1.weight.detach().split((f, f))
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.weight)
        hf.experts.gate_up_proj.copy_(layer.experts.linear_fc1.weight)
        hf.experts.down_proj.copy_(layer.experts.linear_fc2.weight)
        hf.shared_expert.gate_proj.weight.copy_(shared_gate)
        hf.shared_expert.up_proj.weight.copy_(shared_up)
        hf.shared_expert.down_proj.weight.copy_(layer.shared_experts.fc2.weight)
        hf.shared_expert_gate.weight.copy_(layer.shared_experts_gate.weight)
    return hf


def test_moe_shared_expert_gate_matches_qwen3_next():
    cfg = preset("tiny-qwen2-57b-a14b", params_dtype=torch.float64, num_layers=1)
    assert cfg.moe.shared_expert_gate and cfg.moe.router.pre_softmax
    layer = GPTModel(cfg).decoder.layers[0].mlp
    _randomize(layer, 9)
    hf = _moe_block_hf(layer, cfg.moe)
    x = _x(8)
    out = layer(x)
    ref = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)
    assert_close_at_scale(out, ref, name="MoE output", **FP32)
    # Planted bug: without the gate's sigmoid the shared expert counts fully.
    with torch.no_grad():
        hf.shared_expert_gate.weight.zero_()  # sigmoid(0) = 1/2 instead of sigmoid(x·w)
    assert (hf(x.transpose(0, 1).contiguous()).transpose(0, 1) - out).abs().max() > 1e-3
