"""Layer options of the hybrid families inside shardwork: config errors, what ``spec_for``
derives, zero-centred norms across the whole model, the gate block's place in the checkpoint,
the Hugging Face ``q_proj`` conversion, and TP=2 / TP=2+SP against world size 1.

(Each option against transformers' own module: ``test_layer_options_hf.py``.)
"""

from __future__ import annotations

import pytest
import torch

from shardwork.fused_kernels import YarnRopeScaling
from shardwork.models import (
    DecoderSpec,
    GPTModel,
    LayerSpec,
    MTPConfig,
    RMSNorm,
    SquaredReLUMLP,
    preset,
    spec_for,
)
from shardwork.models.full_state import full_state_dict
from shardwork.models.hf import adapter_for_config
from shardwork.models.hf.gated_attention_weights import merge_gated_q_proj, split_gated_q_proj
from shardwork.models.testing import compare_with_single_rank, random_batch
from shardwork.parallel_state.testing import run_on_ranks

QWEN3 = "tiny-qwen3-8b"  # 4 heads, 2 kv heads, head_dim 16, QK-norm


# ---- config errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(position_embedding_type="alibi"), r"position_embedding_type='alibi'.*'rope', 'none'"),
        (dict(mlp_activation="gelu"), r"mlp_activation='gelu'.*'swiglu', 'relu2'"),
        (dict(rotary_percent=0.0), r"rotary_percent=0.0 .*\(0, 1\]"),
        (dict(rotary_percent=1.5), r"rotary_percent=1.5 .*\(0, 1\]"),
        (dict(rotary_percent="half"), r"rotary_percent='half' is invalid: it must be a number"),
        # head_dim 16: a tenth rotates int(1.6) = 1 channel, RoPE needs pairs.
        (dict(rotary_percent=0.1), r"rotary_percent=0.1 .*int\(0.1·16\)=1 .*even number >= 2"),
        (
            dict(position_embedding_type="none", rotary_percent=0.5),
            r"rotary_percent=0.5 needs position_embedding_type='rope'",
        ),
        (dict(attention_output_gate=1), r"attention_output_gate=1 .*True or False"),
        (dict(layernorm_zero_centered_gamma="yes"), r"layernorm_zero_centered_gamma='yes'"),
        (dict(add_mlp_bias=None), r"add_mlp_bias=None .*True or False"),
    ],
)
def test_invalid_layer_options_name_field_value_and_valid_values(fields, expected):
    with pytest.raises(ValueError, match=expected):
        preset(QWEN3, **fields)


def test_rope_scaling_without_rope_is_refused():
    scaling = YarnRopeScaling(factor=4.0, original_max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"rope_scaling=.*position_embedding_type='rope'"):
        preset(QWEN3, position_embedding_type="none", rope_scaling=scaling)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(rotary_percent=0.5), r"rotary_percent=0.5 is not supported with mla"),
        (dict(position_embedding_type="none"), r"position_embedding_type='none' .*with mla"),
        (dict(attention_output_gate=True), r"attention_output_gate=True .*with mla"),
    ],
)
def test_mla_refuses_options_it_does_not_implement(fields, expected):
    with pytest.raises(ValueError, match=expected):
        preset("tiny-deepseek-v3", **fields)


def test_mlp_bias_with_moe_is_refused():
    with pytest.raises(ValueError, match=r"add_mlp_bias=True is not supported with moe"):
        preset("tiny-mixtral-8x7b", add_mlp_bias=True)


# ---- spec_for ------------------------------------------------------------------------------


def test_spec_for_derives_rotary_width_mlp_kind_and_no_table():
    assert spec_for(preset(QWEN3)).rotary.dim == 16
    assert spec_for(preset(QWEN3, rotary_percent=0.25)).rotary.dim == 4
    assert spec_for(preset(QWEN3, rotary_percent=0.5)).rotary.dim == 8
    assert spec_for(preset(QWEN3, position_embedding_type="none")).rotary is None
    relu2 = preset(QWEN3, mlp_activation="relu2", num_layers=3)
    assert [s.mlp for s in spec_for(relu2).layers] == ["relu2"] * 3
    model = GPTModel(relu2, device="meta")
    assert all(isinstance(layer.mlp, SquaredReLUMLP) for layer in model.decoder.layers)
    with_mtp = GPTModel(relu2.replace(mtp=MTPConfig(num_layers=1)), device="meta")
    assert isinstance(with_mtp.mtp.layers[0].transformer_layer.mlp, SquaredReLUMLP)


def test_spec_without_rotary_table_is_refused_for_rotating_attention():
    cfg = preset(QWEN3)
    spec = DecoderSpec(layers=(LayerSpec(),) * cfg.num_layers, rotary=None)
    with pytest.raises(ValueError, match=r"DecoderSpec.rotary=None .*\['attention'\]"):
        GPTModel(cfg, spec=spec, device="meta")


# ---- zero-centred RMSNorm across the model -------------------------------------------------


def _loss_and_grads(cfg):
    model = GPTModel(cfg)
    ids, labels = random_batch(cfg.vocab_size, seq=12, seed=4)
    loss, n = model(ids, labels=labels)
    (loss / n).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return model, loss, grads


def test_zero_centered_gamma_reaches_every_rmsnorm_and_starts_as_the_plain_model():
    """DeepSeek-V3's twin has every kind of RMSNorm (layer, final, MLA latent, MTP)."""
    plain_cfg = preset("tiny-deepseek-v3", params_dtype=torch.float64)
    zc_model, zc_loss, zc_grads = _loss_and_grads(
        plain_cfg.replace(layernorm_zero_centered_gamma=True)
    )
    norms = [m for m in zc_model.modules() if isinstance(m, RMSNorm)]
    # 3 layers x (2 pre-norms + 2 MLA latent norms) + final norm + 1 MTP depth x (enorm, hnorm,
    # its layer's 4 norms, final_layernorm)
    assert len(norms) == 3 * 4 + 1 + 7
    for norm in norms:
        assert norm.zero_centered_gamma
        assert torch.equal(norm.weight, torch.zeros_like(norm.weight))  # 1 + w = 1
    plain_model, plain_loss, plain_grads = _loss_and_grads(plain_cfg)
    assert not any(m.zero_centered_gamma for m in plain_model.modules() if isinstance(m, RMSNorm))
    # x̂·(1 + 0) and x̂·1 are the same floats, and d/dw of both scales is x̂·dy.
    assert torch.equal(zc_loss, plain_loss)
    assert zc_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.equal(zc_grads[name], grad), name


def test_zero_centered_qk_norm_is_zero_centered():
    model = GPTModel(preset(QWEN3, layernorm_zero_centered_gamma=True), device="meta")
    attn = model.decoder.layers[0].self_attention
    assert attn.q_layernorm.zero_centered_gamma and attn.k_layernorm.zero_centered_gamma


# ---- the gate block ------------------------------------------------------------------------


def test_gate_block_leaves_q_k_v_keys_and_values_unchanged():
    plain = full_state_dict(GPTModel(preset(QWEN3)))
    gated = full_state_dict(GPTModel(preset(QWEN3, attention_output_gate=True)))
    prefix = "decoder.layers.{}.self_attention.linear_qkv.weight."
    assert set(gated) - set(plain) == {prefix.format(i) + "gate" for i in range(2)}
    for key, value in plain.items():
        assert torch.equal(gated[key], value), key
    gate = gated[prefix.format(0) + "gate"]
    assert gate.shape == (4 * 16, 64)
    # Its own random draw (not a copy of Q), at the model's init std 0.02.
    assert not torch.equal(gate, gated[prefix.format(0) + "q"])
    assert 0.015 < float(gate.std()) < 0.025


def _hf_q_proj_by_loop(q, gate, num_heads, head_dim):
    """Qwen3-Next's q_proj written head by head: rows [q_j ; gate_j] for j = 0, 1, ..."""
    rows = []
    for j in range(num_heads):
        rows += [q[j * head_dim : (j + 1) * head_dim], gate[j * head_dim : (j + 1) * head_dim]]
    return torch.cat(rows)


@pytest.mark.parametrize("shape", [(12,), (12, 10)], ids=["bias", "weight"])
def test_q_proj_conversion_matches_head_by_head_layout(shape):
    gen = torch.Generator().manual_seed(2)
    heads, d = 3, 4
    q = torch.randn((heads * d, *shape[1:]), generator=gen)
    gate = torch.randn((heads * d, *shape[1:]), generator=gen)
    merged = merge_gated_q_proj(q, gate, num_heads=heads, head_dim=d)
    assert torch.equal(merged, _hf_q_proj_by_loop(q, gate, heads, d))
    back_q, back_gate = split_gated_q_proj(merged, num_heads=heads, head_dim=d)
    assert torch.equal(back_q, q) and torch.equal(back_gate, gate)
    # Heads 1..2 alone: rows [2·d, 6·d) of q_proj split into those heads' rows of q and gate.
    part_q, part_gate = split_gated_q_proj(merged[2 * d :], num_heads=2, head_dim=d)
    assert torch.equal(part_q, q[d:]) and torch.equal(part_gate, gate[d:])


def test_q_proj_conversion_refuses_wrong_shapes():
    with pytest.raises(ValueError, match=r"q_proj.shape=\(20, 8\) is invalid: it must be \[24\]"):
        split_gated_q_proj(torch.randn(20, 8), num_heads=3, head_dim=4)
    with pytest.raises(
        ValueError, match=r"q.shape=\(12, 8\) and gate.shape=\(12, 7\) must be equal"
    ):
        merge_gated_q_proj(torch.randn(12, 8), torch.randn(12, 7), num_heads=3, head_dim=4)


# ---- TP=2 and TP=2+SP against world 1 ------------------------------------------------------

_LAYOUT_CASES = [
    # Qwen3-Next's attention: gate, a quarter of each head rotated, zero-centred norms.
    dict(
        attention_output_gate=True,
        rotary_percent=0.25,
        layernorm_zero_centered_gamma=True,
        add_mlp_bias=True,
        sequence_parallel=True,
    ),
    dict(attention_output_gate=True, rotary_percent=0.5, recompute="selective"),
    # Nemotron-H's attention and MLP: no RoPE, squared ReLU.
    dict(position_embedding_type="none", mlp_activation="relu2", qk_layernorm=False),
    dict(
        position_embedding_type="none",
        mlp_activation="relu2",
        add_mlp_bias=True,
        qk_layernorm=False,
        sequence_parallel=True,
    ),
]


def _compare_cases():
    losses = [compare_with_single_rank(QWEN3, tp=2, **case) for case in _LAYOUT_CASES]
    # Context parallel: queries keep their own gate rows and rotate at their global positions.
    gated = dict(attention_output_gate=True, rotary_percent=0.25)
    return [*losses, compare_with_single_rank(QWEN3, cp=2, **gated)]


@pytest.mark.multirank
def test_layer_options_tp2_and_sp_match_single_rank():
    """Loss and every parameter's full gradient at TP=2 (±SP) and CP=2 equal world size 1
    (fp64)."""
    losses = run_on_ranks(_compare_cases, 2)
    assert losses[0] == losses[1]


# ---- Hugging Face families without the options ---------------------------------------------


@pytest.mark.parametrize(
    ("name", "over"),
    [
        (QWEN3, dict(attention_output_gate=True)),
        ("tiny-llama3-8b", dict(mlp_activation="relu2")),
        ("tiny-llama3-8b", dict(position_embedding_type="none")),
        ("tiny-qwen2.5-7b", dict(rotary_percent=0.5)),
        ("tiny-qwen3-30b-a3b", dict(layernorm_zero_centered_gamma=True)),
        ("tiny-llama3.2-1b", dict(add_mlp_bias=True)),
        ("tiny-deepseek-v3", dict(layernorm_zero_centered_gamma=True)),
    ],
)
def test_existing_hf_adapters_do_not_claim_layer_options(name, over):
    """A Llama/Qwen/MoE/DeepSeek export of such a model would silently drop the option."""
    assert adapter_for_config(preset(name)) is not None  # the plain model exports
    ((field, value),) = over.items()
    with pytest.raises(ValueError, match=rf"{field}={value!r}.*claimed by: none"):
        adapter_for_config(preset(name, **over))
