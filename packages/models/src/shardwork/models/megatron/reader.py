"""Read a Megatron-Core ``torch_dist`` checkpoint folder into whole tensors, at world 1.

A Megatron-Core distributed checkpoint is a ``torch.distributed.checkpoint`` folder
(``.metadata`` plus ``__<rank>_<n>.distcp`` files) with ``metadata.json`` naming the backend
(``{"sharded_backend": "torch_dist", ...}``) and, for checkpoints Megatron-LM writes,
its ``args`` among the non-sharded state: in ``common.pt`` (older releases) or inside the
folder as the object ``common_state``. Tensors are stored in global
coordinates whatever TP/PP/EP layout wrote them, so one process reads them whole with
``torch.distributed.checkpoint.load(..., no_dist=True)``: no process group is needed.

Layer-stacked keys (``decoder.layers.mlp.linear_fc1.weight`` with a leading layer axis, and
SequentialMLP's ``experts.experts.linear_fc1.weight`` / ``local_experts.linear_fc1.weight``
with a further expert axis) are split into per-layer and
per-expert keys (``decoder.layers.3.mlp.linear_fc1.weight``), so callers see one naming
whatever the writer's ``non_homogeneous_layers`` setting. ``_extra_state`` and other byte
entries (Transformer Engine's FP8 metadata, the common state) are skipped.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = [
    "NotAMegatronCheckpointError",
    "check_megatron_folder",
    "read_megatron_args",
    "read_megatron_tensors",
]

# A stacked key: ``decoder.layers.`` (or ``...local_experts.``) not followed by an index.
_STACKED = re.compile(
    r"^(?P<head>.*?\b(?:layers|local_experts|experts\.experts))\.(?P<tail>[^\d].*)$"
)


_COMMON_KEY = "common_state/shard_0_1"  # Megatron's ShardedObject("common_state", (1,), (0,))


class NotAMegatronCheckpointError(ValueError):
    """The folder is not a Megatron-Core ``torch_dist`` checkpoint."""


def check_megatron_folder(folder: Path) -> None:
    """Raise NotAMegatronCheckpointError unless ``folder`` is a torch_dist checkpoint."""
    info = folder / "metadata.json"
    if not folder.is_dir():
        raise NotAMegatronCheckpointError(f"{str(folder)!r} is not a directory")
    why = None
    if not info.is_file():
        why = "it has no metadata.json"
    else:
        try:
            backend = json.loads(info.read_text()).get("sharded_backend")
        except (json.JSONDecodeError, AttributeError):
            backend = None
        if backend != "torch_dist":
            why = f"its metadata.json names sharded_backend={backend!r}, not 'torch_dist'"
        elif not (folder / ".metadata").is_file():
            why = "it has no .metadata (torch.distributed.checkpoint index)"
    if why is not None:
        raise NotAMegatronCheckpointError(
            f"{str(folder)!r} is not a Megatron-Core checkpoint: {why} (expected the folder "
            "megatron.core.dist_checkpointing.save wrote in the torch_dist format, e.g. "
            "iter_0001000/ of a Megatron-LM run)"
        )


def _unstack(key: str, tensor: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """Put ``tensor`` under ``key``, splitting leading layer/expert axes into indexed keys."""
    match = _STACKED.match(key)
    if match is None:
        out[key] = tensor
        return
    for index, piece in enumerate(tensor.unbind(0)):
        _unstack(f"{match['head']}.{index}.{match['tail']}", piece, out)


def read_megatron_tensors(folder: str | Path, *, meta: bool = False) -> dict[str, torch.Tensor]:
    """``{Megatron key with layer/expert indices: whole tensor}`` of the checkpoint.

    ``meta=True`` reads only the index: meta-device tensors of the right shapes and dtypes (a
    cheap check of keys and shapes before any process group or weight read).
    """
    folder = Path(folder)
    check_megatron_folder(folder)
    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(info.size, dtype=info.properties.dtype, device="meta" if meta else "cpu")
        for key, info in metadata.state_dict_metadata.items()
        if isinstance(info, TensorStorageMetadata)
    }
    if meta:
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            _unstack(key, tensor, out)
        return out
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        _unstack(key, tensor, out)
    return out


def _common_state(folder: Path) -> Any:
    """The common (non-sharded) state Megatron-Core 0.15+ keeps inside the torch_dist folder
    as the object ``common_state`` (a one-item list), or None when the index has none."""
    reader = dcp.FileSystemReader(str(folder))
    if _COMMON_KEY not in reader.read_metadata().state_dict_metadata:
        return None
    state: dict[str, Any] = {_COMMON_KEY: io.BytesIO()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    loaded = state[_COMMON_KEY]
    if isinstance(loaded, io.BytesIO):  # stored as raw bytes: a torch.save of the list
        loaded.seek(0)
        loaded = torch.load(loaded, map_location="cpu", weights_only=False)
    return loaded[0] if isinstance(loaded, list) and loaded else None


def read_megatron_args(folder: str | Path) -> dict[str, Any] | None:
    """Megatron-LM's ``args`` as a dict, from the legacy ``common.pt`` or the in-checkpoint
    common state; None when neither holds them."""
    folder = Path(folder)
    path = folder / "common.pt"
    if path.is_file():
        # common.pt pickles an argparse.Namespace (and possibly other plain objects).
        common = torch.load(path, map_location="cpu", weights_only=False)
    else:
        common = _common_state(folder)
    args = common.get("args") if isinstance(common, dict) else None
    return None if args is None else dict(vars(args))
