"""Fixtures shared by the trainer tests: small random indexed datasets on disk."""

import numpy as np
import pytest

from shardwork.trainer.data.indexed import IndexedDatasetWriter


def write_random_dataset(prefix, *, num_docs, seed, vocab=300, max_len=50):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(rng.integers(1, max_len))) for _ in range(num_docs)]
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    return docs


@pytest.fixture
def random_dataset(tmp_path):
    """(prefix, documents) of a 40-document random dataset."""
    prefix = tmp_path / "rand"
    docs = write_random_dataset(prefix, num_docs=40, seed=3)
    return str(prefix), docs
