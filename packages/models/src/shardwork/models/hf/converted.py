"""Weight import/export of the ``converted`` layout (hybrid families: Nemotron-H, Qwen3-Next).

Their Hugging Face checkpoints fuse several shardwork keys into one tensor in a
family-specific order (a Mamba mixer's ``in_proj`` rows ``[z | x | B | C | dt]``, a Gated
DeltaNet's ``in_proj_qkvz`` interleaved per key-head group, a gated ``q_proj`` interleaving
query and gate rows per head), so a rank's slice of a shardwork key is not a slice of one HF
tensor. Import therefore reads whole tensors, of the decoder layers this stage holds only
(plus the embedding, final norm and head), and lets the adapter's ``convert_from_hf``
translate the fused ones; every other key is one HF tensor named by the key rules. Each rank
then copies its own slice of every global tensor. Export assembles the full state
(:func:`~shardwork.models.full_state.full_state_dict`), converts the fused keys back with
``convert_to_hf`` and names the rest by the rules.

Reading a stage's whole tensors costs its unsharded size in host memory, once per rank: the
models these families come in (4B-80B) load on a host that holds one stage's full weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from shardwork.models.full_state import full_state_dict
from shardwork.models.hf.files import weight_files
from shardwork.models.hf.keys import to_hf_key
from shardwork.models.hf.registry import adapter_for_config
from shardwork.models.lora import is_base_key
from shardwork.models.moe.state import moe_routers

__all__ = ["converted_hf_state_dict", "load_converted_state_dict", "load_converted_weights"]

_DECODER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def _hf_layer(name: str, prefix: str) -> int | None:
    match = re.match(re.escape(prefix) + r"\.(\d+)\.", name)
    return None if match is None else int(match[1])


def _read(folder: Path, prefix: str, layers: set[int]) -> dict[str, torch.Tensor]:
    """Whole HF tensors of decoder layers ``layers`` and of everything outside layers."""
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_files(folder).items():
        layer = _hf_layer(name, prefix)
        if layer is None or layer in layers:
            by_file.setdefault(path, []).append(name)
    out = {}
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in names})
    return out


def _stage_layers(local: dict) -> set[int]:
    """Global decoder layers among the keys of a stage's sharded state dict."""
    return {int(m[1]) for key in local if (m := _DECODER_LAYER.match(key))}


def load_converted_state_dict(model, hf: dict[str, torch.Tensor], source: str = "state dict"):
    """Fill ``model``'s local shards from HF-named whole tensors ``hf`` (in place)."""
    return _fill(model, model.sharded_state_dict(), hf, source)


@torch.no_grad()
def _fill(model, local: dict, hf: dict[str, torch.Tensor], source: str):
    adapter = adapter_for_config(model.config)
    state = adapter.convert_from_hf(hf, model.config, _stage_layers(local))
    rules = adapter.key_rules()
    for key, st in local.items():
        tensor = state.get(key)
        if tensor is None:
            name = to_hf_key(key, rules)
            if name not in hf:
                raise ValueError(
                    f"{source} has no tensor {name!r} (for {key!r}); check "
                    "tie_word_embeddings and the model family"
                )
            tensor = hf[name]
        if tuple(tensor.shape) != tuple(st.global_shape):
            raise ValueError(
                f"{source}: {key!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(st.global_shape)}"
            )
        index = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.data.shape))
        st.data.copy_(tensor[index].to(st.data.dtype))
    for router in moe_routers(model):  # step counters are not in checkpoints (meta builds)
        router.reset_step_state()
    return model


def load_converted_weights(model, folder: str | Path):
    """Fill ``model``'s local shards from the HF checkpoint ``folder`` (in place)."""
    adapter = adapter_for_config(model.config)
    local = model.sharded_state_dict()
    hf = _read(Path(folder), adapter.hf_layer_prefix, _stage_layers(local))
    return _fill(model, local, hf, str(folder))


def converted_hf_state_dict(model, *, group=None, dtype=None) -> dict[str, torch.Tensor]:
    """HF-named full tensors of ``model`` (every rank and stage calls it)."""
    adapter = adapter_for_config(model.config)
    state = dict(full_state_dict(model, group=group, dtype=dtype, keys=is_base_key))
    out = adapter.convert_to_hf(state, model.config)  # pops the keys it converts
    rules = adapter.key_rules()
    out.update({to_hf_key(key, rules): tensor.contiguous() for key, tensor in state.items()})
    return out
