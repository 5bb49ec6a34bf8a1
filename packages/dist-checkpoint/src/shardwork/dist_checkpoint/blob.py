"""Locate a tensor's raw bytes inside a ``torch.save`` blob without unpickling the data.

DCP's `FileSystemWriter` stores each tensor chunk as one ``torch.save`` archive (an
uncompressed zip: ``<prefix>/data.pkl`` first, then a few tiny records, then
``<prefix>/data/<key>`` holding the storage bytes, 64-byte aligned). Its reader loads every
chunk with ``torch.load`` into a fresh tensor and copies it into the destination: two passes
over the bytes and many small reads. `parse_tensor_blob` reads only the first few hundred bytes
of the archive: the local zip headers (stored, not compressed) and the tiny pickle (tensor
dtype, storage offset, size, stride, storage key), so the caller can read the storage bytes
straight from the file into their destination.

Design: the pickle is read by a restricted unpickler that accepts only what ``torch.save`` of
a plain tensor writes (``_rebuild_tensor_v2``, a typed-storage class, ``OrderedDict``); anything
else (another serialisation, a subclass, a compressed record, a head that ends too early)
returns None and the caller falls back to ``torch.load``, so unusual files stay readable.
The head is parsed before its file's checksum is compared, so parsing it must not trust its
sizes (see `_SpecUnpickler`).
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch.storage import _dtype_to_storage_type_map

__all__ = ["HEAD_BYTES", "StoredTensor", "parse_tensor_blob"]

HEAD_BYTES = 4096
"""Bytes of a blob's start read to find its layout (header + pickle are ~0.7 KiB)."""

_LOCAL_HEADER = b"PK\x03\x04"
_HEADER = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_STORAGE_DTYPES = {name: dtype for dtype, name in _dtype_to_storage_type_map().items()}


@dataclass(frozen=True)
class StoredTensor:
    """Layout of one saved tensor chunk.

    Attributes:
        data_offset: offset of the storage bytes from the blob's start.
        dtype: element type.
        storage_offset, size, stride: the tensor's view of its storage (elements).
    """

    data_offset: int
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


def _rebuild_spec(
    storage: Any,
    storage_offset: int,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> tuple[Any, int, tuple[int, ...], tuple[int, ...]]:
    return storage, int(storage_offset), tuple(size), tuple(stride)


# The pure-Python unpickler, not the C one: this pickle is read before its file's checksum can
# be compared, and the C unpickler sizes buffers from the bytes it reads (a memo index, a
# length), so one flipped bit (``R`` -> ``r``: LONG_BINPUT with a 4-byte index) made it
# allocate 30 GB, which ran CI's machine out of memory. The Python one keeps the memo in a dict
# and reads at most what the head holds; it costs ~24 us a chunk instead of ~12.
class _SpecUnpickler(pickle._Unpickler):
    """Unpickles ``torch.save(tensor)``'s data.pkl into a layout tuple, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_spec
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"not a plain tensor pickle: {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unexpected storage type {storage_type!r}")
        return storage_type.dtype, str(key), int(numel)


def _local_entry(head: bytes, pos: int) -> tuple[str, int, int] | None:
    """``(name, data start, compression method)`` of the zip local header at ``pos``."""
    if pos + _HEADER.size > len(head) or head[pos : pos + 4] != _LOCAL_HEADER:
        return None
    fields = _HEADER.unpack_from(head, pos)
    method, name_len, extra_len = fields[3], fields[9], fields[10]
    name_end = pos + _HEADER.size + name_len
    if name_end > len(head):
        return None
    name = head[pos + _HEADER.size : name_end].decode("utf-8", "replace")
    return name, name_end + extra_len, method


def parse_tensor_blob(head: bytes, blob_length: int) -> StoredTensor | None:
    """Layout of the tensor saved in a ``torch.save`` blob of ``blob_length`` bytes whose
    first bytes are ``head``; None when the blob is not a plain uncompressed tensor archive
    (the caller then uses ``torch.load``)."""
    first = _local_entry(head, 0)
    if first is None or first[2] != 0 or not first[0].endswith("/data.pkl"):
        return None
    prefix = first[0][: -len("data.pkl")]
    try:
        spec = _SpecUnpickler(io.BytesIO(head[first[1] :])).load()
    except Exception:  # truncated head or not a plain tensor: use the slow path
        return None
    if not (isinstance(spec, tuple) and len(spec) == 4 and isinstance(spec[0], tuple)):
        return None
    (dtype, key, numel), storage_offset, size, stride = spec
    target = prefix + "data/" + key
    pos = head.find(_LOCAL_HEADER, first[1])
    while pos != -1:
        entry = _local_entry(head, pos)
        if entry is not None and entry[0] == target:
            if entry[2] != 0:
                return None
            data_offset = entry[1]
            nbytes = numel * dtype.itemsize
            extent = storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
            if math.prod(size) and (extent > numel or min(stride, default=0) < 0):
                return None
            if data_offset + nbytes > blob_length:
                return None
            return StoredTensor(data_offset, dtype, storage_offset, size, stride)
        pos = head.find(_LOCAL_HEADER, pos + 1)
    return None
