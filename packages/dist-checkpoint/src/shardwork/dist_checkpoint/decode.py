"""Decode a checkpoint's pickled records without running code from them.

A checkpoint may come from someone else (a colleague's run, a published or downloaded
folder). Two of its records are pickles, because DCP's format makes them so:

- DCP's ``.metadata`` (a `Metadata` dataclass tree: keys, chunk boxes, file offsets);
- each `ShardedObject` value and the plain values, saved with ``torch.save``.

A plain ``pickle.load`` of either calls whatever the pickle names (``os.system``, a
constructor that writes a file). Here:

- `decode_metadata` unpickles with an allow-list: DCP's metadata dataclasses, ``torch.Size``,
  dtypes, layouts, memory formats and ``pathlib`` paths (plain containers and scalars need no
  global), and the save-plan classes of ``Metadata.all_local_plans`` that Megatron-Core's
  torch_dist indexes carry (``SavePlan``, ``WriteItem``, ``TensorWriteData``,
  ``WriteItemType``). Anything else is refused before it is called. Python versions pickle an
  enum member either by value (``Enum(value)``: CPython 3.11.7, for one) or by name
  (``getattr(Enum, name)``: CPython 3.11.2, Debian 12's ``python3``); the second names
  ``builtins.getattr``, which resolves here to a lookup that returns only a member of an
  allowed enum, so a checkpoint written under either Python loads under the other.
- `decode_object` uses ``torch.load(weights_only=True)``: torch's own allow-list decoder
  (tensors, dtypes, plain scalars, strings and containers). Object records are decoded before
  their file's checksum can be compared (see `reader`), so `check_archive` first checks each
  entry of the record's zip archive against the CRC-32 the archive itself holds and refuses
  compressed entries: torch.load allocates an entry at the size its zip header states, and one
  flipped bit there made it allocate 20-27 GB (the bit-flip sweep ran the machine out of
  memory). The element counts in the pickle size nothing: torch compares them with the
  entry's length first.

A refusal raises `CheckpointRefusedError` naming the record and the refused global.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import zipfile
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

from shardwork.dist_checkpoint.metadata import CheckpointRefusedError

__all__ = ["METADATA_GLOBALS", "check_archive", "decode_metadata", "decode_object"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"

#: ``(module, name)`` pairs a DCP ``.metadata`` pickle may name (torch 2.4-2.15 write these).
#: Each is a pure data class (or an enum / a lookup by name) whose construction touches
#: nothing outside the object being built.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # Megatron-Core's indexes carry ``Metadata.all_local_plans``: torch's save plans, frozen
        # data classes (NEWOBJ, then BUILD fills __dict__) and an enum of three members.
        (_DCP_PLANNER, "SavePlan"),
        (_DCP_PLANNER, "WriteItem"),
        (_DCP_PLANNER, "TensorWriteData"),
        (_DCP_PLANNER, "WriteItemType"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """``getattr(cls, name)`` as a pickle of an enum member by name calls it, for an allowed
    enum ``cls`` (one `METADATA_GLOBALS` names, so the pickle could only have got it from
    there) and the name of one of its members; any other attribute lookup is refused."""
    allowed = (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and (cls.__module__, cls.__qualname__) in METADATA_GLOBALS
    )
    if not allowed:
        raise pickle.UnpicklingError(f"getattr of {cls!r} is not allowed (only enum members)")
    member = cls.__members__.get(name) if isinstance(name, str) else None
    if member is None:
        raise pickle.UnpicklingError(f"{name!r} is not a member of {cls.__qualname__}")
    return member


class _TensorPropertiesOfANewerTorch(TensorProperties):
    """`TensorProperties` as a torch older than the checkpoint's writer reads them.

    torch 2.15 appended ``strides`` to the state a `TensorProperties` pickles, and an older
    torch's ``__setstate__`` unpacks exactly five values ("too many values to unpack"), so a
    checkpoint written under torch 2.15 could not be loaded under 2.14. A load copies into the
    caller's own tensors, which keep their own strides, so the appended value is dropped. The
    object then becomes a plain `TensorProperties` (data classes compare equal only within
    one class).
    """

    def __setstate__(self, state: tuple) -> None:
        super().__setstate__(tuple(state)[:5])
        self.__class__ = TensorProperties


#: What a pickled ``TensorProperties`` becomes under the running torch.
_TENSOR_PROPERTIES = (
    TensorProperties
    if "strides" in TensorProperties.__dataclass_fields__
    else _TensorPropertiesOfANewerTorch
)


#: Modules a pickle may name for a class that lives under another name on this CPython:
#: 3.13 moved pathlib's classes into ``pathlib._local``, so an index written under 3.13 names
#: ``pathlib._local.PosixPath`` (refused, then unknown before 3.13); they are pathlib's classes.
_MODULE_ALIASES = {"pathlib._local": "pathlib"}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only `METADATA_GLOBALS`, torch dtypes and enum members by name
    (`_enum_member`); refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) == (_DCP_METADATA, "TensorProperties"):
            return _TENSOR_PROPERTIES
        module = _MODULE_ALIASES.get(module, module)
        if (module, name) in METADATA_GLOBALS:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {pid!r} is not allowed")


def decode_metadata(raw: bytes, *, name: str) -> Metadata:
    """The DCP `Metadata` pickled in ``raw`` (the bytes of the file ``name``, for messages).

    Raises `CheckpointRefusedError` if the pickle names anything outside the allow-list, is
    not a pickle, or does not hold a `Metadata`.
    """
    try:
        value = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # any failure to decode is a refusal: nothing was called
        raise CheckpointRefusedError(
            f"{name}: refused to decode DCP metadata: {exc}", files=(Path(name).name,)
        ) from None
    if not isinstance(value, Metadata):
        raise CheckpointRefusedError(
            f"{name}: holds a {type(value).__name__}, not DCP metadata; refused",
            files=(Path(name).name,),
        )
    return value


def check_archive(stream: IO[bytes], name: str) -> None:
    """`CheckpointRefusedError` unless ``stream`` is a zip archive of stored (uncompressed)
    entries whose every entry matches its recorded CRC-32; the stream is rewound.

    torch.load allocates each entry at its uncompressed size before anything else can look at
    it. ``torch.save`` never compresses, so a stored entry is at most the record's own length;
    a deflated one can claim ~1,000x its bytes (a 20 MB record that asks for 20 GB), and a
    damaged header any size at all. Checking CRCs reads the stream once, in bounded blocks.
    """
    start = stream.tell()
    try:
        with zipfile.ZipFile(stream) as archive:
            packed = [
                e.filename for e in archive.infolist() if e.compress_type != zipfile.ZIP_STORED
            ]
            bad = None if packed else archive.testzip()
    except Exception as exc:  # zipfile raises many kinds on a damaged header (even NotImplemented)
        packed, bad = [], f"(unreadable archive: {exc})"
    stream.seek(start)
    if packed:
        raise CheckpointRefusedError(
            f"{name}: refused to decode record: entry {packed[0]} of its torch.save archive is "
            "compressed; torch.save stores entries uncompressed, and a compressed entry may "
            "expand to any size when decoded"
        )
    if bad is not None:
        raise CheckpointRefusedError(
            f"{name}: refused to decode record: entry {bad} of its torch.save archive "
            "does not match its CRC-32 (a damaged record)"
        )


def decode_object(data: bytes | IO[bytes], *, name: str) -> Any:
    """The value ``torch.save`` wrote into the object record ``name``, decoded with torch's
    allow-list (``weights_only=True``); `CheckpointRefusedError` names what was refused."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    check_archive(stream, name)
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        raise CheckpointRefusedError(f"{name}: refused to decode object record: {detail}") from None
    except Exception as exc:  # not a torch.save record at all (a crafted or damaged one)
        raise CheckpointRefusedError(
            f"{name}: refused to decode object record: not a torch.save record ({exc})"
        ) from None
