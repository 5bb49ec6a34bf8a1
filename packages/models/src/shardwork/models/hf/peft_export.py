"""Export shardwork LoRA adapters as a Hugging Face PEFT folder that ``peft`` loads.

shardwork's fused ``linear_qkv`` (and ``fc1``) carries one ``A`` shared by its parts and one
``B`` per part; PEFT has one adapter per HF projection. Export writes per-projection adapters:
``q_proj``, ``k_proj`` and ``v_proj`` each get ``lora_A = A`` (duplicated) and ``lora_B`` =
that part's ``B``, so each projection adds ``scaling * B_q A x``, exactly the rows the fused
adapter adds. ``gate_proj`` / ``up_proj`` likewise. ``r``, ``lora_alpha``, ``use_rslora`` and
``lora_dropout`` carry over unchanged, so PEFT's scaling is shardwork's. Routed experts become
``target_parameters`` on transformers 5's fused expert parameters
(:mod:`~shardwork.models.hf.peft_experts`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.hf.peft_experts import expert_layers, experts_to_peft
from shardwork.models.hf.peft_format import peft_key, write_peft_folder
from shardwork.models.hf.peft_modules import (
    PeftLinear,
    is_routed_experts,
    peft_linears,
    weight_shapes,
)
from shardwork.models.lora_config import LoRAConfig, lora_key_names

__all__ = ["export_peft", "peft_adapter_config"]

_ADAPTER_KEY = re.compile(r"(.+)\.lora_(A|B)\.weight(?:\.(.+))?")


def _adapted_linears(
    full_adapters: dict[str, torch.Tensor], linears: dict[str, PeftLinear]
) -> tuple[list[PeftLinear], list[str]]:
    """The linears ``full_adapters`` adapts and its routed-expert keys; ValueError naming keys
    that fit no PEFT module."""
    prefixes, experts, unknown = set(), [], []
    for key in full_adapters:
        match = _ADAPTER_KEY.fullmatch(key)
        if match is None:
            unknown.append(key)
        elif is_routed_experts(match[1]):
            experts.append(key)
        elif match[1] not in linears:
            unknown.append(key)
        else:
            prefixes.add(match[1])
    if unknown:
        raise ValueError(
            f"adapter keys {sorted(unknown)[:4]} ({len(unknown)} keys) name no linear with a "
            f"PEFT counterpart; valid: '<module>.lora_A.weight' / '<module>.lora_B.weight[.part]' "
            f"of the model's {', '.join(sorted({x.leaf for x in linears.values()}))} modules "
            "and of routed experts"
        )
    return [linears[p] for p in linears if p in prefixes], experts  # model order


def _factors(
    full: dict[str, torch.Tensor], linear: PeftLinear, rank: int
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(HF module, A, B)`` per part of ``linear``, shapes checked against the model."""
    out = []
    for part, hf_module, rows in zip(linear.parts, linear.hf_modules, linear.out_sizes):
        a_key, b_key = lora_key_names(linear.base_key(part))
        for key, shape in ((a_key, (rank, linear.in_size)), (b_key, (rows, rank))):
            if key not in full:
                raise ValueError(f"full_adapters has no {key!r} (every part needs A and B)")
            if tuple(full[key].shape) != shape:
                raise ValueError(
                    f"full_adapters[{key!r}] has shape {tuple(full[key].shape)}, expected "
                    f"{shape} (LoRAConfig.rank={rank}, full unsharded tensors)"
                )
        out.append((hf_module, full[a_key], full[b_key]))
    return out


def peft_adapter_config(
    lora: LoRAConfig, target_modules: list[str], base_model_name_or_path: str | None
) -> dict:
    """The ``adapter_config.json`` fields of ``lora`` on HF modules ``target_modules``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.use_rslora,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
    }


def _target_modules(adapted: list[PeftLinear], linears: dict[str, PeftLinear]) -> list[str]:
    """HF leaf names (``q_proj``) when every such module is adapted, else full module names."""
    chosen = [m for x in adapted for m in x.hf_modules]
    leaves = list(dict.fromkeys(m.rsplit(".", 1)[-1] for m in chosen))
    every = [m for x in linears.values() for m in x.hf_modules if m.rsplit(".", 1)[-1] in leaves]
    return leaves if sorted(every) == sorted(chosen) else chosen


def export_peft(
    full_adapters: dict[str, torch.Tensor],
    lora: LoRAConfig,
    config: GPTConfig,
    folder: str | Path,
    *,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``full_adapters`` as a PEFT folder for the transformers model of ``config``.

    ``full_adapters``: full (unsharded) adapter tensors by shardwork key
    (:func:`~shardwork.models.lora_key_names`), as assembled on one host. Afterwards
    ``peft.PeftModel.from_pretrained(hf_model, folder)`` computes what shardwork's merged model
    computes. Every check runs before anything is written; ValueError for keys with no PEFT
    module, missing factors, wrong shapes, or dropout with routed-expert adapters (PEFT
    refuses dropout on parameter targets).
    """
    shapes = weight_shapes(config)
    linears = peft_linears(config, shapes)
    adapted, expert_keys = _adapted_linears(full_adapters, linears)
    if not adapted and not expert_keys:
        raise ValueError("full_adapters is empty: nothing to export")
    factors = {}
    for linear in adapted:
        for hf_module, a, b in _factors(full_adapters, linear, lora.rank):
            factors[hf_module] = (a, b)
    used = {k for x in adapted for p in x.parts for k in lora_key_names(x.base_key(p))}
    target_parameters = []
    if expert_keys:
        if lora.dropout:
            raise ValueError(
                f"LoRAConfig.dropout={lora.dropout} cannot be exported with routed-expert "
                "adapters: PEFT refuses dropout on parameter targets (target_parameters); "
                "export with dropout=0.0 (it only acts in training)"
            )
        expert_factors, target_parameters, expert_used = experts_to_peft(
            full_adapters, expert_layers(shapes), lora.rank
        )
        factors.update(expert_factors)
        used |= expert_used
    if extra := sorted(set(full_adapters) - used):
        raise ValueError(f"full_adapters has keys of no part of an adapted linear: {extra[:4]}")
    tensors = {}
    for module, (a, b) in factors.items():
        tensors[peft_key(module, "A")] = a if dtype is None else a.to(dtype)
        tensors[peft_key(module, "B")] = b if dtype is None else b.to(dtype)
    targets = _target_modules(adapted, linears)
    cfg = peft_adapter_config(lora, targets, base_model_name_or_path)
    if target_parameters:
        cfg["target_parameters"] = target_parameters
    write_peft_folder(folder, cfg, tensors)
