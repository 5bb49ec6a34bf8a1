"""Which group-scoring rule a Hugging Face ``config.json`` implies.

Group-limited routing ranks expert groups by the sum of each group's n best scores, and
the sources disagree on n: Megatron-Core uses ``top_k // group_top_k``, transformers'
DeepSeek-V3 family always 2, DeepSeek-V2's ``group_limited_greedy`` the group maximum (1).
When ``top_k // group_top_k`` differs from the source's n, a router configured without
``RouterConfig.group_score_top_n`` picks other experts than the checkpoint was trained with.
The table below was read off transformers' modeling code (v5.x); ``kimi_k2`` (Kimi-K2's
``config.json``: remote code reusing the DeepSeek-V3 architecture) is listed with DeepSeek-V3.
Multimodal configs (Kimi-K2.5, GLM-4.5V) keep the language model's fields under
``text_config``, which is read when the top level has no ``n_group``.
"""

from __future__ import annotations

from collections.abc import Mapping

TOP2_MODEL_TYPES = (
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
    "kimi_linear",
    "glm4_moe",
    "glm4_moe_lite",
    "glm4v_moe_text",
    "glm_moe_dsa",
    "dots1",
    "exaone_moe",
    "mimo_v2_flash",
    "mistral4",
    "nemotron_h",
    "solar_open",
)
"""``model_type`` values whose router sums each group's top-2 scores."""


def _group_limited(hf_config: Mapping) -> bool:
    """Whether the config asks for group-limited routing (more than one group, some kept)."""
    n_group, topk_group = hf_config.get("n_group"), hf_config.get("topk_group")
    return n_group is not None and topk_group is not None and n_group > 1


def group_score_top_n_for_hf(hf_config: Mapping) -> int | None:
    """The ``RouterConfig.group_score_top_n`` that reproduces a Hugging Face model's routing.

    ``hf_config`` is the parsed ``config.json`` (or ``PretrainedConfig.to_dict()``). Returns
    None when the model does not limit routing to groups (no ``n_group``/``topk_group``, one
    group, or DeepSeek-V2's ``topk_method="greedy"``), 2 for the DeepSeek-V3 family
    (:data:`TOP2_MODEL_TYPES`), 1 for DeepSeek-V2's ``group_limited_greedy``. Raises
    ValueError for a group-limited ``model_type`` it does not know, rather than guess.
    """
    text_config = hf_config.get("text_config")
    if "n_group" not in hf_config and isinstance(text_config, Mapping):
        return group_score_top_n_for_hf(text_config)
    model_type = hf_config.get("model_type")
    if model_type == "deepseek_v2":
        method = hf_config.get("topk_method", "greedy")
        if method == "greedy":
            return None
        if method == "group_limited_greedy":
            return 1
        raise ValueError(
            f"hf_config topk_method={method!r} (model_type='deepseek_v2') is not known: "
            "expected 'greedy' or 'group_limited_greedy'"
        )
    if not _group_limited(hf_config):
        return None
    if model_type in TOP2_MODEL_TYPES:
        return 2
    raise ValueError(
        f"hf_config model_type={model_type!r} uses group-limited routing (n_group="
        f"{hf_config.get('n_group')}, topk_group={hf_config.get('topk_group')}) with a group "
        f"score rule this function does not know: known model types are "
        f"{('deepseek_v2', *TOP2_MODEL_TYPES)}; read the model's router and set "
        "RouterConfig.group_score_top_n yourself"
    )
