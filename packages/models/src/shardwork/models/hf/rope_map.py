"""RoPE fields between Hugging Face ``config.json`` and ``GPTConfig``, for every family (dense
and MoE): ``rope_theta`` and the linear / llama3 / YaRN ``rope_scaling`` in both directions.
"""

from __future__ import annotations

from typing import Any

from shardwork.fused_kernels import LinearRopeScaling, Llama3RopeScaling, YarnRopeScaling

__all__ = ["rope_from_hf", "rope_scaling_to_hf"]


def rope_from_hf(
    hf: dict[str, Any],
) -> tuple[float, Llama3RopeScaling | YarnRopeScaling | LinearRopeScaling | None]:
    """``(rope_theta, rope_scaling)`` of a HF config dict: 5.x ``rope_parameters`` or 4.x
    ``rope_theta`` + ``rope_scaling``; ``rope_type`` default, linear, llama3 or yarn."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params else None)
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), LinearRopeScaling(factor=float(scaling["factor"]))
    if kind == "llama3":
        return float(theta), Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        return float(theta), YarnRopeScaling(
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
            ),
            beta_fast=float(scaling.get("beta_fast", 32.0)),
            beta_slow=float(scaling.get("beta_slow", 1.0)),
            mscale=scaling.get("mscale"),
            mscale_all_dim=scaling.get("mscale_all_dim"),
            attention_factor_override=scaling.get("attention_factor"),
            truncate=bool(scaling.get("truncate", True)),
        )
    raise ValueError(
        f"rope_scaling rope_type={kind!r} is not supported; valid: 'default', 'linear', "
        "'llama3', 'yarn'"
    )


def rope_scaling_to_hf(scaling) -> dict[str, Any] | None:
    """The 4.x ``rope_scaling`` dict of a ``GPTConfig.rope_scaling`` (None: no scaling), which
    transformers 5.x reads too."""
    if scaling is None:
        return None
    if isinstance(scaling, LinearRopeScaling):
        return {"rope_type": "linear", "factor": scaling.factor}
    if isinstance(scaling, Llama3RopeScaling):
        return {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    out = {
        "rope_type": "yarn",
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "truncate": scaling.truncate,
    }
    for name in ("mscale", "mscale_all_dim"):
        if getattr(scaling, name) is not None:
            out[name] = getattr(scaling, name)
    if scaling.attention_factor_override is not None:
        out["attention_factor"] = scaling.attention_factor_override
    return out
