"""Indexed datasets: byte-identical to Megatron-Core's writer, readable both ways."""

from pathlib import Path

import numpy as np
import pytest

from shardwork.trainer.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype_for

FIXTURE = Path(__file__).with_name("fixtures") / "mcore_small"


def _fixture_documents():
    # Same generator as fixtures/make_mcore_indexed.py, which Megatron-Core wrote.
    rng = np.random.default_rng(20261122)
    return [rng.integers(0, 50000, size=int(rng.integers(1, 40))) for _ in range(23)]


def test_reads_megatron_written_dataset():
    ds = IndexedDataset(FIXTURE)
    docs = _fixture_documents()
    assert len(ds) == len(docs)
    assert ds.dtype == np.uint16
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    assert ds.num_tokens == sum(len(d) for d in docs)
    np.testing.assert_array_equal(ds.get(5, 2, 3), docs[5][2:5])


def test_writer_is_byte_identical_to_megatron(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ours", dtype=np.uint16) as writer:
        for doc in _fixture_documents():
            writer.add_document(doc)
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / f"ours{suffix}").read_bytes()
        theirs = Path(str(FIXTURE) + suffix).read_bytes()
        assert ours == theirs, suffix


def test_roundtrip_int32_and_empty_document(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200_000, size=n) for n in (5, 0, 17)]
    assert token_dtype_for(200_000) == np.int32
    with IndexedDatasetWriter(tmp_path / "d", dtype=token_dtype_for(200_000)) as writer:
        for doc in docs:
            writer.add_document(doc)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.int32
    for got, want in zip((ds[i] for i in range(len(ds))), docs):
        np.testing.assert_array_equal(got, want)


def test_interrupted_write_leaves_no_dataset(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "x") as writer:
        writer.add_document([1, 2, 3])
        raise RuntimeError("boom")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()


def test_bad_prefix_and_header(tmp_path):
    with pytest.raises(ValueError, match="shardwork-preprocess"):
        IndexedDataset(tmp_path / "missing")
    (tmp_path / "bad.bin").write_bytes(b"")
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" * 4)
    with pytest.raises(ValueError, match="MMIDIDX"):
        IndexedDataset(tmp_path / "bad")
