"""shardwork weights -> a Megatron-Core ``torch_dist`` checkpoint folder (the reverse of
:mod:`.convert`), written at world 1 without a process group.

The folder holds what ``megatron.core.dist_checkpointing.save`` writes for a local- or
TE-spec ``GPTModel`` in its default (homogeneous) form: layer-stacked keys
(``decoder.layers.self_attention.linear_qkv.weight`` ``[L, ...]``), QKV interleaved per query
group, SwiGLU ``linear_fc1`` as ``[gate; up]``, SequentialMLP experts stacked
``[L, E, ...]`` under ``mlp.experts.experts.``, norms under the TE names (what the local spec's
key map writes too, MoE layers included) or, with ``te_names=False``, the local module names
(a spec without that map); an empty common state (``common_state``, which Megatron's loader
requires); plus
``metadata.json`` naming the ``torch_dist`` backend. Megatron loads it into a model of the same
architecture at any TP/PP/EP (tensors are in global coordinates).
"""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from shardwork.models.config import GPTConfig

__all__ = ["export_megatron"]

_TOP = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "decoder.final_norm.weight": "decoder.final_layernorm.weight",
    "output_layer.weight": "output_layer.weight",
}
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_SIMPLE = (
    "self_attention.linear_proj.weight",
    "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight",
    "mlp.router.weight",
    "mlp.router.expert_bias",
    "mlp.router.qb_beta",
)


def _qkv(layer: dict, part: str, config: GPTConfig) -> torch.Tensor:
    q, k, v = (layer[f"self_attention.linear_qkv.{part}.{x}"] for x in "qkv")
    groups = config.num_query_groups or config.num_attention_heads
    rest = q.shape[1:]
    # Per query group: its query heads, then its key head, then its value head.
    blocks = [x.reshape(groups, -1, *rest) for x in (q, k, v)]
    return torch.cat(blocks, dim=1).reshape(-1, *rest)


def _layer(layer: dict, config: GPTConfig, te_names: bool) -> dict[str, torch.Tensor]:
    """Megatron's per-layer tensors (names without ``decoder.layers.<i>.``) of one layer."""
    out: dict[str, torch.Tensor] = {}
    for name in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
        if name in layer:
            out[_TE_NAMES[name] if te_names else name] = layer[name]
    for part in ("weight", "bias"):
        if f"self_attention.linear_qkv.{part}.q" in layer:
            out[f"self_attention.linear_qkv.{part}"] = _qkv(layer, part, config)
    if "mlp.fc1.weight.gate" in layer:
        out["mlp.linear_fc1.weight"] = torch.cat(
            [layer["mlp.fc1.weight.gate"], layer["mlp.fc1.weight.up"]]
        )
        out["mlp.linear_fc2.weight"] = layer["mlp.fc2.weight"]
    out.update({name: layer[name] for name in _SIMPLE if name in layer})
    experts = sorted(
        {int(m[1]) for k in layer if (m := re.match(r"mlp\.experts\.linear_fc2\.weight\.(\d+)", k))}
    )
    if experts:
        fc1 = [
            torch.cat([layer[f"mlp.experts.linear_fc1.weight.{e}.{p}"] for p in ("gate", "up")])
            for e in experts
        ]
        out["mlp.experts.experts.linear_fc1.weight"] = torch.stack(fc1)
        fc2 = [layer[f"mlp.experts.linear_fc2.weight.{e}"] for e in experts]
        out["mlp.experts.experts.linear_fc2.weight"] = torch.stack(fc2)
    return out


def export_megatron(
    state: dict[str, torch.Tensor], config: GPTConfig, dst: str | Path, *, te_names: bool = True
) -> None:
    """Write ``{shardwork key: full tensor}`` (e.g. :func:`~.convert.megatron_state_dict` or
    ``full_state_dict(model)``) as a Megatron-Core ``torch_dist`` folder ``dst`` (new/empty)."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"destination {str(dst)!r} exists and is not empty")
    layers: list[dict] = [{} for _ in range(config.num_layers)]
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key in _TOP:
            out[_TOP[key]] = tensor
        elif m := re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key):
            layers[int(m[1])][m[2]] = tensor
        else:
            raise ValueError(f"no Megatron-Core name for {key!r}")
    per_layer = [_layer(layer, config, te_names) for layer in layers]
    for name in per_layer[0]:
        out[f"decoder.layers.{name}"] = torch.stack([layer[name] for layer in per_layer])
    # Megatron's loader reads the common (non-sharded) state from this object: a one-item list.
    common = io.BytesIO()
    torch.save([{}], common)
    out["common_state/shard_0_1"] = common
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {k: v.contiguous() if torch.is_tensor(v) else v for k, v in out.items()},
            storage_writer=dcp.FileSystemWriter(str(dst)),
            no_dist=True,
        )
    backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    (dst / "metadata.json").write_text(json.dumps(backend))
