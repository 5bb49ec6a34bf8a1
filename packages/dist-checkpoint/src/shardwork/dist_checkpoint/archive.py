"""Tensor chunks in ``torch.save``'s archive format, written with one pass over their bytes.

DCP's `FileSystemWriter` stores each tensor chunk as ``torch.save(chunk)``: an uncompressed
zip archive whose records are ``archive/data.pkl`` (a small pickle: dtype, size, stride and a
reference to the storage), ``archive/byteorder``, ``archive/data/0`` (the storage bytes) and
``archive/version``. Readers (``torch.load``, plain DCP, `reader.ShardworkReader`) see
exactly that. `write_tensor_archive` writes the same records itself because ``torch.save``
costs more than the disk needs:

- its zip writer computes the payload's CRC-32 in its own pass, and the file's running
  CRC-32 (for `verify`) needed another: here the payload's CRC is computed once, slice by
  slice just before each slice is written (`datafile.DataFile.write_payload`), and combined
  into the file's CRC;
- a chunk that is a view into a larger tensor (a row block, the boxes of a ZeRO flat range)
  is written straight from that memory: ``torch.save`` would write the whole underlying
  storage, so DCP clones such views first.

Format details kept from ``torch.save``: records padded with a ``FB`` extra field so that
each record's data starts at a multiple of 64 bytes from the archive's start, sizes and CRC
in a data descriptor after each record's data (flag bit 3), pickle protocol 2, version 3.
The ``.format_version`` / ``.storage_alignment`` / ``.data/serialization_id`` records of
recent ``torch.save`` are optional for ``torch.load`` and left out (archives of torch <= 2.4
have none of them). Tensors this format cannot hold plainly (quantized, dtypes without a
legacy storage class such as float8, over 4 GiB which would need zip64) go through
``torch.save`` as before (`fallback`).
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections import OrderedDict
from typing import Any

import torch
from torch.storage import _dtype_to_storage_type_map

from shardwork.dist_checkpoint.checksum import crc32

__all__ = ["write_tensor_archive"]

_ALIGN = 64
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header (30 bytes)
_DESCRIPTOR = struct.Struct("<IIII")  # data descriptor with signature (16 bytes)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry (46 bytes)
_END = struct.Struct("<IHHHHIIH")  # end of central directory (22 bytes)
_FLAGS = 0x0808  # bit 3: CRC and sizes follow the data; bit 11: UTF-8 names
_ZIP_VERSION = 20
_MAX_PAYLOAD = 2**32 - 2**20  # zip64 territory beyond this: left to torch.save
_STORAGE_NAMES = _dtype_to_storage_type_map()


class _StorageRef:
    """Stands for the tensor's storage in the pickle (a persistent id, as torch.save does)."""

    def __init__(self, storage_class: type, numel: int) -> None:
        self.storage_class = storage_class
        self.numel = numel


class _TensorPickle:
    """Pickles as ``torch.save`` pickles a plain contiguous tensor with no autograd state."""

    def __init__(
        self, storage: _StorageRef, size: tuple[int, ...], stride: tuple[int, ...]
    ) -> None:
        self.storage = storage
        self.size = size
        self.stride = stride

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        args = (self.storage, 0, self.size, self.stride, False, OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_class, "0", "cpu", obj.numel)
        return None


def _tensor_pickle(tensor: torch.Tensor) -> bytes:
    """``data.pkl`` of a contiguous ``tensor`` whose storage is exactly its elements."""
    storage_class = getattr(torch, _STORAGE_NAMES[tensor.dtype])
    ref = _StorageRef(storage_class, tensor.numel())
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(_TensorPickle(ref, tuple(tensor.shape), tensor.stride()))
    return buffer.getvalue()


def _plain(tensor: torch.Tensor) -> bool:
    return (
        tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and not tensor.is_quantized
        and tensor.dtype in _STORAGE_NAMES
        and tensor.nbytes <= _MAX_PAYLOAD
    )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """Read-only byte view of a contiguous CPU tensor's memory (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


class _ArchiveWriter:
    """Records of one archive, appended to ``out`` (a `datafile.DataFile`)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.start = out.tell()
        self.entries: list[tuple[bytes, int, int, int]] = []

    def record(self, name: str, data: bytes | memoryview, *, payload: bool = False) -> None:
        out = self.out
        offset = out.tell() - self.start
        name_bytes = f"archive/{name}".encode()
        pad = -(offset + _LOCAL.size + len(name_bytes) + 4) % _ALIGN
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        header = _LOCAL.pack(
            0x04034B50, _ZIP_VERSION, _FLAGS, 0, 0, 0, 0, 0, 0, len(name_bytes), len(extra)
        )
        out.write(header + name_bytes + extra)
        size = memoryview(data).nbytes
        if payload:
            crc = out.write_payload(memoryview(data))
        else:
            crc = crc32(data)
            out.write(data)
        out.write(_DESCRIPTOR.pack(0x08074B50, crc, size, size))
        self.entries.append((name_bytes, offset, crc, size))

    def finish(self) -> int:
        out = self.out
        directory_start = out.tell() - self.start
        for name_bytes, offset, crc, size in self.entries:
            entry = _CENTRAL.pack(
                0x02014B50,
                _ZIP_VERSION,
                _ZIP_VERSION,
                _FLAGS,
                0,
                0,
                0,
                crc,
                size,
                size,
                len(name_bytes),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            out.write(entry + name_bytes)
        directory_size = out.tell() - self.start - directory_start
        count = len(self.entries)
        out.write(_END.pack(0x06054B50, 0, 0, count, count, directory_size, directory_start, 0))
        return out.tell() - self.start


class _StreamAdapter:
    """File-like object over a `DataFile` for ``torch.save``."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.out.write(view)
        return view.nbytes

    def flush(self) -> None:
        pass


def fallback(out: Any, tensor: torch.Tensor) -> int:
    """``torch.save`` of ``tensor`` into ``out`` (of only its own elements, as DCP does)."""
    start = out.tell()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    torch.save(tensor, _StreamAdapter(out))
    return out.tell() - start


def write_tensor_archive(out: Any, tensor: torch.Tensor) -> int:
    """Append ``torch.save(tensor)``'s equivalent to ``out``; return its length in bytes."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not _plain(tensor):
        return fallback(out, tensor)
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    archive = _ArchiveWriter(out)
    archive.record("data.pkl", _tensor_pickle(tensor))
    archive.record("byteorder", sys.byteorder.encode())
    archive.record("data/0", _bytes_of(tensor), payload=True)
    archive.record("version", b"3\n")
    return archive.finish()
