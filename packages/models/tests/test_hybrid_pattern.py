"""Hybrid layer patterns: parsing, validation, and the single-part layers they build.

A pattern that alternates attention and MLP characters (``"*-*-"``) computes exactly what the
ordinary two-layer model computes (each ordinary layer is the pattern's pair: the same norms,
the same residual adds, in the same order), so the ordinary model, tested against
transformers elsewhere, is the oracle here: its weights are copied into the pattern model by
a key map written in the test, and logits, loss and gradients must agree bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch

from shardwork.models import GPTConfig, GPTModel, LayerSpec, MTPConfig, spec_for
from shardwork.models.families.twins import tiny_moe
from shardwork.models.hybrid_pattern import parse_hybrid_pattern
from shardwork.models.testing import random_batch


def _dense(**changes):
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        vocab_size=96,
        params_dtype=torch.float64,
    )
    return GPTConfig(**(base | changes))


def _moe(**changes):
    return tiny_moe(router=dict(hidden_size=32), **changes)


def _pattern_key(key: str) -> str:
    """Ordinary layer ``i``'s key -> the pattern model's key (mixer in ``2i``, MLP in ``2i+1``;
    MTP depths keep their layer)."""
    match = re.match(
        r"decoder\.layers\.(\d+)\.(input_layernorm|self_attention|pre_mlp_layernorm|mlp)(.*)", key
    )
    if match is None:
        return key
    layer, part, rest = int(match[1]), match[2], match[3]
    index = 2 * layer + (part in ("pre_mlp_layernorm", "mlp"))
    return f"decoder.layers.{index}.{part}{rest}"


def _copy_into(pattern_model: GPTModel, ordinary: GPTModel) -> None:
    source = dict(ordinary.named_parameters())
    mapped = {_pattern_key(name): p for name, p in source.items()}
    target = dict(pattern_model.named_parameters())
    assert set(mapped) == set(target)  # the map covers every parameter, both ways
    with torch.no_grad():
        for name, param in target.items():
            param.copy_(mapped[name])


@pytest.mark.parametrize(
    ("pattern", "ordinary"),
    [
        ("*-*-", lambda: _dense()),
        ("*E*E/*E", lambda: _dense(moe=_moe(), mtp=MTPConfig())),
    ],
    ids=["dense", "moe+mtp"],
)
def test_alternating_pattern_equals_the_ordinary_model(pattern, ordinary):
    base = ordinary()
    cfg = base.replace(num_layers=2 * base.num_layers, hybrid_layer_pattern=pattern)
    reference, model = GPTModel(base), GPTModel(cfg)
    _copy_into(model, reference)
    assert [(s.mixer, s.mlp) for s in model.spec.layers[:2]] == [
        ("attention", None),
        (None, "moe" if pattern[1] == "E" else "dense"),
    ]
    ids, labels = random_batch(base.vocab_size, seq=12, seed=4)
    assert torch.equal(model(ids), reference(ids))
    loss, tokens = model(ids, labels=labels)
    ref_loss, ref_tokens = reference(ids, labels=labels)
    assert int(tokens) == int(ref_tokens)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    ref_grads = {_pattern_key(n): p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, ref_grads[name]), name


def test_pattern_builds_only_the_parts_it_names():
    cfg = _dense(num_layers=3, moe=_moe(), hybrid_layer_pattern="-*E")
    layers = GPTModel(cfg).decoder.layers
    kinds = [(type(x.self_attention).__name__, type(x.mlp).__name__) for x in layers]
    assert kinds == [("NoneType", "SwiGLUMLP"), ("Attention", "NoneType"), ("NoneType", "MoELayer")]
    assert layers[0].input_layernorm is None and layers[1].pre_mlp_layernorm is None
    keys = {k.split(".")[3] for k, _, _ in GPTModel(cfg).named_param_keys() if ".layers." in k}
    assert keys == {"input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"}


def test_parse_splits_decoder_and_equal_mtp_depths():
    parsed = parse_hybrid_pattern("M-M*-E/*E/*E")
    assert (parsed.decoder, parsed.mtp) == ("M-M*-E", ("*E", "*E"))
    assert parsed.symbols == {"M", "-", "*", "E"}
    spec = spec_for(_dense(moe=_moe(), hybrid_layer_pattern="E*/*", mtp=MTPConfig()))
    assert spec.mtp == (LayerSpec("attention", None),)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(hybrid_layer_pattern="*x"), r"'x' is not a layer symbol"),
        (dict(hybrid_layer_pattern=""), r"non-empty string"),
        (dict(hybrid_layer_pattern="/*"), r"no decoder layers"),
        (dict(hybrid_layer_pattern="*-*"), r"has 3 decoder layers but num_layers=2"),
        (dict(hybrid_layer_pattern="*-/*"), r"1 MTP depths but mtp.num_layers=0"),
        (dict(hybrid_layer_pattern="*-/*-/-*", mtp=MTPConfig(num_layers=2)), r"same layer"),
        (dict(hybrid_layer_pattern="*-/*-*", mtp=MTPConfig()), r"must be one layer"),
        (dict(hybrid_layer_pattern="*E"), r"uses 'E', which needs GPTConfig.moe=MoEConfig"),
        (dict(hybrid_layer_pattern="M-"), r"uses 'M', which needs GPTConfig.mamba=MambaConfig"),
        (dict(hybrid_layer_pattern="G-"), r"'G', which needs GPTConfig.linear_attention="),
    ],
)
def test_bad_patterns_are_named(changes, message):
    with pytest.raises(ValueError, match="hybrid_layer_pattern=.*" + message):
        _dense(**changes)


def test_moe_placement_fields_conflict_with_a_pattern():
    with pytest.raises(ValueError, match=r"moe.first_k_dense_replace=1 .* must keep"):
        _dense(moe=_moe(first_k_dense_replace=1), hybrid_layer_pattern="*E")
    with pytest.raises(ValueError, match=r"needs a part"):
        LayerSpec(None, None)
