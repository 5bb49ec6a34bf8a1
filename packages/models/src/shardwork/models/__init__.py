"""shardwork.models: GPT/Llama/Qwen/Mixtral/DeepSeek models with tensor, sequence, context,
pipeline and expert parallelism.

- :class:`GPTConfig` (validated dataclass), presets (:data:`PRESETS`, :func:`preset`).
- :class:`GPTModel`: a whole model or one pipeline stage (``layer_range``, ``pre_process``,
  ``post_process``), meta-device builds, layout-independent initialisation,
  ``sharded_state_dict()`` in global coordinates.
- Building blocks: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`, :class:`LMHead`, :class:`Attention`, :class:`SwiGLUMLP`,
  :class:`SquaredReLUMLP`, :class:`GeLUMLP`, :class:`RMSNorm`, :class:`LayerNorm`,
  :class:`LearnedPositionEmbedding`, :class:`TransformerLayer`, :class:`TransformerBlock`.
- Composition: :class:`DecoderSpec` / :class:`LayerSpec` and :func:`spec_for` (which parts
  each layer has), :func:`register_mixer` / :func:`register_mlp` / :func:`register_norm` (new part kinds).
- :func:`compile_blocks` (``torch.compile`` per transformer layer), :func:`compile_report`;
- :class:`RNGTracker` and recompute :func:`checkpoint`; losses as (sum, count) with
  :func:`loss_for_backward` / :func:`reduce_loss`; context-parallel helpers; block masks
  (:class:`BlockMask`, :func:`build_block_mask`) and :func:`block_attention` (packed documents,
  context parallelism and sliding windows without an ``[s, s]`` mask).
- Mixture of experts (:class:`MoEConfig`, :class:`MoELayer`, :func:`moe_finalize_kwargs`,
  :func:`expert_load`; more in :mod:`shardwork.models.moe`), multi-head latent attention
  (:class:`MLAConfig`, :class:`MLAttention`), multi-token prediction (:class:`MTPConfig`,
  :class:`MultiTokenPrediction`, :func:`reduce_mtp_losses`), MoE presets
  (:data:`MOE_PRESETS`, :data:`PUBLISHED_MOE_PARAMS`; also in :data:`PRESETS`).
- Calculator: :func:`num_parameters`, :func:`flops_per_token`, :func:`memory_estimate`,
  :func:`moe_param_counts` (formulas in :mod:`shardwork.models.calculator`,
  :mod:`shardwork.models.calculator_moe`, :mod:`shardwork.models.calculator_memory`);
  :mod:`shardwork.models.hf` (Hugging Face bridge), :mod:`shardwork.models.pipeline`
  (schedules; separate subpackage).
"""

from shardwork.models.attention import Attention, AttentionInputs
from shardwork.models.block_compile import (
    CompileReport,
    compile_blocks,
    compile_problem,
    compile_report,
)
from shardwork.models.block_mask import BlockMask, build_block_mask
from shardwork.models.calculator import (
    MemoryEstimate,
    flops_per_token,
    memory_estimate,
    num_parameters,
)
from shardwork.models.calculator_memory import (
    LocalParams,
    kv_cache_bytes_per_token,
    local_parameters,
    recurrent_state_bytes,
)
from shardwork.models.calculator_moe import ParamCounts, moe_param_counts
from shardwork.models.config import RECOMPUTE_MODES, GPTConfig, check_sequence_length
from shardwork.models.context_parallel import (
    gather_in_position_order,
    local_positions,
    slice_for_context_parallel,
)
from shardwork.models.deltanet_config import GatedDeltaNetConfig
from shardwork.models.embedding import EMBEDDING_KEY, LMHead, VocabParallelEmbedding
from shardwork.models.gelu_mlp import GeLUMLP
from shardwork.models.gpt_model import GPTModel
from shardwork.models.layer_kinds import BuildContext, register_mixer, register_mlp, register_norm
from shardwork.models.layer_norm import LayerNorm
from shardwork.models.logits import gather_logits
from shardwork.models.lora import (
    apply_lora,
    is_lora_key,
    load_lora_state,
    lora_state_dict,
    merge_lora,
    unmerge_lora,
)
from shardwork.models.lora_checkpoint import load_lora_checkpoint, save_lora_checkpoint
from shardwork.models.lora_config import LoRAConfig, lora_key_names
from shardwork.models.loss import loss_for_backward, reduce_loss, token_loss
from shardwork.models.mamba import Mamba2Mixer, MambaState
from shardwork.models.mamba_config import MambaConfig
from shardwork.models.masked_attention import block_attention
from shardwork.models.mla import MLAttention
from shardwork.models.mla_config import MLAConfig
from shardwork.models.mlp import SwiGLUMLP
from shardwork.models.module import ShardedModule, layout_groups
from shardwork.models.moe import MoEConfig, MoELayer, expert_load, moe_finalize_kwargs
from shardwork.models.mtp import MultiTokenPrediction, reduce_mtp_losses
from shardwork.models.mtp_config import MTPConfig
from shardwork.models.norm import RMSNorm
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.position_embedding import LearnedPositionEmbedding
from shardwork.models.presets import PRESETS, PUBLISHED_PARAMS, preset
from shardwork.models.presets_moe import MOE_PRESETS, PUBLISHED_MOE_PARAMS
from shardwork.models.recompute import RecomputeReplay, checkpoint
from shardwork.models.rng import REPLICATED, TENSOR_PARALLEL, RNGTracker
from shardwork.models.spec import DecoderSpec, LayerSpec, RotarySpec, spec_for
from shardwork.models.squared_relu_mlp import SquaredReLUMLP
from shardwork.models.token_ids import TokenIds
from shardwork.models.transformer_layer import TransformerBlock, TransformerLayer

__version__ = "0.1.0"

__all__ = [
    "EMBEDDING_KEY",
    "MOE_PRESETS",
    "PRESETS",
    "PUBLISHED_MOE_PARAMS",
    "PUBLISHED_PARAMS",
    "RECOMPUTE_MODES",
    "REPLICATED",
    "TENSOR_PARALLEL",
    "Attention",
    "AttentionInputs",
    "BlockMask",
    "BuildContext",
    "ColumnParallelLinear",
    "CompileReport",
    "DecoderSpec",
    "GPTConfig",
    "GPTModel",
    "GatedDeltaNetConfig",
    "GeLUMLP",
    "LMHead",
    "LayerNorm",
    "LayerSpec",
    "LearnedPositionEmbedding",
    "LoRAConfig",
    "LocalParams",
    "MLAConfig",
    "MLAttention",
    "MTPConfig",
    "Mamba2Mixer",
    "MambaConfig",
    "MambaState",
    "MemoryEstimate",
    "MoEConfig",
    "MoELayer",
    "MultiTokenPrediction",
    "ParamCounts",
    "RMSNorm",
    "RNGTracker",
    "RecomputeReplay",
    "RotarySpec",
    "RowParallelLinear",
    "ShardedModule",
    "SquaredReLUMLP",
    "SwiGLUMLP",
    "TokenIds",
    "TransformerBlock",
    "TransformerLayer",
    "VocabParallelEmbedding",
    "apply_lora",
    "block_attention",
    "build_block_mask",
    "check_sequence_length",
    "checkpoint",
    "compile_blocks",
    "compile_problem",
    "compile_report",
    "expert_load",
    "flops_per_token",
    "gather_in_position_order",
    "gather_logits",
    "is_lora_key",
    "kv_cache_bytes_per_token",
    "layout_groups",
    "load_lora_checkpoint",
    "load_lora_state",
    "local_parameters",
    "local_positions",
    "lora_key_names",
    "lora_state_dict",
    "loss_for_backward",
    "memory_estimate",
    "merge_lora",
    "moe_finalize_kwargs",
    "moe_param_counts",
    "num_parameters",
    "preset",
    "recurrent_state_bytes",
    "reduce_loss",
    "reduce_mtp_losses",
    "register_mixer",
    "register_mlp",
    "register_norm",
    "save_lora_checkpoint",
    "slice_for_context_parallel",
    "spec_for",
    "token_loss",
    "unmerge_lora",
]
