"""Validation of the layer options (gated attention, partial or no RoPE, zero-centred RMSNorm,
squared-ReLU MLP, MLP biases; Megatron's classic GPT options: LayerNorm, learned absolute
positions, GELU MLP, output-projection bias), called by ``GPTConfig.__post_init__``.

The options are plain ``GPTConfig`` fields (Megatron's names where Megatron has them); this
module checks their values and the combinations the model cannot build, so that a bad value
raises before anything is built. It reads the config by attribute and imports nothing of the
package (``config.py`` imports it).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "LAYER_OPTION_DEFAULTS",
    "MLP_ACTIVATIONS",
    "NORMALIZATIONS",
    "POSITION_EMBEDDING_TYPES",
    "check_layer_options",
    "non_default_layer_options",
]

POSITION_EMBEDDING_TYPES = ("rope", "none", "learned_absolute")
MLP_ACTIVATIONS = ("swiglu", "relu2", "gelu_tanh")
NORMALIZATIONS = ("rmsnorm", "layernorm")
LAYER_OPTION_DEFAULTS = {
    "attention_output_gate": False,
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "layernorm_zero_centered_gamma": False,
    "mlp_activation": "swiglu",
    "add_mlp_bias": False,
    "normalization": "rmsnorm",
    "add_proj_bias": False,
}
"""The options' values in a model without them (the Llama/Qwen/Mixtral/DeepSeek layers)."""


def non_default_layer_options(config: Any) -> dict[str, Any]:
    """The layer options ``config`` sets away from their defaults, by field name: a Hugging
    Face adapter of a family without them must not claim such a config."""
    return {
        name: getattr(config, name)
        for name, default in LAYER_OPTION_DEFAULTS.items()
        if getattr(config, name) != default
    }


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"GPTConfig.{name}={value!r} is invalid: it must be True or False")


def _check_rotary(config: Any) -> None:
    pct = config.rotary_percent
    if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < pct <= 1:
        raise ValueError(
            f"GPTConfig.rotary_percent={pct!r} is invalid: it must be a number in (0, 1]"
        )
    if config.position_embedding_type != "rope":
        if pct != 1:
            raise ValueError(
                f"GPTConfig.rotary_percent={pct} needs position_embedding_type='rope' (got "
                f"{config.position_embedding_type!r}): leave rotary_percent at 1.0"
            )
        if config.rope_scaling is not None:
            raise ValueError(
                f"GPTConfig.rope_scaling={config.rope_scaling!r} needs "
                f"position_embedding_type='rope' (got {config.position_embedding_type!r}): "
                "set rope_scaling=None"
            )
        return
    rot = config.rotary_dim
    if pct == 1 and rot % 2 != 0:
        raise ValueError(f"GPTConfig.head_dim={rot} is invalid: RoPE needs an even head_dim")
    if rot < 2 or rot % 2 != 0:
        raise ValueError(
            f"GPTConfig.rotary_percent={pct} is invalid with head_dim={config.kv_channels}: it "
            f"rotates int({pct}·{config.kv_channels})={rot} channels, RoPE needs an even "
            "number >= 2"
        )


def check_layer_options(config: Any) -> None:
    """Raise ``ValueError`` naming the field, the value and what is valid."""
    _bool("attention_output_gate", config.attention_output_gate)
    _bool("layernorm_zero_centered_gamma", config.layernorm_zero_centered_gamma)
    _bool("add_mlp_bias", config.add_mlp_bias)
    _bool("add_proj_bias", config.add_proj_bias)
    if config.normalization not in NORMALIZATIONS:
        raise ValueError(
            f"GPTConfig.normalization={config.normalization!r} is invalid: valid are "
            f"{NORMALIZATIONS}"
        )
    if config.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ValueError(
            f"GPTConfig.position_embedding_type={config.position_embedding_type!r} is invalid: "
            f"valid are {POSITION_EMBEDDING_TYPES}"
        )
    if config.mla is not None:
        # MLA rotates its own qk_rope_head_dim channels and has no output gate or bias.
        for name, default in (
            ("rotary_percent", 1.0),
            ("position_embedding_type", "rope"),
            ("attention_output_gate", False),
            ("add_proj_bias", False),
        ):
            if getattr(config, name) != default:
                raise ValueError(
                    f"GPTConfig.{name}={getattr(config, name)!r} is not supported with mla "
                    f"(multi-head latent attention): valid is {default!r}"
                )
    _check_rotary(config)
    if config.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(
            f"GPTConfig.mlp_activation={config.mlp_activation!r} is invalid: valid are "
            f"{MLP_ACTIVATIONS}"
        )
    _check_classic_gpt(config)
    if config.moe is not None and config.add_mlp_bias:
        raise ValueError(
            "GPTConfig.add_mlp_bias=True is not supported with moe (experts and shared experts "
            "have no biases): valid is False"
        )


def _check_classic_gpt(config: Any) -> None:
    """The parts Megatron's classic GPT options cannot be combined with: MoE experts have no
    GELU MLP, MTP depths embed without positions, and QK-norm, MLA's and MTP's norms are
    RMSNorms (every norm of a model is of one kind)."""
    if config.moe is not None and config.mlp_activation == "gelu_tanh":
        raise ValueError(
            "GPTConfig.mlp_activation='gelu_tanh' is not supported with moe (experts are "
            "'swiglu' or 'relu2'): valid with moe are 'swiglu', 'relu2'"
        )
    if config.position_embedding_type == "learned_absolute" and config.mtp is not None:
        raise ValueError(
            "GPTConfig.position_embedding_type='learned_absolute' is not supported with mtp "
            "(the MTP depths embed tokens without positions): valid with mtp are 'rope', 'none'"
        )
    if config.normalization == "layernorm":
        for name in ("qk_layernorm", "mla", "mtp"):
            value = getattr(config, name)
            if value not in (False, None):
                raise ValueError(
                    f"GPTConfig.normalization='layernorm' is not supported with {name} (its "
                    f"norms are RMSNorms): set normalization='rmsnorm' or {name} off"
                )
