"""GPT sample index, splits, blending, per-rank micro-batches and the bigram baseline."""

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shardwork.trainer.data.baseline import bigram_entropy, blend_bigram_entropy
from shardwork.trainer.data.blend import blend_index
from shardwork.trainer.data.builder import (
    build_blend,
    micro_batch,
    read_data_config,
    split_components,
    split_documents,
)
from shardwork.trainer.data.gpt_dataset import GPTDataset
from shardwork.trainer.data.indexed import IndexedDataset


def _gpt(prefix, docs_ids, **kw):
    return GPTDataset(IndexedDataset(prefix), docs_ids, **kw)


def test_samples_are_windows_of_the_shuffled_document_stream(random_dataset):
    prefix, docs = random_dataset
    ids = np.arange(5, 35)
    ds = _gpt(prefix, ids, seq_length=16, num_samples=200, seed=11)
    # independent oracle: concatenate the documents in the index's order
    stream = np.concatenate([docs[d] for d in ds.document_index])
    positions = [ds.stream_position(i) for i in range(len(ds))]
    for i, j in enumerate(positions):
        np.testing.assert_array_equal(ds[i], stream[j * 16 : j * 16 + 17])
    # every epoch holds each split document exactly once
    per_epoch = ds.document_index.reshape(ds.num_epochs, -1)
    for epoch in per_epoch:
        assert sorted(epoch.tolist()) == ids.tolist()
    assert ds.num_epochs > 1
    # each whole block of one epoch's samples is read exactly once, in a shuffled order
    block = ds.samples_per_epoch
    assert ds.block_size == block == (sum(len(docs[d]) for d in ids) - 1) // 16
    for start in range(0, 200 - block + 1, block):
        chunk = positions[start : start + block]
        assert sorted(chunk) == list(range(start, start + block))
        assert chunk != sorted(chunk)
    assert len(set(positions)) == 200


def test_a_longer_dataset_starts_with_the_shorter_ones_samples(random_dataset):
    """The order does not depend on the number of samples: a run extended to more steps (or
    resumed with another batch size) reads on where the shorter one stopped."""
    prefix, _ = random_dataset
    ids = np.arange(3, 40)
    short = _gpt(prefix, ids, seq_length=8, num_samples=37, seed=4)
    long = _gpt(prefix, ids, seq_length=8, num_samples=1000, seed=4)
    assert long.num_epochs > short.num_epochs
    for i in range(37):
        np.testing.assert_array_equal(short[i], long[i])
    # and the longer one's later samples are not the first ones again
    first = {tuple(short[i].tolist()) for i in range(37)}
    assert not first & {tuple(long[i].tolist()) for i in range(37, long.block_size)}


def test_index_is_deterministic_and_seed_dependent(random_dataset):
    prefix, _ = random_dataset
    a = _gpt(prefix, np.arange(40), seq_length=8, num_samples=50, seed=1)
    b = _gpt(prefix, np.arange(40), seq_length=8, num_samples=50, seed=1)
    c = _gpt(prefix, np.arange(40), seq_length=8, num_samples=50, seed=2)
    assert all(np.array_equal(a[i], b[i]) for i in range(50))
    assert not all(np.array_equal(a[i], c[i]) for i in range(50))
    unshuffled = _gpt(prefix, np.arange(40), seq_length=8, num_samples=50, seed=1, shuffle=False)
    np.testing.assert_array_equal(unshuffled.document_index[:40], np.arange(40))


def test_split_documents_proportions():
    got = split_documents(100, "90,10,0")
    assert got["train"].tolist() == list(range(90))
    assert got["valid"].tolist() == list(range(90, 100))
    assert got["test"].size == 0
    got = split_documents(79, "969,30,1")
    assert got["train"].size + got["valid"].size + got["test"].size == 79
    assert got["train"][-1] + 1 == got["valid"][0]


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 2], [0.05, 0.5, 0.45]])
def test_blend_proportions_hold_on_every_prefix(weights):
    size = 997
    owner, ordinal = blend_index(weights, size)
    w = np.asarray(weights, float) / sum(weights)
    for n in (1, 10, 100, 500, size):
        counts = np.bincount(owner[:n], minlength=len(w))
        assert np.all(np.abs(counts - n * w) <= 1.0 + 1e-9), (n, counts, n * w)
    # each component's samples are taken in order 0, 1, 2, ...
    for d in range(len(w)):
        assert ordinal[owner == d].tolist() == list(range(int((owner == d).sum())))


def test_blend_of_two_prefixes_uses_both_in_proportion(tmp_path):
    from shardwork.trainer.data.indexed import IndexedDatasetWriter

    for name, token in (("a", 1), ("b", 2)):
        with IndexedDatasetWriter(tmp_path / name) as writer:
            for n in range(30):
                writer.add_document([token] * (5 + n % 7))
    data = SimpleNamespace(
        data_config=None,
        prefixes=[str(tmp_path / "a"), str(tmp_path / "b")],
        weights=[1.0, 3.0],
        split="80,20,0",
        corpus=None,
        cache_dir=None,
    )
    comps = split_components(data)
    assert [c.documents.tolist() for c in comps["valid"]] == [list(range(24, 30))] * 2
    blend = build_blend(comps["train"], size=400, seq_length=4, seed=5, shuffle=True)
    first = np.array([blend[i][0] for i in range(400)])
    assert abs((first == 1).sum() - 100) <= 1 and abs((first == 2).sum() - 300) <= 1


def test_micro_batches_tile_the_global_batch_for_any_dp(random_dataset):
    prefix, _ = random_dataset
    ds = _gpt(prefix, np.arange(40), seq_length=8, num_samples=64, seed=0)
    consumed, gbs, mbs = 16, 16, 2
    for dp in (1, 2, 4):
        rows = []
        for r in range(dp):
            for m in range(gbs // (mbs * dp)):
                batch = micro_batch(
                    ds, consumed=consumed, index=m, micro_batch_size=mbs, dp_rank=r, dp_size=dp
                )
                assert batch.shape == (mbs, 9)
                rows += [tuple(x) for x in batch.tolist()]
        want = {tuple(ds[i].tolist()) for i in range(consumed, consumed + gbs)}
        assert set(rows) == want and len(rows) == gbs


def test_read_data_config(tmp_path, monkeypatch):
    path = tmp_path / "blend.json"
    path.write_text('{"train": [[0.5, "a"], [0.5, "b"]], "valid": {"c": 1}}')
    assert read_data_config(path) == {"train": [(0.5, "a"), (0.5, "b")], "valid": [(1.0, "c")]}
    # no shell reads the file: a leading ~ is the home directory, as in the config's paths
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path.write_text('{"train": [[1, "~/data/a"], [1, "x/~b"]]}')
    home_a = str(tmp_path / "home" / "data" / "a")
    assert read_data_config(path) == {"train": [(1.0, home_a), (1.0, "x/~b")]}
    path.write_text('{"valid": [[1, "c"]]}')
    with pytest.raises(ValueError, match='"train"'):
        read_data_config(path)
    path.write_text('{"train": [[1, "a"]], "dev": []}')
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        read_data_config(path)


def _blend_entropy_by_counting(parts) -> float:
    """The blend's bigram entropy from pair counts in plain Python (the test's own oracle)."""
    total = sum(w for w, _ in parts)
    p_pair: dict[tuple[int, int], float] = {}
    for weight, tokens in parts:
        pairs = list(zip(tokens[:-1].tolist(), tokens[1:].tolist()))
        for pair in pairs:
            p_pair[pair] = p_pair.get(pair, 0.0) + weight / total / len(pairs)
    p_prev: dict[int, float] = {}
    for (a, _), value in p_pair.items():
        p_prev[a] = p_prev.get(a, 0.0) + value
    return -sum(v * math.log(v / p_prev[a]) for (a, _), v in p_pair.items())


def test_blend_bigram_entropy_weighs_each_corpus_by_its_blend_weight():
    rng = np.random.default_rng(5)
    # two corpora of other statistics and sizes: a skewed one and a near-uniform one
    skewed = rng.choice(6, size=3000, p=[0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    uniform = rng.integers(0, 9, size=700)
    for weights in ((0.9, 0.1), (0.1, 0.9), (0.5, 0.5)):
        parts = list(zip(weights, (skewed, uniform)))
        got = blend_bigram_entropy(parts)
        assert got == pytest.approx(_blend_entropy_by_counting(parts), rel=1e-12)
    assert blend_bigram_entropy([(2.0, skewed)]) == pytest.approx(bigram_entropy(skewed), rel=1e-12)
    # equal-sized corpora weighted 3:2 are the pairs of the first three times and of the
    # second twice: a concatenation, up to its 4 boundary pairs among ~3,500 (measured 4.5e-4
    # apart; the weights swapped, 0.16)
    a, b = skewed[:700], uniform
    repeated = np.concatenate([a, b, a, b, a])
    got = blend_bigram_entropy([(3, a), (2, b)])
    assert got == pytest.approx(bigram_entropy(repeated), abs=5e-3)
    # weights, not sizes: concatenation weighs the larger corpus 3000:700
    size_weighted = bigram_entropy(np.concatenate([skewed, uniform]))
    assert abs(blend_bigram_entropy([(0.1, skewed), (0.9, uniform)]) - size_weighted) > 0.3


def test_bigram_entropy_matches_direct_formula():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 7, size=5000)
    counts = np.zeros((7, 7))
    for a, b in itertools.pairwise(tokens):
        counts[a, b] += 1
    total = counts.sum()
    want = 0.0
    for a in range(7):
        for b in range(7):
            if counts[a, b]:
                want -= counts[a, b] / total * math.log(counts[a, b] / counts[a].sum())
    assert bigram_entropy(tokens) == pytest.approx(want, rel=1e-12)
    # a deterministic cycle has zero conditional entropy
    assert bigram_entropy(np.tile([0, 1, 2], 50)) == pytest.approx(0.0, abs=1e-12)


def test_builtin_corpus_is_cached_per_version_of_its_text(tmp_path, monkeypatch):
    """The pydoc text differs between Python patch releases: each version gets its own cached
    dataset, holding that version's documents, and the first version's stays as it was."""
    from shardwork.trainer.data import corpus
    from shardwork.trainer.data.tokenizer import ByteTokenizer

    def documents(prefix):
        dataset = IndexedDataset(prefix)
        return [ByteTokenizer().decode(dataset[i].tolist()) for i in range(len(dataset))]

    first = corpus.builtin_corpus("pydoc", tmp_path)
    first_docs = documents(first)
    assert first_docs == [corpus.topics[key] for key in sorted(corpus.topics)]
    # Another Python's text: one topic rewritten, one added.
    other_topics = dict(corpus.topics)
    some_key = sorted(other_topics)[3]
    other_topics[some_key] = other_topics[some_key].replace("the", "THE")
    other_topics["zz-new-topic"] = "a topic this Python adds"
    monkeypatch.setattr(corpus, "topics", other_topics)
    monkeypatch.setattr(corpus, "corpus_digest", corpus.corpus_digest.__wrapped__)
    second = corpus.builtin_corpus("pydoc", tmp_path)
    assert second != first
    assert documents(second) == [other_topics[key] for key in sorted(other_topics)]
    assert documents(first) == first_docs
    # The same text finds its dataset again rather than writing another.
    assert corpus.builtin_corpus("pydoc", tmp_path) == second
    stems = {path.name.split(".")[0] for path in tmp_path.iterdir()}
    assert stems == {Path(first).name, Path(second).name}
