"""Every plain ``bool`` / ``int`` / ``float`` field of the model configs refuses a value of
another type, naming the class, the field and the value (``"False"`` from a TOML file or a
dict is truthy: before this check ``tie_word_embeddings="False"`` built the tied model)."""

import dataclasses
import re

import pytest

from shardwork.models import (
    GatedDeltaNetConfig,
    GPTConfig,
    LoRAConfig,
    MambaConfig,
    MLAConfig,
    MoEConfig,
    MTPConfig,
    preset,
)
from shardwork.moe_router import RouterConfig

GPT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=250)
CONFIGS = {
    GPTConfig: GPT,
    MoEConfig: dict(router=RouterConfig(num_experts=4, hidden_size=64), ffn_hidden_size=32),
    MLAConfig: dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    MTPConfig: {},
    MambaConfig: dict(num_heads=4, head_dim=16, state_size=8, num_groups=2, chunk_size=8),
    GatedDeltaNetConfig: dict(
        num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, chunk_size=4
    ),
    LoRAConfig: {},
}


def _fields_with_default_of(cls, kind):
    """Fields whose default is a ``kind`` (bool is not an int here)."""
    names = []
    for field in dataclasses.fields(cls):
        default = field.default
        if isinstance(default, bool) != (kind is bool):
            continue
        if isinstance(default, kind):
            names.append(field.name)
    return names


WRONG = {bool: ["False", 0, 1.0], int: ["8", True, 8.0], float: ["1e-5", True]}
CASES = [
    pytest.param(cls, name, value, id=f"{cls.__name__}.{name}={value!r}")
    for cls in CONFIGS
    for kind, values in WRONG.items()
    for name in _fields_with_default_of(cls, kind)
    for value in values
]


def test_every_config_has_typed_fields_to_check():
    """The parametrisation below is not empty for the configs that have such fields."""
    counted = {cls.__name__: sum(c.values[0] is cls for c in CASES) for cls in CONFIGS}
    assert counted["GPTConfig"] >= 30
    assert all(counted[name] > 0 for name in ("MambaConfig", "LoRAConfig", "MTPConfig"))


@pytest.mark.parametrize(("cls", "name", "value"), CASES)
def test_a_wrong_type_is_refused_naming_the_field(cls, name, value):
    pattern = rf"{cls.__name__}\.{name}={re.escape(repr(value))} is invalid: it must be"
    with pytest.raises(ValueError, match=pattern):
        cls(**(CONFIGS[cls] | {name: value}))


@pytest.mark.parametrize(
    ("change", "wording"),
    [
        (dict(tie_word_embeddings="False"), "True or False"),
        (dict(qk_layernorm="no"), "True or False"),
        (dict(init_seed="1234"), "an integer"),
        (dict(init_seed=1.5), "an integer"),
        (dict(norm_epsilon="1e-5"), "a number"),
        (dict(num_query_groups="2"), "an integer or None"),
    ],
)
def test_values_the_audit_found_accepted(change, wording):
    """The cases found accepted (or failing inside a comparison) before this check."""
    name = next(iter(change))
    with pytest.raises(ValueError, match=rf"GPTConfig\.{name}=.* it must be {wording}"):
        GPTConfig(**GPT, **change)


def test_numbers_of_the_right_kind_and_none_are_accepted():
    """An int where a float is expected, and None where the field is optional, still build."""
    config = GPTConfig(**GPT, rope_theta=10000, norm_epsilon=1, num_query_groups=None)
    assert (config.rope_theta, config.norm_epsilon, config.kv_heads) == (10000, 1, 4)
    assert preset("tiny-llama3-8b", init_method_std=1).init_method_std == 1
