"""Soft-capping: ``cap·tanh(x / cap)``, Gemma 2's bound on attention scores and final logits.

It keeps values inside ``(-cap, cap)`` while staying close to the identity for ``|x| << cap``.
The operation order (divide, tanh, multiply) is Hugging Face's, so results match transformers
bit for bit at the same dtype. Attention applies it to the scaled scores before the mask
(:mod:`shardwork.models.attention`); the LM head to its logits before padded columns are masked
(:class:`~shardwork.models.embedding.LMHead`).
"""

from __future__ import annotations

import torch

__all__ = ["soft_cap"]


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap·tanh(x / cap)`` in ``x``'s dtype; ``x`` unchanged when ``cap`` is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap
