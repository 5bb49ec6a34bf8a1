"""Megatron-compatible indexed datasets: a ``.bin`` of token ids and an ``.idx`` index.

- Format (little endian), identical to Megatron-Core's ``MMIDIDX`` files, so
  files written here load in Megatron and vice versa:
  ``b"MMIDIDX\\x00\\x00"``, version ``<Q`` = 1, dtype code ``<B``, sequence
  count ``<Q``, document count ``<Q``, then int32 sequence lengths, int64
  byte pointers into ``.bin``, int64 document indices (sequence index where
  each document starts, beginning with 0 and ending with the sequence count).
- Reading memory-maps both files: opening a corpus of any size costs only
  the index, and a sample reads just its slice of ``.bin``.
- Opening checks what costs nothing to check: the header, the ``.idx`` size against its
  counts and the ``.bin`` size against the end of the last sequence; a mismatch raises
  :class:`DataError` naming the file, its size and the size expected (a truncated file never
  reaches numpy's "buffer is smaller than requested size"). Whole-file checks are in
  :mod:`.integrity`.
- The token dtype is the smallest unsigned type that holds the vocabulary
  (uint16 below 65,500 ids, int32 above), as Megatron's preprocessing chooses.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from shardwork.trainer.data.partial_files import partial_path, partial_tag
from shardwork.trainer.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in _DTYPE_CODES.items()}
_HEADER_BYTES = len(INDEX_HEADER) + struct.calcsize("<QBQQ")


def token_dtype_for(vocab_size: int) -> np.dtype:
    """Smallest dtype Megatron uses for ``vocab_size`` ids (uint16 if it fits, else int32)."""
    return (
        np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)
    )


def data_file_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``(prefix.bin, prefix.idx)`` for a dataset prefix."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def _read_header(idx_path: Path) -> tuple[np.dtype, int, int, int]:
    """``(token dtype, sequences, document indices, offset of the arrays)`` of an ``.idx``;
    a file that is not an index, or is shorter than its header says, raises DataError."""
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise DataError(
            f"{idx_path} is not an MMIDIDX index ({size} bytes, starting "
            f"{head[: len(INDEX_HEADER)]!r}; expected {INDEX_HEADER!r} and a "
            f"{_HEADER_BYTES}-byte header)"
        )
    version, code, num_sequences, num_doc_indices = struct.unpack(
        "<QBQQ", head[len(INDEX_HEADER) :]
    )
    if version != 1:
        raise DataError(f"{idx_path}: index version {version} is not supported (only 1)")
    if code not in _DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {code}; valid: {sorted(_DTYPE_CODES)}")
    # Per sequence an int32 length and an int64 pointer; per document index one int64.
    expected = _HEADER_BYTES + num_sequences * (4 + 8) + num_doc_indices * 8
    if size != expected:
        raise DataError(
            f"{idx_path} is {size} bytes but its header describes {num_sequences} sequences and "
            f"{num_doc_indices} document indices ({expected} bytes): the index is "
            f"{'truncated' if size < expected else 'longer than its header says'}; rebuild it "
            "with shardwork-preprocess"
        )
    return np.dtype(_DTYPE_CODES[code]), num_sequences, num_doc_indices, _HEADER_BYTES


def dataset_exists(prefix: str | os.PathLike) -> bool:
    bin_path, idx_path = data_file_paths(prefix)
    return bin_path.is_file() and idx_path.is_file()


class IndexedDatasetWriter:
    """Append documents (each a sequence of token ids) and write ``prefix.bin``/``prefix.idx``.

    Use as a context manager; the index is written on a clean exit. The
    ``.bin`` is written to a temporary name and renamed at the end, so an
    interrupted write never leaves a valid-looking dataset behind; when the body raises, or
    writing the index or a rename fails, the temporary files are removed.
    """

    def __init__(self, prefix: str | os.PathLike, *, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(
                f"IndexedDatasetWriter dtype={self.dtype} is not supported; valid: "
                f"{sorted(str(np.dtype(d)) for d in _DTYPE_CODES.values())}"
            )
        self._lengths: list[int] = []
        self._documents: list[int] = [0]
        self._bin = None

    def __enter__(self) -> IndexedDatasetWriter:
        bin_path, _ = data_file_paths(self.prefix)
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tag = partial_tag()  # .bin and .idx of one write share it
        self._tmp_bin = partial_path(bin_path, self._tag)
        self._bin = open(self._tmp_bin, "wb")
        return self

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Write one document as one sequence."""
        array = np.asarray(tokens, dtype=self.dtype)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of ids, got shape {array.shape}")
        self._bin.write(array.tobytes(order="C"))
        self._lengths.append(int(array.size))
        self._documents.append(len(self._lengths))

    def __exit__(self, exc_type, exc, tb) -> None:
        self._bin.close()
        if exc_type is not None:
            self._tmp_bin.unlink(missing_ok=True)
            return
        bin_path, idx_path = data_file_paths(self.prefix)
        tmp_idx = partial_path(idx_path, self._tag)
        moved = False
        try:
            write_index(tmp_idx, self._lengths, self._documents, dtype=self.dtype)
            os.replace(self._tmp_bin, bin_path)
            moved = True
            os.replace(tmp_idx, idx_path)
        except BaseException:
            # a failed rename (a directory in the way, a full disk) leaves no partial file and
            # no .bin without its .idx
            self._tmp_bin.unlink(missing_ok=True)
            tmp_idx.unlink(missing_ok=True)
            if moved:
                bin_path.unlink(missing_ok=True)
            raise


def write_index(
    path: str | os.PathLike,
    sequence_lengths: list[int],
    document_indices: list[int],
    *,
    dtype: np.dtype,
) -> None:
    """Write an ``MMIDIDX`` index file for sequences of ``dtype`` tokens."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        # Byte offset of each sequence: the summed byte sizes of those before it (the first at 0).
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", _CODE_OF[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(document_indices, dtype=np.int64).tobytes(order="C"))


class IndexedDataset:
    """Memory-mapped reader of a ``prefix.bin``/``prefix.idx`` pair.

    ``len(ds)`` is the number of sequences; ``ds[i]`` is sequence ``i`` as a
    numpy array; ``ds.get(i, offset, length)`` a slice of it without copying.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        bin_path, idx_path = data_file_paths(prefix)
        if not idx_path.is_file() or not bin_path.is_file():
            raise DataError(
                f"indexed dataset prefix={self.prefix!r}: expected {bin_path} and {idx_path} to "
                "exist (build them with `shardwork-preprocess`)"
            )
        self.dtype, num_sequences, num_doc_indices, offset = _read_header(idx_path)
        self._index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(
            self._index, dtype=np.int32, count=num_sequences, offset=offset
        )
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(
            self._index, dtype=np.int64, count=num_sequences, offset=offset
        )
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(
            self._index, dtype=np.int64, count=num_doc_indices, offset=offset
        )
        size = bin_path.stat().st_size
        expected = self.expected_bin_size()
        if size != expected:
            raise DataError(
                f"{bin_path} is {size} bytes but its index {idx_path} points to {expected} "
                f"bytes: the .bin is {'truncated' if size < expected else 'longer than indexed'} "
                "or the pair comes from different builds; rebuild both with shardwork-preprocess"
            )
        # numpy cannot memory-map an empty file: an empty corpus gets an empty array instead.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)

    def expected_bin_size(self) -> int:
        """Bytes the ``.bin`` must hold: the end of the last sequence the index points to."""
        if not self.sequence_lengths.size:
            return 0
        last = int(self.sequence_pointers[-1])
        return last + int(self.sequence_lengths[-1]) * self.dtype.itemsize

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the ``.bin`` as one read-only 1-D array (a view of the memory map)."""
        return np.frombuffer(self._bin, dtype=self.dtype)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (a read-only view)."""
        seq_len = int(self.sequence_lengths[index])
        if length is None:
            length = seq_len - offset
        pointer = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=pointer)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)
