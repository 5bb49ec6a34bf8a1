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

__all__ = ["check_weight_files", "weight_files", "write_safetensors"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def weight_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it; ValueError naming the file when the index is not
    JSON with a ``weight_map`` or the single file is not safetensors."""
    index = folder / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {str(name): folder / str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{index!s} is not a safetensors index ({type(exc).__name__}: {exc}); valid: "
                'JSON with a "weight_map" of tensor name -> file name'
            ) from None
    single = folder / _SINGLE
    if not single.is_file():
        raise ValueError(f"{folder!s} holds neither {_INDEX} nor {_SINGLE}")
    return dict.fromkeys(_tensor_names(single), single)


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in the header of the safetensors file ``path`` (no data is read)."""
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError)
        raise ValueError(f"{path!s} is not a readable safetensors file: {exc}") from None


def check_weight_files(folder: Path) -> None:
    """ValueError unless every weight file of ``folder`` has a readable safetensors header
    holding the tensors its index maps to it: a truncated download or a wrong file then
    stops a run before any process group exists, not when the weights are loaded."""
    files = weight_files(folder)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        if not path.is_file():
            raise ValueError(f"{path!s} (holding {names[0]!r} by the index) does not exist")
        held = set(_tensor_names(path))
        missing = [name for name in names if name not in held]
        if missing:
            raise ValueError(
                f"{path!s} lacks {len(missing)} tensor(s) its index maps to it, e.g. {missing[0]!r}"
            )


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
