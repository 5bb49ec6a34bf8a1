"""GPT samples: documents concatenated into fixed-length token windows.

- The documents of one split are shuffled with the seed and laid end to end,
  one shuffled copy per epoch, as many epochs as the requested number of
  samples needs. Sample ``j`` of that stream is tokens
  ``[j*L, j*L + L + 1)``: ``L`` inputs and, shifted by one, ``L`` labels
  (consecutive samples share one boundary token, as in Megatron).
- The order of samples is shuffled again with the seed (``shuffle=False``
  keeps stream order, which evaluation uses).
- Everything is a pure function of (documents, lengths, L, seed, number of
  samples): every rank builds the same index, and any sample can be read
  at any time, which is what makes runs resumable at any step.
- Indices are numpy arrays built in O(documents × epochs + samples); the
  token reads go through the memory-mapped :class:`IndexedDataset`.
"""

from __future__ import annotations

import numpy as np

from shardwork.trainer.data.indexed import IndexedDataset


class GPTDataset:
    """``num_samples`` windows of ``seq_length + 1`` tokens over ``document_ids`` of ``dataset``."""

    def __init__(
        self,
        dataset: IndexedDataset,
        document_ids: np.ndarray,
        *,
        seq_length: int,
        num_samples: int,
        seed: int,
        shuffle: bool = True,
        name: str = "",
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        document_ids = np.asarray(document_ids, dtype=np.int64)
        lengths = dataset.sequence_lengths[document_ids].astype(np.int64)
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch < 2:
            raise ValueError(
                f"dataset {name or dataset.prefix!r} split has {tokens_per_epoch} tokens in "
                f"{document_ids.size} documents: too few to build samples"
            )
        self.dataset = dataset
        self.name = name or dataset.prefix
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.tokens_per_epoch = tokens_per_epoch
        # +1: the last sample's final label is one token past its window.
        needed = num_samples * seq_length + 1
        # Epochs needed to cover that many tokens (ceil division).
        self.num_epochs = max(1, -(-needed // tokens_per_epoch))
        rng = np.random.default_rng(seed)
        orders = []
        for _ in range(self.num_epochs):
            orders.append(rng.permutation(document_ids) if shuffle else document_ids)
        self.document_index = np.concatenate(orders)
        doc_lengths = dataset.sequence_lengths[self.document_index].astype(np.int64)
        self._doc_ends = np.cumsum(doc_lengths)
        self._doc_starts = self._doc_ends - doc_lengths
        self.shuffle_index = (
            # seed + 1: the sample order's generator is independent of the document order's.
            np.random.default_rng(seed + 1).permutation(num_samples)
            if shuffle
            else np.arange(num_samples)
        )

    @property
    def samples_per_epoch(self) -> int:
        # -1: every window needs one more token than it has inputs (the last label).
        return (self.tokens_per_epoch - 1) // self.seq_length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample ``index`` as int64 tokens of length ``seq_length + 1``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = int(self.shuffle_index[index]) * self.seq_length
        stop = start + self.seq_length + 1
        # The document holding token ``start``: first whose end lies beyond it.
        first = int(np.searchsorted(self._doc_ends, start, side="right"))
        pieces = []
        position = start
        k = first
        while position < stop:
            doc = int(self.document_index[k])
            offset = position - int(self._doc_starts[k])
            # A window may span several documents: take the rest of this one, up to the window's
            # end.
            take = min(stop - position, int(self._doc_ends[k]) - position)
            pieces.append(self.dataset.get(doc, offset, take))
            position += take
            k += 1
        return np.concatenate(pieces).astype(np.int64)
