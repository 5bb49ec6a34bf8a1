"""Cheap whole-file checks of an indexed dataset, run before training starts.

Opening an :class:`IndexedDataset` already checks the header and the file sizes. These checks
read the rest once, so a broken dataset is refused with its file named before step 1 instead
of failing deep inside a step:

- :func:`check_index`: the index's arrays agree with each other (document indices start at 0,
  rise, end at the sequence count; each pointer is where the previous sequence ends).
- :func:`check_token_range`: every token id is below the model's vocabulary, by a max over the
  memory-mapped ``.bin`` in chunks (one sequential read of the file); only when an id is out of
  range is its document located, for the message.
"""

from __future__ import annotations

import numpy as np

from shardwork.trainer.data.indexed import IndexedDataset, data_file_paths
from shardwork.trainer.errors import DataError

CHUNK_TOKENS = 1 << 22
"""Tokens per chunk of the range check (8 MiB of uint16): bounded memory at any file size."""


def check_index(ds: IndexedDataset) -> None:
    """Raise DataError naming ``ds``'s ``.idx`` when its arrays contradict each other."""
    _, idx_path = data_file_paths(ds.prefix)
    docs, lengths = ds.document_indices, ds.sequence_lengths
    if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size or np.any(np.diff(docs) < 0):
        raise DataError(
            f"{idx_path}: document indices must rise from 0 to the sequence count "
            f"{lengths.size}; found {docs.size} entries from {docs[:1].tolist()} to "
            f"{docs[-1:].tolist()}; rebuild it with shardwork-preprocess"
        )
    if np.any(lengths < 0):
        bad = int(np.argmax(lengths < 0))
        raise DataError(f"{idx_path}: sequence {bad} has negative length {int(lengths[bad])}")
    ends = np.cumsum(lengths.astype(np.int64) * ds.dtype.itemsize)
    starts = np.concatenate([[0], ends[:-1]]) if lengths.size else ends
    if not np.array_equal(starts, ds.sequence_pointers):
        bad = int(np.argmax(starts != ds.sequence_pointers))
        raise DataError(
            f"{idx_path}: sequence {bad} points to byte {int(ds.sequence_pointers[bad])} but the "
            f"sequences before it end at byte {int(starts[bad])}; rebuild it with "
            "shardwork-preprocess"
        )


def check_token_range(ds: IndexedDataset, vocab_size: int, *, field: str) -> None:
    """Raise DataError when a token id of ``ds`` is >= ``vocab_size`` (or negative), naming the
    ``.bin``, the document, the id and the vocabulary; ``field`` names the config entry."""
    bin_path, _ = data_file_paths(ds.prefix)
    tokens = ds.tokens
    signed = np.issubdtype(ds.dtype, np.signedinteger)
    for start in range(0, tokens.size, CHUNK_TOKENS):
        chunk = tokens[start : start + CHUNK_TOKENS]
        if chunk.max() < vocab_size and (not signed or chunk.min() >= 0):
            continue
        offset = int(np.argmax((chunk >= vocab_size) | (chunk < 0)))
        position = start + offset
        byte = position * ds.dtype.itemsize
        sequence = int(np.searchsorted(ds.sequence_pointers, byte, "right")) - 1
        document = int(np.searchsorted(ds.document_indices, sequence, "right")) - 1
        within = (byte - int(ds.sequence_pointers[sequence])) // ds.dtype.itemsize
        raise DataError(
            f"{field}: {bin_path} holds token id {int(chunk[offset])} in document {document} "
            f"(sequence {sequence}, token {within}) but the model's vocabulary has {vocab_size} ids "
            f"(valid ids: 0..{vocab_size - 1}); was it tokenized with another tokenizer? Set "
            "data.tokenizer to the one it was built with or model.vocab_size above its largest id"
        )
