"""The safetensors files of a Hugging Face checkpoint folder: which file holds a tensor, and
writing tensors as one file or as size-capped shards with an index.

Shared by the dense (:mod:`~shardwork.models.hf.checkpoint`) and MoE
(:mod:`~shardwork.models.hf.moe_weights`) import/export, which differ in tensor names only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["weight_files", "write_safetensors"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def weight_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it."""
    index = folder / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / _SINGLE
    if not single.is_file():
        raise ValueError(f"{folder!s} holds neither {_INDEX} nor {_SINGLE}")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """Write HF-keyed ``tensors`` into ``folder`` in key order: one ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` each (a larger
    tensor gets a file of its own) plus the ``model.safetensors.index.json`` weight map."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = _shard(dict(sorted(tensors.items())), max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / _SINGLE), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / _INDEX).write_text(json.dumps(index, indent=2))
