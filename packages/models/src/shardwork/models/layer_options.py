"""Validation of the layer options (gated attention, partial or no RoPE, zero-centred RMSNorm,
squared-ReLU MLP, MLP biases; Megatron's classic GPT options: LayerNorm, learned absolute
positions, GELU MLP, output-projection bias; the Gemma options: GeGLU, scaled embeddings,
sandwich norms, soft-capping, ``query_pre_attn_scalar``, sliding-window layers and their own
RoPE base), called by ``GPTConfig.__post_init__``.

The options are plain ``GPTConfig`` fields (Megatron's names where Megatron has them); this
module checks their values and the combinations the model cannot build, so that a bad value
raises before anything is built. It reads the config by attribute and imports nothing of the
package (``config.py`` imports it).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "LAYER_OPTION_DEFAULTS",
    "MLP_ACTIVATIONS",
    "NORMALIZATIONS",
    "POSITION_EMBEDDING_TYPES",
    "check_layer_options",
    "is_sliding_window_layer",
    "non_default_layer_options",
]

POSITION_EMBEDDING_TYPES = ("rope", "none", "learned_absolute")
MLP_ACTIVATIONS = ("swiglu", "relu2", "geglu", "gelu_tanh")
NORMALIZATIONS = ("rmsnorm", "layernorm")
LAYER_OPTION_DEFAULTS = {
    "attention_output_gate": False,
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
    "layernorm_zero_centered_gamma": False,
    "mlp_activation": "swiglu",
    "add_mlp_bias": False,
    "scale_embedding": False,
    "sandwich_norm": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "sliding_window": None,
    "sliding_window_pattern": None,
    "rope_local_theta": None,
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
    if config.mlp_activation == "geglu" and config.moe is not None:
        raise ValueError(
            "GPTConfig.mlp_activation='geglu' is not supported with moe (experts compute SwiGLU "
            "or squared ReLU): valid are 'swiglu' or 'relu2'"
        )
    _check_gemma_options(config)


def _positive_number(name: str, value: Any, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(
            f"GPTConfig.{name}={value!r} is invalid: it must be None or a finite number > 0"
        )


def _check_gemma_options(config: Any) -> None:
    """Soft-caps, attention scale, sliding windows and the local RoPE base (see GPTConfig)."""
    _bool("scale_embedding", config.scale_embedding)
    _bool("sandwich_norm", config.sandwich_norm)
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        _positive_number(name, getattr(config, name))
    if config.scale_embedding and config.mtp is not None:
        raise ValueError(
            "GPTConfig.scale_embedding=True is not supported with mtp (the MTP depths embed "
            "tokens unscaled): valid is False"
        )
    if config.mla is not None:
        for name in ("attn_logit_softcapping", "query_pre_attn_scalar", "sliding_window"):
            if getattr(config, name) is not None:
                raise ValueError(
                    f"GPTConfig.{name}={getattr(config, name)!r} is not supported with mla "
                    "(multi-head latent attention): valid is None"
                )
    window = config.sliding_window
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(
            f"GPTConfig.sliding_window={window!r} is invalid: it must be None or an integer >= 1 "
            "(a query attends to keys less than sliding_window positions back)"
        )
    _check_window_pattern(config)
    local = config.rope_local_theta
    if local is not None:
        if isinstance(local, bool) or not isinstance(local, (int, float)) or not local > 1:
            raise ValueError(
                f"GPTConfig.rope_local_theta={local!r} is invalid: it must be None or a number > 1"
            )
        if window is None or config.position_embedding_type != "rope":
            raise ValueError(
                f"GPTConfig.rope_local_theta={local!r} needs sliding_window layers and "
                "position_embedding_type='rope': set rope_local_theta=None"
            )


def _check_window_pattern(config: Any) -> None:
    pattern, field = config.sliding_window_pattern, "GPTConfig.sliding_window_pattern"
    if pattern is None:
        return
    if config.sliding_window is None:
        raise ValueError(f"{field}={pattern!r} needs sliding_window (an integer >= 1)")
    if isinstance(pattern, tuple):
        if len(pattern) != config.num_layers or any(v not in (0, 1) for v in pattern):
            raise ValueError(
                f"{field}={pattern!r} is invalid: a tuple needs one 1 (sliding) or 0 (global) "
                f"per layer (num_layers={config.num_layers})"
            )
    elif isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(
            f"{field}={pattern!r} is invalid: None (every layer sliding), an integer n >= 1 "
            "(n - 1 sliding layers then one global, repeating) or a tuple of 0/1 per layer"
        )


def is_sliding_window_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` attends through ``config.sliding_window`` (MTP depths,
    ``layer >= num_layers``, never do)."""
    if config.sliding_window is None or layer >= config.num_layers:
        return False
    pattern = config.sliding_window_pattern
    if pattern is None:
        return True
    if isinstance(pattern, tuple):
        return bool(pattern[layer])
    return (layer + 1) % pattern != 0


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
