"""``GPTModel.forward`` refuses token ids outside the vocabulary, naming the position and value.

Ids at or above ``vocab_size`` but below the padded vocabulary used to run silently (they read a
padding row of the embedding; as labels they scored a logit no token has, the loss then being
``logsumexp`` of the row). Checked against an independent rule written here: a valid input id is
in ``[0, vocab_size)``, a valid label too or ``-100``.
"""

from __future__ import annotations

import re

import pytest
import torch

from shardwork.models import GPTModel, preset


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = preset("tiny-llama3-8b")
    assert config.padded_vocab_size > config.vocab_size  # padding rows exist to be misread
    return GPTModel(config)


def _ids(vocab, generator_seed=0):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(generator_seed))


@pytest.mark.parametrize("bad", ["vocab_size", "padded", "negative"])
def test_input_ids_outside_the_vocabulary_are_refused(model, bad):
    vocab = model.config.vocab_size
    ids = _ids(vocab)
    value = {"vocab_size": vocab, "padded": model.config.padded_vocab_size - 1, "negative": -1}
    ids[1, 5] = value[bad]
    pattern = rf"input_ids\[1, 5\]={value[bad]} is invalid: ids must be in \[0, {vocab}\)"
    with pytest.raises(ValueError, match=pattern):
        model(ids)


def test_labels_outside_the_vocabulary_are_refused(model):
    vocab = model.config.vocab_size
    labels = _ids(vocab, 1)
    labels[0, 3] = -100
    labels[0, 7] = vocab + 2
    with pytest.raises(ValueError, match=rf"labels\[0, 7\]={vocab + 2} .* or -100"):
        model(_ids(vocab), labels=labels)


def test_boundary_ids_and_ignored_labels_are_accepted(model):
    vocab = model.config.vocab_size
    ids = _ids(vocab)
    ids[0, 0], ids[1, -1] = 0, vocab - 1
    labels = _ids(vocab, 1)
    labels[:, -1] = -100
    loss_sum, tokens = model(ids, labels=labels)
    assert int(tokens) == 2 * 15 and torch.isfinite(loss_sum)


@pytest.mark.parametrize(
    ("ids", "pattern"),
    [
        (torch.zeros(2, 16), r"input_ids\.dtype=torch\.float32 is invalid: token ids must be"),
        (torch.zeros(16, dtype=torch.long), r"input_ids\.shape=\(16,\) is invalid: .*2-D"),
        ([[1, 2, 3]], r"input_ids must be a torch\.Tensor of token ids, got list"),
    ],
)
def test_input_ids_of_the_wrong_kind_are_refused(model, ids, pattern):
    with pytest.raises(ValueError, match=pattern):
        model(ids)


@pytest.mark.parametrize("name", ["input_ids", "labels"])
def test_range_check_is_a_device_assert_where_a_host_sync_would_be(model, monkeypatch, name):
    # Off the CPU (or while torch.compile traces forward) the range goes through
    # torch._assert_async, which needs no host sync; on a CPU tensor that assert raises at once,
    # so forcing the branch here shows its condition and message (a GPU session runs it for real).
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    vocab = model.config.vocab_size
    ids, labels = _ids(vocab), _ids(vocab, 1)
    labels[0, 2] = -100
    loss_sum, _ = model(ids, labels=labels)  # in range: the assert passes
    assert torch.isfinite(loss_sum)
    bad = {"input_ids": ids, "labels": labels}[name]
    bad[1, 4] = vocab
    allowed = f"[0, {vocab})" + (" or -100" if name == "labels" else "")
    with pytest.raises(RuntimeError, match=re.escape(f"{name} holds an id outside {allowed}")):
        model(ids, labels=labels)
