"""``LoRAConfig`` validation, scale and module matching; ``lora_key_names`` on every key shape.

The expected scales and names are written out here from the LoRA/rsLoRA definitions and the
naming rule in the module docstring, not computed by the code under test.
"""

from __future__ import annotations

import math
import re

import pytest

from shardwork.models import LoRAConfig, lora_key_names


@pytest.mark.parametrize(
    ("rank", "alpha", "rslora", "expected"),
    [(8, 16, False, 2.0), (8, 16, True, 16 / math.sqrt(8)), (3, 5.5, False, 5.5 / 3)],
)
def test_scaling_is_alpha_over_rank_or_its_root(rank, alpha, rslora, expected):
    assert LoRAConfig(rank=rank, alpha=alpha, use_rslora=rslora).scaling == expected


def test_suffix_targets_match_whole_name_components_only():
    lora = LoRAConfig(target_modules=["linear_qkv", "mlp.fc2"])
    assert lora.matches("decoder.layers.0.self_attention.linear_qkv")
    assert lora.matches("decoder.layers.11.mlp.fc2")
    assert lora.matches("linear_qkv")
    # A suffix must start at a dot: "fc2" inside "shared_experts.fc2" would match "fc2", but
    # "mlp.fc2" must not match "shared_mlp.fc2".
    assert not lora.matches("decoder.layers.0.shared_mlp.fc2")
    assert not lora.matches("decoder.layers.0.self_attention.linear_qkv_extra")
    assert isinstance(lora.target_modules, tuple)


def test_regex_target_must_match_the_whole_name():
    lora = LoRAConfig(target_modules=r"decoder\.layers\.[01]\..*linear_proj")
    assert lora.matches("decoder.layers.1.self_attention.linear_proj")
    assert not lora.matches("decoder.layers.2.self_attention.linear_proj")
    assert not lora.matches("mtp.decoder.layers.1.self_attention.linear_proj")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("rank", 0, "LoRAConfig.rank=0"),
        ("rank", True, "LoRAConfig.rank=True"),
        ("alpha", "16", "LoRAConfig.alpha='16'"),
        ("dropout", 1.0, "LoRAConfig.dropout=1.0"),
        ("target_modules", (), "LoRAConfig.target_modules=()"),
        ("target_modules", ("fc1", ""), "module-name suffixes"),
        ("target_modules", "linear_(qkv", "not a valid regular expression"),
    ],
)
def test_bad_values_name_the_field_and_value(field, value, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        LoRAConfig(**{field: value})


@pytest.mark.parametrize(
    ("base", "a_key", "b_key"),
    [
        ("output_layer.weight", "output_layer.lora_A.weight", "output_layer.lora_B.weight"),
        (
            "decoder.layers.2.self_attention.linear_qkv.weight.k",
            "decoder.layers.2.self_attention.linear_qkv.lora_A.weight",
            "decoder.layers.2.self_attention.linear_qkv.lora_B.weight.k",
        ),
        (
            "decoder.layers.1.mlp.experts.linear_fc1.weight.5.up",
            "decoder.layers.1.mlp.experts.linear_fc1.lora_A.weight.5",
            "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight.5.up",
        ),
        (
            "decoder.layers.1.mlp.experts.linear_fc2.weight.12",
            "decoder.layers.1.mlp.experts.linear_fc2.lora_A.weight.12",
            "decoder.layers.1.mlp.experts.linear_fc2.lora_B.weight.12",
        ),
    ],
)
def test_adapter_keys_follow_the_base_key(base, a_key, b_key):
    assert lora_key_names(base) == (a_key, b_key)


@pytest.mark.parametrize("bad", ["decoder.final_norm.bias", "output_layer.weights"])
def test_non_weight_keys_are_refused(bad):
    with pytest.raises(ValueError, match="is not a weight key"):
        lora_key_names(bad)
