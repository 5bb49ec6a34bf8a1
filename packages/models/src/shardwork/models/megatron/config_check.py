"""Check a GPTConfig against Megatron-LM's ``args`` stored in a checkpoint's ``common.pt``.

The importer takes the architecture from the user (a preset plus changes, or a trainer model
section); when the checkpoint records the arguments of the run that wrote it, a field that
disagrees is a mistake the user should hear about before any weight is read into a model of
the wrong shape. Only fields that change tensor shapes or the forward pass are compared.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig

__all__ = ["check_against_args"]


def _ours(config: GPTConfig) -> dict[str, Any]:
    """Megatron-LM argument name -> this config's value."""
    out: dict[str, Any] = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
        "num_query_groups": config.num_query_groups or config.num_attention_heads,
        "kv_channels": config.head_dim or config.hidden_size // config.num_attention_heads,
        "norm_epsilon": config.norm_epsilon,
        "rotary_base": config.rope_theta,
        "qk_layernorm": config.qk_layernorm,
        "untie_embeddings_and_output_weights": not config.tie_word_embeddings,
        "num_experts": None if config.moe is None else config.moe.router.num_experts,
    }
    if config.moe is not None:
        out["moe_router_topk"] = config.moe.router.top_k
        out["moe_ffn_hidden_size"] = config.moe.ffn_hidden_size
    return out


def _theirs(args: dict[str, Any], name: str) -> Any:
    value = args.get(name)
    if name == "num_query_groups" and not args.get("group_query_attention", True):
        return args.get("num_attention_heads")  # Megatron-LM ignores the field without GQA
    return value


def check_against_args(config: GPTConfig, args: dict[str, Any], source: str) -> None:
    """Raise ValueError naming every field where ``config`` and Megatron's ``args`` differ."""
    problems = []
    for name, ours in _ours(config).items():
        if name not in args:
            continue
        theirs = _theirs(args, name)
        if theirs is None and name not in ("num_experts",):
            continue  # Megatron-LM derives unset sizes (ffn_hidden_size, kv_channels)
        same = (
            abs(float(theirs) - float(ours)) <= 1e-12 * max(1.0, abs(float(ours)))
            if isinstance(ours, float) and theirs is not None
            else theirs == ours
        )
        if not same:
            problems.append(f"{name}: checkpoint args {theirs!r}, config {ours!r}")
    if problems:
        raise ValueError(
            f"{source} was written with different model arguments than the given config: "
            + "; ".join(problems)
        )
