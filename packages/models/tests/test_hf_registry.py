"""The Hugging Face adapter registry: a made-up ``model_type`` registered here round-trips a
tiny config and its weights through the generic bridge (names and values checked against a
mapping written in this file), and the unknown-type error lists exactly the registry's keys,
which are exactly the families' ``HF_MODEL_TYPES``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from shardwork.models import GPTModel
from shardwork.models.families import FAMILIES
from shardwork.models.hf import (
    HFAdapter,
    adapter_for_config,
    from_pretrained,
    gpt_config_from_hf,
    register_adapter,
    registry,
    save_pretrained,
)

#: A made-up family: dense attention with both a QKV bias and QK-norm (no built-in adapter
#: claims that combination), its own config field names and its own q/k/v and gate/up names.
TOY_HF = {
    "model_type": "toyqk",
    "n_layer": 2,
    "d_model": 64,
    "n_head": 4,
    "n_kv_head": 2,
    "d_ff": 96,
    "n_vocab": 250,
}


def _toy_from_hf(hf):
    return dict(
        num_layers=hf["n_layer"],
        hidden_size=hf["d_model"],
        num_attention_heads=hf["n_head"],
        num_query_groups=hf["n_kv_head"],
        ffn_hidden_size=hf["d_ff"],
        vocab_size=hf["n_vocab"],
        qk_layernorm=True,
        add_qkv_bias=True,
    )


def _toy_to_hf(config):
    return {
        "n_layer": config.num_layers,
        "d_model": config.hidden_size,
        "n_head": config.num_attention_heads,
        "n_kv_head": config.num_query_groups,
        "d_ff": config.ffn_hidden_size,
        "n_vocab": config.vocab_size,
    }


TOY = HFAdapter(
    model_type="toyqk",
    architecture="ToyQKForCausalLM",
    fields_from_hf=_toy_from_hf,
    fields_to_hf=_toy_to_hf,
    claims=lambda c: c.moe is None and c.qk_layernorm and c.add_qkv_bias,
    layer_rules=(
        (r"self_attention\.linear_qkv\.(weight|bias)\.(q|k|v)", r"attn.\2.\1"),
        (r"mlp\.fc1\.weight\.(gate|up)", r"ffn.\1"),
    ),
)

#: The HF name of every shardwork key of the toy model, written out by hand.
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_norm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_PER_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.fc1.weight.gate": "ffn.gate",
    "mlp.fc1.weight.up": "ffn.up",
    "mlp.fc2.weight": "mlp.down_proj.weight",
} | {
    f"self_attention.linear_qkv.{kind}.{p}": f"attn.{p}.{kind}"
    for kind in ("weight", "bias")
    for p in "qkv"
}


def _expected_name(key: str) -> str:
    if key in _TOP:
        return _TOP[key]
    layer, suffix = key.removeprefix("decoder.layers.").split(".", 1)
    return f"model.layers.{layer}.{_PER_LAYER[suffix]}"


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(registry, "ADAPTERS", dict(registry.ADAPTERS))
    register_adapter(TOY)
    return TOY


def test_made_up_model_type_round_trips_through_the_generic_bridge(toy_registered, tmp_path):
    config = gpt_config_from_hf(TOY_HF)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.num_query_groups, config.ffn_hidden_size, config.vocab_size) == (2, 96, 250)
    assert config.qk_layernorm and config.add_qkv_bias
    assert adapter_for_config(config) is TOY
    torch.manual_seed(0)
    model = GPTModel(config)
    with torch.no_grad():  # norms start at one: randomise them so a swapped name shows
        for p in model.parameters():
            p.normal_()
    save_pretrained(model, tmp_path)

    written = json.loads((tmp_path / "config.json").read_text())
    assert written == TOY_HF | {
        "architectures": ["ToyQKForCausalLM"],
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    tensors = load_file(tmp_path / "model.safetensors")
    original = {k: st.data.clone() for k, st in model.sharded_state_dict().items()}
    assert set(tensors) == {_expected_name(k) for k in original}
    for key, value in original.items():
        assert torch.equal(tensors[_expected_name(key)], value), key

    reloaded = from_pretrained(tmp_path)
    for key, st in reloaded.sharded_state_dict().items():
        assert torch.equal(st.data, original[key]), key


def test_register_adapter_refuses_a_taken_model_type(toy_registered):
    with pytest.raises(ValueError, match="model_type='toyqk' already has an adapter"):
        register_adapter(TOY)


def _listed_types(change: dict) -> list[str]:
    with pytest.raises(ValueError, match="model_type='gpt_neox' is not supported") as err:
        gpt_config_from_hf(TOY_HF | change)
    return str(err.value).split("valid: ", 1)[1].split(", ")


def test_unknown_model_type_error_lists_exactly_the_families_types():
    family_types = {t for family in FAMILIES for t in family.HF_MODEL_TYPES}
    assert {"llama", "qwen3", "mixtral", "deepseek_v3"} <= family_types  # dense and MoE
    assert _listed_types({"model_type": "gpt_neox"}) == sorted(family_types)
    assert set(registry.ADAPTERS) == family_types


def test_unknown_model_type_error_lists_a_registered_adapter(toy_registered):
    family_types = {t for family in FAMILIES for t in family.HF_MODEL_TYPES}
    assert _listed_types({"model_type": "gpt_neox"}) == sorted(family_types | {"toyqk"})


def test_config_no_adapter_claims_is_refused_by_export():
    config = gpt_config_from_hf(
        {"model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": 64}
        | {"num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 250},
        add_qkv_bias=True,
    )
    with pytest.raises(ValueError, match=r"no single Hugging Face model_type \(claimed by: none\)"):
        adapter_for_config(config)
