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

Nothing in the folder is run, whoever wrote it: the ``.metadata`` index is decoded with
dist-checkpoint's allow-list (`decode_metadata`, which names the torch planner classes
Megatron's indexes carry) by `_AllowListReader`, also inside ``dcp.load``; a byte record is
decoded by `_AllowListPlanner` with `decode_object` (``torch.load(weights_only=True)``), not
torch's ``DefaultLoadPlanner.load_bytes`` (``weights_only=False``); ``common.pt`` likewise.
A pickle naming anything else is refused before it is called (see `read_megatron_args` for
what happens to ``args`` that name Megatron-LM's own classes).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from shardwork.dist_checkpoint import CheckpointRefusedError
from shardwork.dist_checkpoint.confine import check_storage_ranges
from shardwork.dist_checkpoint.decode import decode_metadata, decode_object

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

# Plain-data classes the common state may hold besides what torch's weights_only decoder
# allows: Megatron-LM's ``args`` (an argparse.Namespace: NEWOBJ, then its __dict__ filled),
# and io.BytesIO for a common state that torch's own DefaultSavePlanner wrapped once more
# (its __setstate__ only fills the buffer).
_COMMON_GLOBALS = (argparse.Namespace, io.BytesIO)

# A refused global that a genuine Megatron-LM common state names: Megatron's own classes
# (``args.attention_backend`` is megatron.core.transformer.enums.AttnBackend), and
# getattr (torch names builtins.getattr so), the form in which some CPython 3.11 releases
# pickle such an enum member: by name.
_MEGATRON_OWN = re.compile(r"^(megatron\.|(builtins\.)?getattr$)")


class NotAMegatronCheckpointError(ValueError):
    """The folder is not a Megatron-Core ``torch_dist`` checkpoint."""


def _backend_problem(info: Path) -> str | None:
    """Why ``info`` (a folder's ``metadata.json``) does not name the torch_dist backend, or
    None when it does: a missing, unreadable or non-JSON file is said as such (not as
    ``sharded_backend=None``), so the user knows which file to look at."""
    if not info.is_file():
        return "it has no metadata.json"
    try:
        data = json.loads(info.read_bytes())
    except json.JSONDecodeError as exc:
        return (
            f"its metadata.json is not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"
        )
    except UnicodeDecodeError:
        return "its metadata.json is not UTF-8/16/32 text"
    except OSError as exc:
        return f"its metadata.json cannot be read ({exc.strerror})"
    if not isinstance(data, dict):
        return f"its metadata.json holds a JSON {type(data).__name__}, not an object"
    backend = data.get("sharded_backend")
    if backend != "torch_dist":
        return f"its metadata.json names sharded_backend={backend!r}, not 'torch_dist'"
    return None


def check_megatron_folder(folder: Path) -> None:
    """Raise NotAMegatronCheckpointError unless ``folder`` is a torch_dist checkpoint."""
    if not folder.is_dir():
        raise NotAMegatronCheckpointError(f"{str(folder)!r} is not a directory")
    why = _backend_problem(folder / "metadata.json")
    if why is None and not (folder / ".metadata").is_file():
        why = "it has no .metadata (torch.distributed.checkpoint index)"
    if why is not None:
        raise NotAMegatronCheckpointError(
            f"{str(folder)!r} is not a Megatron-Core checkpoint: {why} (expected the folder "
            "megatron.core.dist_checkpointing.save wrote in the torch_dist format, "
            '{"sharded_backend": "torch_dist"} in metadata.json, e.g. iter_0001000/ of a '
            "Megatron-LM run)"
        )


class _AllowListReader(dcp.FileSystemReader):
    """torch's FileSystemReader whose ``read_metadata`` decodes ``.metadata`` with
    dist-checkpoint's allow-list instead of ``pickle.load``, so neither `_read_index` nor
    ``dcp.load`` (which reads the index again) runs code from a hostile index, and checks
    that every file and byte range it names lies inside the folder (`check_storage_ranges`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        metadata = decode_metadata(path.read_bytes(), name=str(path))
        # torch's reader opens whatever file and byte range the index names: keep it inside
        check_storage_ranges(Path(self.path), metadata.storage_data or {})
        if metadata.storage_meta is None:  # as torch's read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _AllowListPlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner whose ``load_bytes`` decodes a byte record with
    `decode_object` (torch's weights_only decoder, plus ``extra`` plain-data classes) where
    torch calls ``torch.load(weights_only=False)``. The value (or the refusal) is kept in
    ``decoded`` by key: a refusal raised inside ``dcp.load`` would come out wrapped in
    torch's CheckpointException, far from the file it names."""

    def __init__(self, folder: Path, extra: tuple[type, ...] = ()) -> None:
        super().__init__()
        self.folder, self.extra = folder, extra
        self.decoded: dict[str, tuple[Any, str]] = {}  # key -> (value or refusal, record name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        index = read_item.storage_index
        where = self.folder / self.metadata.storage_data[index].relative_path
        name = f"{str(where)!r} record {index.fqn!r}"
        try:
            with torch.serialization.safe_globals(list(self.extra)):
                decoded = decode_object(value, name=name)
        except CheckpointRefusedError as exc:
            decoded = exc
        self.decoded[read_item.dest_index.fqn] = (decoded, name)


def _read_index(folder: Path) -> tuple[dcp.FileSystemReader, Metadata]:
    """A reader of ``folder`` and its ``.metadata`` index, or NotAMegatronCheckpointError
    naming that file: a garbage or truncated index otherwise escapes as whatever the unpickler
    raised (``invalid literal for int()``, EOFError), with no file named.

    The index is decoded with dist-checkpoint's allow-list (`_AllowListReader`): an index
    that names anything else (a hostile pickle) is refused, naming the refused global, and
    nothing in it is called."""
    reader = _AllowListReader(str(folder))
    path = str(folder / ".metadata")
    try:
        metadata = reader.read_metadata()
    except CheckpointRefusedError as exc:  # garbage, truncated, or a global outside the list
        metadata, detail = None, " ".join(str(exc).removeprefix(f"{path}: ").split())
    except Exception as exc:  # an unreadable file
        metadata, detail = None, " ".join(f"{type(exc).__name__}: {exc}".split())
    else:
        detail = f"it holds a {type(metadata).__name__}"
    if not isinstance(metadata, Metadata):
        raise NotAMegatronCheckpointError(
            f"{path!r} is not a readable torch_dist metadata file ({detail}); expected the "
            "pickled torch.distributed.checkpoint Metadata that "
            "megatron.core.dist_checkpointing.save writes"
        )
    return reader, metadata


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
    reader, metadata = _read_index(folder)
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
        dcp.load(state, storage_reader=reader, planner=_AllowListPlanner(folder), no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        _unstack(key, tensor, out)
    return out


def _refused(exc: CheckpointRefusedError, name: str) -> None:
    """Turn the refusal to decode ``name`` (common.pt or the common-state record) into a
    warning when the refused global is Megatron-LM's own (`_MEGATRON_OWN`): the args then go
    unchecked, as they serve only to cross-check the user's config. Any other global (or a
    damaged record) raises NotAMegatronCheckpointError. Nothing from the record was called."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    refused = found[1] if found else None
    if refused is not None and _MEGATRON_OWN.match(refused):
        warnings.warn(
            f"{name}: Megatron-LM's args could not be read safely (they name {refused}, which "
            "only megatron itself can build, and shardwork runs no code from a checkpoint); "
            "the config is not cross-checked against them",
            stacklevel=4,
        )
        return
    if refused is not None:
        why = f": it names the global {refused}, which is not plain data (nothing from it was run)"
    else:  # a damaged record or no torch.save archive at all
        why = f" ({str(exc).removeprefix(f'{name}: ')}; nothing from it was run)"
    raise NotAMegatronCheckpointError(
        f"{name}: refused to decode Megatron's common state{why}"
    ) from None


def _decode_common(data: Any, name: str) -> Any:
    """The value ``torch.save`` wrote into ``data`` (common.pt's stream, or a decoded common
    state that is still an io.BytesIO: raw bytes torch's DefaultSavePlanner wrapped once
    more), decoded with torch's weights_only decoder plus `_COMMON_GLOBALS`; None after a
    refusal `_refused` let through as a warning."""
    try:
        with torch.serialization.safe_globals(list(_COMMON_GLOBALS)):
            value = decode_object(data, name=name)
            if isinstance(value, io.BytesIO):  # pickled with its position: read from the start
                value.seek(0)
                value = decode_object(value, name=name)
    except CheckpointRefusedError as exc:
        return _refused(exc, name)
    return value


def _common_state(folder: Path) -> Any:
    """The common (non-sharded) state Megatron-Core 0.15+ keeps inside the torch_dist folder
    as the object ``common_state`` (a one-item list), or None when the index has none.
    `_AllowListPlanner` decodes the record (Megatron writes ``torch.save`` of the list)."""
    reader, metadata = _read_index(folder)
    if _COMMON_KEY not in metadata.state_dict_metadata:
        return None
    state: dict[str, Any] = {_COMMON_KEY: io.BytesIO()}
    planner = _AllowListPlanner(folder, _COMMON_GLOBALS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    loaded, name = planner.decoded.get(_COMMON_KEY, (None, ""))
    if isinstance(loaded, CheckpointRefusedError):
        return _refused(loaded, name)
    if isinstance(loaded, io.BytesIO):  # stored as raw bytes: a torch.save of the list
        loaded.seek(0)  # pickled with its position (at the end, after torch.save wrote it)
        loaded = _decode_common(loaded, name)
    return loaded[0] if isinstance(loaded, list) and loaded else None


def read_megatron_args(folder: str | Path) -> dict[str, Any] | None:
    """Megatron-LM's ``args`` as a dict, from the legacy ``common.pt`` or the in-checkpoint
    common state; None when neither holds them.

    Neither runs code (`_decode_common`, `_AllowListPlanner`): a record naming a global
    outside the allow-list raises NotAMegatronCheckpointError naming the file and the global,
    except one of Megatron-LM's own classes (genuine ``args`` hold Megatron enums, which only
    megatron can build): that is a warning and None, see `_refused`."""
    folder = Path(folder)
    path = folder / "common.pt"
    if path.is_file():
        with open(path, "rb") as stream:
            common = _decode_common(stream, repr(str(path)))
    else:
        common = _common_state(folder)
    args = common.get("args") if isinstance(common, dict) else None
    return None if args is None else dict(vars(args))
