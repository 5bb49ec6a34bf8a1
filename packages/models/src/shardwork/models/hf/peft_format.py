"""The Hugging Face PEFT adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors``.

Tensor names are the ones ``PeftModel.save_pretrained`` writes for a causal LM:
``base_model.model.<HF module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]`` (the adapter name is not in the file). :func:`read_peft_folder` reads a folder and
refuses the PEFT options that change what an adapter computes beyond ``scaling * B A x``
(DoRA, adapter biases, per-module rank or alpha patterns, ``fan_in_fan_out``, extra trainable
modules): importing them as plain LoRA would give other logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "peft_key",
    "read_peft_folder",
    "write_peft_folder",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(re.escape(_PREFIX) + r"(.+)\.lora_(A|B)\.weight")

# PEFT LoraConfig fields whose non-default values this bridge cannot express, with the value
# that it can (None stands for "unset": None, {} or [] are all accepted)
_MUST_BE = {
    "peft_type": "LORA",
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "rank_pattern": None,
    "alpha_pattern": None,
    "modules_to_save": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
}


def peft_key(hf_module: str, factor: str) -> str:
    """The file's tensor name of ``factor`` (``"A"`` or ``"B"``) on HF module ``hf_module``."""
    return f"{_PREFIX}{hf_module}.lora_{factor}.weight"


def _check_config(cfg: dict[str, Any], path: Path) -> None:
    for name, valid in _MUST_BE.items():
        value = cfg.get(name, valid)
        unset = value in (None, {}, [], "")
        if (valid is None and not unset) or (valid is not None and value != valid):
            shown = "unset (null, {} or [])" if valid is None else repr(valid)
            raise ValueError(
                f"{path}: {name}={value!r} is not supported for import into shardwork LoRA; "
                f"valid: {shown}"
            )
    for name in ("r", "lora_alpha"):
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{path}: {name}={value!r} is invalid; expected a positive number")


def read_peft_folder(
    folder: str | Path,
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``(adapter config dict, {HF module: {"A": tensor, "B": tensor}})`` of a PEFT folder.

    ValueError for a missing file, an unsupported option (:data:`_MUST_BE`), a tensor that is
    not a LoRA factor (embedding adapters, DoRA magnitudes, biases) or a module with only one of
    its two factors.
    """
    folder = Path(folder)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            extra = " (only safetensors adapters are read)" if path == weights_path else ""
            raise ValueError(
                f"{folder} is not a PEFT adapter folder: {path.name} is missing{extra}"
            )
    cfg = json.loads(config_path.read_text())
    _check_config(cfg, config_path)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(weights_path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = _KEY.fullmatch(name)
            if match is None:
                raise ValueError(
                    f"{weights_path}: tensor {name!r} is not a LoRA factor (expected "
                    f"'{_PREFIX}<module>.lora_A.weight' or '.lora_B.weight')"
                )
            modules.setdefault(match[1], {})[match[2]] = f.get_tensor(name)
    for module, factors in modules.items():
        if set(factors) != {"A", "B"}:
            raise ValueError(
                f"{weights_path}: module {module!r} has lora_{next(iter(factors))} only"
            )
    return cfg, modules


def write_peft_folder(
    folder: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """Write ``config`` as ``adapter_config.json`` and PEFT-named ``tensors`` as safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors sharing storage (the duplicated A of a fused block)
    owned = {name: t.detach().clone().contiguous() for name, t in sorted(tensors.items())}
    save_file(owned, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
