"""Weight import/export of the ``experts`` layout (Hugging Face MoE families, any
ep/etp/tp/pp layout); tensor names come from the model's adapter (``key_rules``, see
:mod:`shardwork.models.hf.moe_adapters`).

- MTP depths: DeepSeek's ``model.layers.<L+k>`` with ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.norm``, and, for adapters with ``mtp_copies``, copies of the shared
  ``embed_tokens`` / ``shared_head.head`` (:func:`mtp_shared_copies`; export writes them,
  import checks they equal the main embedding and head).
- Import reads each local ShardedTensor's slice from a *source*: a checkpoint folder (per-expert
  tensors as saved on disk, read with ``safe_open(...).get_slice``) or an in-memory state dict
  (e.g. a transformers 5 model's ``state_dict()``, whose experts are fused
  ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``). When the per-expert name is
  absent the fused tensor is sliced instead, so both layouts load at any layout.
- Export: :func:`moe_hf_state_dict` assembles full tensors (all ranks call it) with per-expert
  disk names, or with ``fused=True`` the transformers 5 in-memory names that
  ``model.load_state_dict`` takes; :func:`~shardwork.models.hf.checkpoint.save_pretrained`
  writes the per-expert names to a folder transformers' ``from_pretrained`` loads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shardwork.models.full_state import full_state_dict
from shardwork.models.hf.files import weight_files
from shardwork.models.hf.keys import to_hf_key
from shardwork.models.hf.registry import adapter_for_config
from shardwork.models.lora import is_base_key
from shardwork.models.moe.state import moe_routers

__all__ = [
    "hf_name",
    "load_hf_moe_state_dict",
    "load_hf_moe_weights",
    "moe_hf_state_dict",
    "mtp_shared_copies",
]


def _mtp_name(key: str, rules: list[tuple[str, str]], num_layers: int) -> str | None:
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", key)
    if m is None:
        return None
    layer, rest = num_layers + int(m.group(1)), m.group(2)
    fixed = {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight",
    }
    if rest in fixed:
        return f"model.layers.{layer}.{fixed[rest]}"
    inner = rest.removeprefix("transformer_layer.")
    return to_hf_key(f"decoder.layers.{layer}.{inner}", rules)


def mtp_shared_copies(config) -> dict[str, str]:
    """HF names of the per-depth copies of shared weights -> the main tensor they copy.

    DeepSeek-V3 checkpoints store MTP depth ``k`` as ``model.layers.<L+k-1>`` with its own
    ``embed_tokens.weight`` and ``shared_head.head.weight``, equal to ``model.embed_tokens`` and
    ``lm_head`` (DeepSeek-V3's README_WEIGHTS.md: the MTP module shares them). shardwork keeps
    one embedding and one head, so export writes these copies and import checks them.
    """
    if config.mtp is None or not adapter_for_config(config).mtp_copies:
        return {}
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    out = {}
    for k in range(config.mtp.num_layers):
        layer = f"model.layers.{config.num_layers + k}"
        out[f"{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"{layer}.shared_head.head.weight"] = head
    return out


def hf_name(key: str, rules: list[tuple[str, str]], num_layers: int) -> str:
    """The HF (disk) tensor name of shardwork checkpoint ``key`` under an adapter's ``rules``
    (MTP depths numbered after the ``num_layers`` main layers)."""
    mtp = _mtp_name(key, rules, num_layers)
    return mtp if mtp is not None else to_hf_key(key, rules)


_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)


def _fused(name: str) -> tuple[str, int, str] | None:
    """(fused in-memory name, expert, part) of a per-expert disk name, else None."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    layer, e, part = m.group(1), int(m.group(2)), m.group(3)
    part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(part, part)
    tensor = "down_proj" if part == "down_proj" else "gate_up_proj"
    return f"model.layers.{layer}.mlp.experts.{tensor}", e, part


def _memory_alias(name: str) -> str:
    """transformers 5 in-memory name of a (non-expert) disk name (Mixtral's router moved)."""
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


class _Source:
    """Tensors by HF name, read by slices: a folder (safetensors) or an in-memory dict."""

    def __init__(self, folder: Path | None = None, tensors: dict[str, torch.Tensor] | None = None):
        self.tensors = tensors
        self.files = weight_files(folder) if folder is not None else None
        self.handles: dict[Path, Any] = {}

    def close(self) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def names(self):
        return self.tensors.keys() if self.tensors is not None else self.files.keys()

    def has(self, name: str) -> bool:
        return name in self.names()

    def slice(self, name: str):
        if self.tensors is not None:
            return self.tensors[name]
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = safe_open(path, framework="pt").__enter__()
        return self.handles[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        piece = self.slice(name)
        return tuple(piece.shape) if isinstance(piece, torch.Tensor) else tuple(piece.get_shape())

    def read(self, name: str, index: tuple[slice, ...], expected: tuple[int, ...]) -> torch.Tensor:
        """``tensor[index]`` of HF tensor ``name`` whose (per-expert) global shape is ``expected``."""
        if self.has(name) or self.has(_memory_alias(name)):
            real = name if self.has(name) else _memory_alias(name)
            if self.shape(real) != expected:
                raise ValueError(f"{real!r} has shape {self.shape(real)}, expected {expected}")
            return self.slice(real)[index]
        fused = _fused(name)
        if fused is None or not self.has(fused[0]):
            raise ValueError(f"checkpoint has no tensor {name!r} (nor a fused expert tensor)")
        fname, e, part = fused
        if part == "down_proj":
            rows, cols = index
            return self.slice(fname)[e, rows, cols]
        rows, cols = index
        inter = self.shape(fname)[1] // 2
        offset = inter if part == "up_proj" else 0
        start = (rows.start or 0) + offset
        stop = (rows.stop if rows.stop is not None else inter) + offset
        return self.slice(fname)[e, start:stop, cols]


@torch.no_grad()
def _load(model, source: _Source) -> Any:
    cfg = model.config
    rules = adapter_for_config(cfg).key_rules()
    copies = mtp_shared_copies(cfg)
    try:
        for key, st in model.sharded_state_dict().items():
            name = hf_name(key, rules, cfg.num_layers)
            index = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.data.shape))
            st.data.copy_(source.read(name, index, tuple(st.global_shape)).to(st.data.dtype))
            for copy, main in copies.items():  # MTP copies of shared weights must be equal
                if main == name and source.has(copy):
                    got = source.read(copy, index, tuple(st.global_shape)).to(st.data.dtype)
                    if not torch.equal(got, st.data):
                        raise ValueError(
                            f"checkpoint tensor {copy!r} differs from {main!r}: shardwork's MTP "
                            "shares the main embedding and head, so the copies must be equal"
                        )
    finally:
        source.close()
    for router in moe_routers(model):  # step counters are not in checkpoints (meta builds)
        router.reset_step_state()
    return model


def load_hf_moe_weights(model, folder: str | Path) -> Any:
    """Fill ``model``'s local shards from an HF MoE checkpoint folder (per-expert or fused)."""
    return _load(model, _Source(folder=Path(folder)))


def load_hf_moe_state_dict(model, state_dict: dict[str, torch.Tensor]) -> Any:
    """Fill ``model``'s local shards from an HF state dict (e.g. transformers 5 in memory)."""
    return _load(model, _Source(tensors=state_dict))


def moe_hf_state_dict(
    model, *, fused: bool = False, group=None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Full HF tensors of ``model`` (every rank and stage calls it; every rank gets them).

    ``fused=False``: per-expert names as transformers saves them; ``fused=True``: the
    transformers 5 in-memory layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).
    """
    cfg = model.config
    rules = adapter_for_config(cfg).key_rules()
    full = full_state_dict(model, group=group, dtype=dtype, keys=is_base_key)
    out = {hf_name(k, rules, cfg.num_layers): v.contiguous() for k, v in full.items()}
    for copy, main in mtp_shared_copies(cfg).items():  # as DeepSeek-V3 checkpoints store them
        out[copy] = out[main].clone()  # own storage: safetensors refuses shared memory
    if not fused:
        return out
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    result = {}
    for name, t in out.items():
        info = _fused(name)
        if info is None:
            result[_memory_alias(name)] = t
            continue
        fname, e, part = info
        experts.setdefault(fname, {}).setdefault(e, {})[part] = t
    for fname, by_expert in experts.items():
        order = sorted(by_expert)
        if fname.endswith("down_proj"):
            result[fname] = torch.stack([by_expert[e]["down_proj"] for e in order])
        else:
            result[fname] = torch.stack(
                [torch.cat((by_expert[e]["gate_proj"], by_expert[e]["up_proj"])) for e in order]
            )
    return result
