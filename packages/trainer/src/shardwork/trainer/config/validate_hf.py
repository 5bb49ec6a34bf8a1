"""Validation of ``checkpoint.hf_init`` and ``checkpoint.hf_export``, before any process group.

The rule for fine-tuning from a Hugging Face folder: its config.json *is* the architecture.

- The folder must hold ``config.json`` and ``model.safetensors`` (or the sharded index) of a
  family shardwork.models.hf translates; its error names what is unsupported.
- ``model.preset`` must be unset (the folder replaces it). Model dimensions
  (``model.num_layers`` ...) and ``model.vocab_size`` may be left unset (they are taken from
  the folder and shown by ``--print-config``) or must equal the folder's.
- The tokenizer's vocabulary must fit the checkpoint's embedding.
- Other ``[model]`` settings may change anything that keeps every tensor's shape (dropout,
  recomputation, ``rope_theta`` for a longer context, ...): the tensors the run's model holds
  are compared with those of the folder's model, built on the meta device (no memory).

``checkpoint.hf_export`` must name a new or empty directory (an export never mixes with other
files), a model shardwork.models.hf can write, and a layout with one model chunk per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwork.models import GPTModel
from shardwork.models.hf import check_hf_weights, hf_config_from_gpt
from shardwork.models.hf.files import check_weight_files
from shardwork.trainer.config.model_table import flatten_settings
from shardwork.trainer.config.sections import DEMO_MODEL, TrainConfig
from shardwork.trainer.data.tokenizer import load_tokenizer
from shardwork.trainer.model_factory import hf_config, hf_gpt_config

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def hf_dimensions(hf: dict[str, Any]) -> dict[str, Any]:
    """The model-section fields (dimensions and vocabulary) of a config.json dict."""
    model = hf_gpt_config(hf)
    return {name: getattr(model, name) for name in (*DEMO_MODEL, "vocab_size")}


def check_hf_init(config: TrainConfig, problems: list[str]) -> bool:
    """Check ``checkpoint.hf_init`` against the folder; False when the folder is unusable
    (later checks that need its architecture are skipped)."""
    folder = config.checkpoint.hf_init
    if folder is None:
        return True
    where = f"checkpoint.hf_init={folder!r}"
    path = Path(folder)
    if not path.is_dir():
        problems.append(f"{where}: no such directory; valid: a Hugging Face checkpoint folder")
        return False
    if not (path / "config.json").is_file() or not any((path / w).is_file() for w in _WEIGHTS):
        problems.append(
            f"{where}: not a Hugging Face checkpoint folder; valid: a folder with config.json "
            "and model.safetensors (or model.safetensors.index.json)"
        )
        return False

    try:
        dims = hf_dimensions(hf_config(folder))
    except (ValueError, KeyError, TypeError) as exc:
        problems.append(f"{where}: its config.json cannot be imported: {exc}")
        return False
    try:
        check_weight_files(path)
    except ValueError as exc:
        problems.append(f"{where}: {exc}; valid: the folder as written by save_pretrained")
        return False
    ok = True
    m = config.model
    if m.preset is not None:
        problems.append(
            f"model.preset={m.preset!r} with {where}: the folder's config.json is the "
            "architecture; valid: model.preset unset"
        )
        ok = False
    for name, value in dims.items():
        mine = m.settings.get(name)
        if mine is not None and mine != value:
            problems.append(
                f"model.{name}={mine!r} differs from {where} ({value!r} in its config.json); "
                "valid: unset (taken from the folder) or equal"
            )
            ok = False

    try:
        tokenizer = load_tokenizer(config.data.tokenizer, eod_token=config.data.eod_token)
    except (ImportError, ValueError):
        return ok  # reported by the tokenizer check
    if tokenizer.vocab_size > dims["vocab_size"]:
        problems.append(
            f"data.tokenizer={config.data.tokenizer!r} has {tokenizer.vocab_size} ids but the "
            f"vocabulary of {where} has {dims['vocab_size']}: the embedding could not look up "
            "the larger ids; valid: the tokenizer the checkpoint was trained with"
        )
        ok = False
    return ok


def _tensor_shapes(model_config) -> dict[str, tuple[int, ...]]:
    """``{key: global shape}`` of every tensor of the model, built on the meta device."""
    # One process on the meta device: global shapes do not depend on the layout, and sequence
    # parallelism (which needs tp > 1) would refuse this build, so it is switched off here.
    model = GPTModel(model_config.replace(sequence_parallel=False), None, device="meta")
    return {k: tuple(st.global_shape) for k, st in model.sharded_state_dict().items()}


def check_hf_shapes(config: TrainConfig, model_config, problems: list[str]) -> None:
    """The resolved model (``model_config``, the run's GPTConfig) holds exactly the tensors
    (names and shapes) of the folder's model."""
    if config.checkpoint.hf_init is None:
        return

    folder = config.checkpoint.hf_init
    mine = _tensor_shapes(model_config)
    theirs_config = hf_gpt_config(hf_config(folder))
    theirs = _tensor_shapes(theirs_config)
    if mine == theirs:
        try:  # the folder's weights against its own config.json (headers only)
            check_hf_weights(theirs_config, folder)
        except ValueError as exc:
            problems.append(f"checkpoint.hf_init={folder!r}: {exc}")
        return
    differ = sorted(k for k in mine.keys() & theirs.keys() if mine[k] != theirs[k])
    details = [f"{k} is {list(mine[k])} here but {list(theirs[k])} there" for k in differ[:3]]
    details += [f"{k} only here" for k in sorted(mine.keys() - theirs.keys())[:3]]
    details += [f"{k} only there" for k in sorted(theirs.keys() - mine.keys())[:3]]
    problems.append(
        f"the [model] settings {flatten_settings(config.model.settings)!r} change the tensors of "
        f"checkpoint.hf_init={config.checkpoint.hf_init!r} ({'; '.join(details)}); valid: "
        "settings that keep every tensor's shape"
    )


def check_hf_export(config: TrainConfig, problems: list[str], *, model) -> None:
    """``checkpoint.hf_export``: a new or empty directory, a writable family, one chunk per rank;
    ``model`` is the run's GPTConfig (None when it could not be built: the family is not
    checked)."""
    target = config.checkpoint.hf_export
    if target is None:
        return
    where = f"checkpoint.hf_export={target!r}"
    path = Path(target)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        problems.append(f"{where}: exists and is not an empty directory; valid: a new path")
    if config.parallel.vpp is not None and config.parallel.vpp > 1:
        problems.append(
            f"{where} with parallel.vpp={config.parallel.vpp}: the export writes one model chunk "
            "per rank; valid: parallel.vpp unset (resume the final checkpoint at such a layout "
            "to export it)"
        )
    if model is None:
        return

    try:
        hf_config_from_gpt(model)
    except ValueError as exc:
        problems.append(f"{where}: this model has no Hugging Face equivalent: {exc}")
