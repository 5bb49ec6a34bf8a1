"""The bigram-entropy baseline of a token corpus.

``H(X_t | X_{t-1}) = -Σ_{a,b} p(a,b) ln p(b|a)`` over every adjacent token
pair of the corpus (documents concatenated in order, as training sees them),
in nats per token. It is what the best possible bigram model would score on
this very text (an in-sample, optimistic number): a language model whose
validation loss falls below it has learned more than which token follows
which.

A blend of corpora is scored as training samples it: :func:`blend_bigram_entropy` mixes each
corpus's pair frequencies by its normalised blend weight (a corpus of weight 0.9 counts nine
times one of 0.1, whatever their sizes), where concatenating them would weigh them by size.
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


def blend_bigram_entropy(parts: list[tuple[float, np.ndarray]]) -> float:
    """Conditional entropy (nats/token) of the blend ``[(weight, tokens), ...]``:
    ``p(a,b) = Σ_k w_k c_k(a,b) / n_k`` over each part's adjacent pairs ``c_k`` (``n_k`` of
    them), ``w`` the weights normalised; one part is :func:`bigram_entropy`."""
    parts = [(w, np.asarray(t, dtype=np.int64).ravel()) for w, t in parts if w > 0]
    parts = [(w, t) for w, t in parts if t.size >= 2]
    if not parts:
        raise ValueError("blend_bigram_entropy needs a part of weight > 0 with at least 2 tokens")
    vocab = max(int(t.max()) for _, t in parts) + 1
    total_weight = sum(w for w, _ in parts)
    ids, mass = [], []
    for weight, tokens in parts:
        pair_ids, counts = np.unique(tokens[:-1] * vocab + tokens[1:], return_counts=True)
        ids.append(pair_ids)
        mass.append(counts * (weight / total_weight / (tokens.size - 1)))
    pair_ids, where = np.unique(np.concatenate(ids), return_inverse=True)
    p_pair = np.bincount(where, weights=np.concatenate(mass))
    p_prev = np.bincount(pair_ids // vocab, weights=p_pair, minlength=vocab)
    return float(-(p_pair * np.log(p_pair / p_prev[pair_ids // vocab])).sum())


def nats_to_bits(value: float) -> float:
    return value / math.log(2)
