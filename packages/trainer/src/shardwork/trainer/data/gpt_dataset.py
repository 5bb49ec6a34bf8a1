"""GPT samples: documents concatenated into fixed-length token windows.

- The documents of one split are shuffled with the seed and laid end to end,
  one shuffled copy per epoch, as many epochs as the requested number of
  samples needs. Sample ``j`` of that stream is tokens
  ``[j*L, j*L + L + 1)``: ``L`` inputs and, shifted by one, ``L`` labels
  (consecutive samples share one boundary token, as in Megatron).
- The order of samples is shuffled again with the seed, block by block:
  stream samples ``[b*B, (b+1)*B)`` are read in an order drawn from
  ``(seed, b)`` alone, ``B`` being one epoch's samples (at most
  :data:`SHUFFLE_BLOCK`). So the first ``n`` samples are the same whatever
  the number of samples asked for: a run extended to more steps, or resumed
  with another batch size, reads on where the shorter run stopped instead of
  a reshuffled order. ``shuffle=False`` keeps stream order (evaluation).
  ``sample_order="whole"`` is the earlier versions' order (one shuffle
  drawn over all ``num_samples``, as Megatron-LM's), kept so that a
  checkpoint of that order resumes into the run it came from.
- Everything is a pure function of (documents, lengths, L, seed): every rank
  builds the same index, and any sample can be read at any time, which is
  what makes runs resumable at any step.
- Indices are numpy arrays built in O(documents × epochs); a block's order
  is drawn when it is first read. Token reads go through the memory-mapped
  :class:`IndexedDataset`.
"""

from __future__ import annotations

import numpy as np

from shardwork.trainer.data.indexed import IndexedDataset

#: The most samples one shuffle block holds (2**22 windows of 4,096 tokens: 17 B tokens, whose
#: order, 32 MiB of int64, is drawn in ~0.3 s when the block is first read).
SHUFFLE_BLOCK = 1 << 22

#: ``sample_order`` values: shuffled per block (see the module docstring), or over all samples.
SAMPLE_ORDERS = ("blocks", "whole")


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
        sample_order: str = "blocks",
        name: str = "",
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        if sample_order not in SAMPLE_ORDERS:
            raise ValueError(f"sample_order={sample_order!r}; valid: {list(SAMPLE_ORDERS)}")
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
        self.seed = seed
        self.shuffle = shuffle
        self.sample_order = sample_order
        if sample_order == "whole":
            self.block_size = max(1, num_samples)
        else:
            self.block_size = max(1, min(self.samples_per_epoch, SHUFFLE_BLOCK))
        # The stream covers whole blocks: a block's order is drawn over all its samples, even
        # those past num_samples, so it does not depend on num_samples.
        blocks = -(-num_samples // self.block_size)
        stream_samples = blocks * self.block_size if shuffle else num_samples
        # +1: the last sample's final label is one token past its window.
        needed = stream_samples * seq_length + 1
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
        self._block: tuple[int, np.ndarray] | None = None

    @property
    def samples_per_epoch(self) -> int:
        # -1: every window needs one more token than it has inputs (the last label).
        return (self.tokens_per_epoch - 1) // self.seq_length

    def __len__(self) -> int:
        return self.num_samples

    def stream_position(self, index: int) -> int:
        """The stream sample (window ``[j*L, j*L + L + 1)``) that sample ``index`` reads."""
        if not self.shuffle:
            return index
        block, within = divmod(index, self.block_size)
        if self._block is None or self._block[0] != block:
            # (seed + 1, block): independent of the document order's generator, and of every
            # other block's ("whole": the earlier versions' one generator).
            key = self.seed + 1 if self.sample_order == "whole" else (self.seed + 1, block)
            rng = np.random.default_rng(key)
            self._block = (block, rng.permutation(self.block_size))
        return block * self.block_size + int(self._block[1][within])

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample ``index`` as int64 tokens of length ``seq_length + 1``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = self.stream_position(index) * self.seq_length
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
