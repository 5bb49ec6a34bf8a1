"""The bigram-entropy baseline of a token corpus.

``H(X_t | X_{t-1}) = -Σ_{a,b} p(a,b) ln p(b|a)`` over every adjacent token
pair of the corpus (documents concatenated in order, as training sees them),
in nats per token. It is what the best possible bigram model would score on
this very text (an in-sample, optimistic number): a language model whose
validation loss falls below it has learned more than which token follows
which.
"""

from __future__ import annotations

import math

import numpy as np


def bigram_entropy(tokens: np.ndarray) -> float:
    """Conditional entropy of the next token given the previous one, in nats per token."""
    tokens = np.asarray(tokens, dtype=np.int64).ravel()
    if tokens.size < 2:
        raise ValueError(f"bigram_entropy needs at least 2 tokens, got {tokens.size}")
    vocab = int(tokens.max()) + 1
    pairs = tokens[:-1] * vocab + tokens[1:]
    pair_ids, pair_counts = np.unique(pairs, return_counts=True)
    prev_counts = np.bincount(tokens[:-1], minlength=vocab)
    prev_of_pair = pair_ids // vocab
    total = pair_counts.sum()
    cond = pair_counts / prev_counts[prev_of_pair]
    return float(-(pair_counts / total * np.log(cond)).sum())


def nats_to_bits(value: float) -> float:
    return value / math.log(2)
