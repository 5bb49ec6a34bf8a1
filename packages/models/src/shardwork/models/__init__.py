"""shardwork.models: dense GPT/Llama/Qwen models with tensor, sequence and context parallelism.

- :class:`GPTConfig` (validated dataclass), presets (:data:`PRESETS`, :func:`preset`).
- :class:`GPTModel`: a whole model or one pipeline stage (``layer_range``, ``pre_process``,
  ``post_process``), meta-device builds, layout-independent initialisation,
  ``sharded_state_dict()`` in global coordinates.
- Building blocks: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`, :class:`LMHead`, :class:`Attention`, :class:`SwiGLUMLP`,
  :class:`RMSNorm`, :class:`TransformerLayer`, :class:`TransformerBlock`.
- :class:`RNGTracker` and recompute :func:`checkpoint`; losses as (sum, count) with
  :func:`loss_for_backward` / :func:`reduce_loss`; context-parallel helpers.
- :mod:`shardwork.models.calculator` (FLOPs/memory), :mod:`shardwork.models.hf` (Hugging Face
  bridge), :mod:`shardwork.models.pipeline` (schedules; separate subpackage).
"""

from shardwork.models.attention import Attention, AttentionInputs
from shardwork.models.config import RECOMPUTE_MODES, GPTConfig, check_sequence_length
from shardwork.models.context_parallel import (
    attention_mask,
    local_positions,
    slice_for_context_parallel,
)
from shardwork.models.embedding import EMBEDDING_KEY, LMHead, VocabParallelEmbedding
from shardwork.models.gpt_model import GPTModel
from shardwork.models.logits import gather_logits
from shardwork.models.loss import loss_for_backward, reduce_loss, token_loss
from shardwork.models.mlp import SwiGLUMLP
from shardwork.models.module import ShardedModule, layout_groups
from shardwork.models.norm import RMSNorm
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.presets import PRESETS, PUBLISHED_PARAMS, preset
from shardwork.models.recompute import checkpoint
from shardwork.models.rng import REPLICATED, TENSOR_PARALLEL, RNGTracker
from shardwork.models.transformer_layer import TransformerBlock, TransformerLayer

__version__ = "0.1.0"

__all__ = [
    "EMBEDDING_KEY",
    "PRESETS",
    "PUBLISHED_PARAMS",
    "RECOMPUTE_MODES",
    "REPLICATED",
    "TENSOR_PARALLEL",
    "Attention",
    "AttentionInputs",
    "ColumnParallelLinear",
    "GPTConfig",
    "GPTModel",
    "LMHead",
    "RMSNorm",
    "RNGTracker",
    "RowParallelLinear",
    "ShardedModule",
    "SwiGLUMLP",
    "TransformerBlock",
    "TransformerLayer",
    "VocabParallelEmbedding",
    "attention_mask",
    "check_sequence_length",
    "checkpoint",
    "gather_logits",
    "layout_groups",
    "local_positions",
    "loss_for_backward",
    "preset",
    "reduce_loss",
    "slice_for_context_parallel",
    "token_loss",
]
