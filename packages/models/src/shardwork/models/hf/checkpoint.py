"""Import a Hugging Face checkpoint folder into a GPTModel at any layout; export one back.

- The model's adapter (:func:`~shardwork.models.hf.registry.adapter_for_config`) gives the
  tensor names and the weight layout (``dense`` here, ``experts`` in
  :mod:`~shardwork.models.hf.moe_weights`); nothing here depends on the family.
- :func:`load_hf_weights` fills every local piece of ``model.sharded_state_dict()`` from the
  folder's safetensors (single file or sharded with ``model.safetensors.index.json``) using
  ``safe_open(...).get_slice``: each rank reads only the rows/columns it holds.
- :func:`from_pretrained` reads ``config.json``, builds this rank's pipeline stage of any
  layout (or an explicit ``layer_range``) on the meta device, allocates only the local shards
  and loads them (no random init first); the model comes back in eval mode, as transformers',
  with the folder's token ids (:mod:`~shardwork.models.hf.token_ids`).
- :func:`save_pretrained` assembles full tensors (:func:`~shardwork.models.full_state.full_state_dict`,
  one all-reduce per tensor over ``group``) and the first rank writes safetensors files of at
  most ``max_shard_bytes`` each, an index when there are several, ``config.json`` that
  transformers loads and ``generation_config.json`` with the model's token ids. Meant for models that fit one host's memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from shardwork.models.config import GPTConfig
from shardwork.models.full_state import full_state_dict
from shardwork.models.gpt_model import GPTModel
from shardwork.models.hf.config_map import gpt_config_from_hf, hf_config_from_gpt, read_hf_config
from shardwork.models.hf.converted import converted_hf_state_dict, load_converted_weights
from shardwork.models.hf.files import weight_files, write_safetensors
from shardwork.models.hf.keys import to_hf_key
from shardwork.models.hf.moe_weights import load_hf_moe_weights, moe_hf_state_dict
from shardwork.models.hf.registry import adapter_for_config
from shardwork.models.hf.token_ids import read_token_ids, token_id_fields, write_generation_config
from shardwork.models.lora import is_base_key, lora_modules, merge_lora, unmerge_lora
from shardwork.models.module import to_empty_keep_meta
from shardwork.models.pipeline.stage import build_stage
from shardwork.models.token_ids import TokenIds
from shardwork.parallel_state import ProcessGroups

__all__ = ["check_hf_weights", "from_pretrained", "load_hf_weights", "save_pretrained"]


def load_hf_weights(model: GPTModel, folder: str | Path) -> GPTModel:
    """Copy the HF checkpoint in ``folder`` into ``model``'s local shards (in place)."""
    adapter = adapter_for_config(model.config)
    if adapter.weight_layout == "experts":
        return load_hf_moe_weights(model, folder)
    if adapter.weight_layout == "converted":
        return load_converted_weights(model, folder)
    return _load_dense(model, Path(folder), adapter.key_rules())


@torch.no_grad()
def _load_dense(model: GPTModel, folder: Path, rules: list[tuple[str, str]]) -> GPTModel:
    """The ``dense`` layout: every shardwork key is one HF tensor, read by slices."""
    files = weight_files(folder)
    _check_dense_files(model.config, files, rules, folder)
    by_file: dict[Path, list[tuple[str, Any]]] = {}
    for key, st in model.sharded_state_dict().items():
        name = to_hf_key(key, rules)
        by_file.setdefault(files[name], []).append((name, st))
    for path, items in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name, st in items:
                index = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.data.shape))
                st.data.copy_(f.get_slice(name)[index].to(st.data.dtype))
    return model


def check_hf_weights(config: GPTConfig, folder: str | Path) -> None:
    """ValueError when the weights in ``folder`` cannot fill a model of ``config`` (every
    stage): a tensor the model needs that no file holds, one of another shape, or one the model
    does not have. Reads the safetensors headers only, so a trainer can check a folder before
    it builds anything. The ``dense`` weight layout is checked here; the ``experts`` and
    ``converted`` layouts (whose names are not one per key) find theirs while loading."""
    adapter = adapter_for_config(config)
    if adapter.weight_layout == "dense":
        folder = Path(folder)
        _check_dense_files(config, weight_files(folder), adapter.key_rules(), folder)


# Buffers that older transformers versions saved with the weights; no model reads them back.
_SAVED_BUFFERS = ("rotary_emb.inv_freq",)


def _check_dense_files(config, files: dict[str, Path], rules, folder: Path) -> None:
    """Raise ``ValueError`` unless ``files`` hold exactly the tensors of the whole model (every
    stage), each of its global shape. Weights no key maps to are refused too: a
    ``config.json`` with fewer layers than the weights, or tied embeddings beside an
    ``lm_head.weight``, would otherwise load part of the checkpoint silently."""
    # Key names do not depend on the layout; one process cannot build sequence parallelism.
    whole = GPTModel(config.replace(sequence_parallel=False), device="meta")
    expected = {
        to_hf_key(key, rules): (key, tuple(st.global_shape))
        for key, st in whole.sharded_state_dict().items()
        if is_base_key(key)
    }
    unused = sorted(
        name for name in files if name not in expected and not name.endswith(_SAVED_BUFFERS)
    )
    if unused:
        shown = ", ".join(repr(name) for name in unused[:4])
        more = f" and {len(unused) - 4} more" if len(unused) > 4 else ""
        raise ValueError(
            f"{folder!s} holds {len(unused)} tensor(s) that a model of this config does not "
            f"have: {shown}{more}. The weights do not match the config (num_layers="
            f"{config.num_layers}, tie_word_embeddings={config.tie_word_embeddings}): check "
            "config.json, or the model you load into"
        )
    by_file: dict[Path, list[str]] = {}
    for name, (key, _) in expected.items():
        if name not in files:
            raise ValueError(
                f"{folder!s} has no tensor {name!r} (for {key!r}); check tie_word_embeddings "
                "and the model family"
            )
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                key, want = expected[name]
                if shape != want:
                    raise ValueError(
                        f"{name!r} has shape {shape} in {path.name}, expected {want} for {key!r}"
                    )


def from_pretrained(
    folder: str | Path,
    groups: ProcessGroups | None = None,
    *,
    device: str | torch.device = "cpu",
    layer_range: tuple[int, int] | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    **overrides: Any,
) -> GPTModel:
    """This rank's model from a HF checkpoint folder, reading only its local shards.

    Without ``layer_range`` the model is this rank's pipeline stage of ``groups``' layout
    (:func:`~shardwork.models.pipeline.build_stage`: the whole model at pp=1, a
    :class:`~shardwork.models.pipeline.GPTStage` that the schedules take); ``layer_range`` /
    ``pre_process`` / ``post_process`` build an explicit stage instead;
    ``first_stage_layers`` / ``last_stage_layers`` make the first / last stage uneven, as for
    :func:`~shardwork.models.pipeline.build_stage`. Virtual pipeline
    stages (vpp > 1) hold several chunks: build them with
    :func:`~shardwork.models.pipeline.build_model_chunks` and :func:`load_hf_weights`.

    Returns the model in eval mode, as transformers does (dropout off, so it computes the
    checkpoint's logits); call ``.train()`` before training. ``model.token_ids`` holds the
    folder's bos/eos/pad ids and its ``generation_config.json``. ``overrides`` go to the
    GPTConfig (e.g. ``params_dtype``, ``sequence_parallel``).
    """
    hf = read_hf_config(folder)
    config = gpt_config_from_hf(hf, **overrides)
    token_ids = read_token_ids(folder, hf)
    explicit = (layer_range, pre_process, post_process)
    if all(x is None for x in explicit):
        uneven = {"first_stage_layers": first_stage_layers, "last_stage_layers": last_stage_layers}
        model = _stage_on_meta(config, groups, uneven)
    elif first_stage_layers is not None or last_stage_layers is not None:
        raise ValueError(
            "from_pretrained: first_stage_layers / last_stage_layers split the layout's "
            f"stages, but layer_range={layer_range} (pre_process={pre_process}, "
            f"post_process={post_process}) names one stage explicitly: pass one or the other"
        )
    else:
        model = GPTModel(
            config,
            groups,
            layer_range=layer_range,
            pre_process=pre_process,
            post_process=post_process,
            device="meta",
        )
    to_empty_keep_meta(model, device)
    model.rng_tracker.to(device)
    with torch.no_grad():  # padding rows are not in the checkpoint: zero everything first
        for p in model.parameters():
            p.zero_()
    load_hf_weights(model, folder)
    model.token_ids = token_ids
    return model.eval()


def _stage_on_meta(config, groups: ProcessGroups | None, uneven: dict[str, Any]) -> GPTModel:
    """This rank's (only) pipeline stage of ``groups``' layout, built on the meta device."""
    groups = ProcessGroups.single() if groups is None else groups
    vpp = groups.config.vpp or 1
    if vpp > 1:
        raise ValueError(
            f"from_pretrained builds one stage per rank, but vpp={vpp} gives each rank {vpp} "
            "chunks: build them with shardwork.models.pipeline.build_model_chunks(config, "
            "groups, device='meta') and fill each with load_hf_weights, or use vpp=1"
        )
    return build_stage(config, groups, device="meta", **uneven)


def _hf_tensors(model: GPTModel, *, group, dtype) -> dict[str, torch.Tensor]:
    """HF-named full tensors of ``model``'s base weights (every rank and stage calls it)."""
    adapter = adapter_for_config(model.config)
    if adapter.weight_layout == "experts":
        return moe_hf_state_dict(model, group=group, dtype=dtype)
    if adapter.weight_layout == "converted":
        return converted_hf_state_dict(model, group=group, dtype=dtype)
    full = full_state_dict(model, group=group, dtype=dtype, keys=is_base_key)
    rules = adapter.key_rules()
    return {to_hf_key(k, rules): v.contiguous() for k, v in full.items()}


def save_pretrained(
    model: GPTModel,
    folder: str | Path,
    *,
    dtype: torch.dtype | None = None,
    group=None,
    max_shard_bytes: int = 5 * 2**30,
    token_ids: TokenIds | None = None,
) -> None:
    """Write ``model`` (all its ranks and stages, which must all call this) as a HF folder.

    A model with LoRA adapters is written merged (``W + scaling·B A``, what it computes); its
    base shards are restored bit-exactly afterwards.

    ``token_ids`` (default ``model.token_ids``) go into ``config.json`` and
    ``generation_config.json`` (see :mod:`~shardwork.models.hf.token_ids`); a model without
    ids gets neither the fields nor the file, so transformers' defaults apply.
    """
    token_ids = model.token_ids if token_ids is None else token_ids
    hf = hf_config_from_gpt(model.config, dtype=dtype) | token_id_fields(token_ids)
    adapted = next(lora_modules(model), None) is not None
    if adapted:  # LoRA: export the merged weights, then give the model back its exact base
        merge_lora(model)
    try:
        tensors = _hf_tensors(model, group=group, dtype=dtype)
    finally:
        if adapted:
            unmerge_lora(model)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if rank != 0:
        return
    folder = Path(folder)
    write_safetensors(folder, tensors, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    write_generation_config(folder, token_ids)
