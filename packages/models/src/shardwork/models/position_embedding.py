"""Learned absolute position embedding (``position_embedding_type="learned_absolute"``; GPT-2,
Megatron's classic GPT): a ``[max_position_embeddings, h]`` table whose row ``p`` is added to
the word embedding of every token at position ``p``, on the first pipeline stage only.

- Replicated across TP (as Megatron does: the table is small, ``max_position_embeddings·h``),
  key ``embedding.position_embeddings.weight``. It is added *after* the word embedding's
  reduction over TP, so it counts once. Under sequence parallelism the word embedding is
  reduce-scattered along the sequence, and each TP rank adds the rows of its own chunk; its
  gradient is then a partial sum over the ranks' tokens, marked ``sequence_parallel`` so that
  ``finalize_model_grads`` all-reduces it over TP.
- Positions are global: a context-parallel rank's tokens are its two load-balanced chunks
  (:func:`~shardwork.models.context_parallel.local_positions`), and packed sequences
  (``cu_seqlens``) restart at 0 per document, as their RoPE positions do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwork.models.config import GPTConfig
from shardwork.models.module import ShardedModule
from shardwork.models.sharding import describe_param
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["LearnedPositionEmbedding"]


class LearnedPositionEmbedding(ShardedModule):
    """The table of learned absolute positions (see module docstring)."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        self.sequence_parallel = config.sequence_parallel
        self.weight = describe_param(
            torch.nn.Parameter(
                torch.empty(
                    (config.max_position_embeddings, config.hidden_size),
                    dtype=config.params_dtype,
                    device=device,
                )
            ),
            ParamMeta(sequence_parallel=config.sequence_parallel),
            init="normal",
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions [s_local]`` (global, int) -> ``[s_local(/tp under SP), 1, h]``, to add
        to the word embedding ``[s(/tp), b, h]`` (the same positions for every sequence)."""
        # GPTModel.forward checked the sequence length against max_position_embeddings
        # (check_sequence_length), so every position has a row.
        if self.sequence_parallel:
            # This TP rank's chunk of the sequence, as the word embedding's reduce-scatter
            # leaves it.
            tp = self.groups.size("tp")
            positions = positions.chunk(tp)[self.groups.rank("tp")]
        return F.embedding(positions, self.weight).unsqueeze(1)
