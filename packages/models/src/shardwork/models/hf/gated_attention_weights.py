"""Gated-attention weights between Hugging Face's ``q_proj`` layout and shardwork's blocks.

Qwen3-Next's ``q_proj`` (``[nq·2d, h]``, bias ``[nq·2d]`` when ``attention_bias``) holds, for
each query head j in turn, the head's ``d`` query rows and then its ``d`` gate rows:
``[q_0 | g_0 | q_1 | g_1 | ...]`` (transformers views the output as ``[..., nq, 2d]`` and
chunks the last dim). shardwork keeps them apart as the ``q`` and ``gate`` blocks of
``linear_qkv`` (keys ``...linear_qkv.weight.q`` / ``...linear_qkv.weight.gate``, each
``[nq·d, h]`` in head order), so each TP rank holds whole heads of both.

Both functions act on the leading dimension only and work on any run of whole heads: rows
``[2·d·a, 2·d·c)`` of ``q_proj`` are heads ``a..c-1``, so an importer that reads one rank's
heads from a checkpoint slice can split just that slice (``num_heads = c - a``).
"""

from __future__ import annotations

import torch

__all__ = ["merge_gated_q_proj", "split_gated_q_proj"]


def _check(name: str, tensor: torch.Tensor, rows: int, num_heads: int, head_dim: int) -> None:
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"num_heads={num_heads} and head_dim={head_dim} must be >= 1")
    if tensor.dim() not in (1, 2) or tensor.shape[0] != rows:
        raise ValueError(
            f"{name}.shape={tuple(tensor.shape)} is invalid: it must be [{rows}] or "
            f"[{rows}, hidden] for num_heads={num_heads}, head_dim={head_dim}"
        )


def split_gated_q_proj(
    q_proj: torch.Tensor, *, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``q_proj`` weight or bias -> shardwork's ``(q, gate)`` blocks (new tensors)."""
    _check("q_proj", q_proj, 2 * num_heads * head_dim, num_heads, head_dim)
    rest = tuple(q_proj.shape[1:])
    # [nq·2d, ...] -> [nq, 2, d, ...]: index 0 of the second axis is the query, 1 the gate.
    per_head = q_proj.reshape(num_heads, 2, head_dim, *rest)
    q = per_head[:, 0].reshape(num_heads * head_dim, *rest).clone()
    gate = per_head[:, 1].reshape(num_heads * head_dim, *rest).clone()
    return q, gate


def merge_gated_q_proj(
    q: torch.Tensor, gate: torch.Tensor, *, num_heads: int, head_dim: int
) -> torch.Tensor:
    """shardwork's ``q`` and ``gate`` blocks -> HF ``q_proj`` (per head: query rows, gate rows)."""
    _check("q", q, num_heads * head_dim, num_heads, head_dim)
    _check("gate", gate, num_heads * head_dim, num_heads, head_dim)
    if q.shape != gate.shape:
        raise ValueError(
            f"q.shape={tuple(q.shape)} and gate.shape={tuple(gate.shape)} must be equal"
        )
    rest = tuple(q.shape[1:])
    pair = torch.stack(
        (q.reshape(num_heads, head_dim, *rest), gate.reshape(num_heads, head_dim, *rest)), dim=1
    )
    return pair.reshape(2 * num_heads * head_dim, *rest)
