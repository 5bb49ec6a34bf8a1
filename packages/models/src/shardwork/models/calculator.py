"""Parameter, FLOPs and memory estimates for a ``GPTConfig`` at a layout (formulas below).

Notation: ``L`` layers, ``h`` hidden, ``a`` query heads, ``g`` kv heads, ``d`` head dim,
``f`` SwiGLU width, ``V`` vocab (real; padding excluded), ``s`` sequence, ``b`` micro-batch.

Parameters (exact, matches the model's real rows):
  per layer  ``P_L = h·(a+2g)·d [+ (a+2g)·d bias] + a·d·h + 3·h·f + 2·h [+ 2·d qk-norm]``
  total      ``P = L·P_L + V·h (embedding) + V·h (head, if untied) + h (final norm)``

Training FLOPs per token (matmuls only, forward + backward = 3 × forward):
  ``forward = 2·(L·(h·(a+2g)·d + a·d·h + 3·h·f) + V_pad·h) + L·4·s·a·d·c``
  (``V_pad``: the padded vocabulary, the work actually done), where the last term is QKᵀ and AV with ``c = 1/2`` for causal attention (only the lower
  triangle is useful work; the convention of FlashAttention/MFU reports). Full recompute
  adds one more forward of the layers.

Memory per GPU (bytes), ``tp``, ``pp``, ``dp``, ``cp``, ``sp``:
  weights   ``P_local · bytes(params_dtype)``; gradients ``P_local · 4`` (fp32 main_grad)
  optimizer ``P_local · 12 / dp`` (fp32 master + Adam moments, ZeRO-1 sharded over dp)
  activations per layer (bf16, Korthikanti et al. 2022, per micro-batch) without recompute:
  ``s·b·h·(10 + 24/tp + 5·a·s/(h·tp))`` scaled by ``1/cp``; with sequence parallelism the
  first term becomes ``10/tp``; selective recompute drops the ``5·a·s/(h·tp)`` term; full
  recompute keeps only the layer input ``2·s·b·h/(tp if sp else 1)``. Times ``L/pp``
  layers, and ×pp in-flight micro-batches on the first stage under 1F1B (the worst stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.models.config import GPTConfig

__all__ = ["MemoryEstimate", "flops_per_token", "memory_estimate", "num_parameters"]


def _layer_params(c: GPTConfig) -> int:
    d, a, g, h = c.kv_channels, c.num_attention_heads, c.kv_heads, c.hidden_size
    n = h * (a + 2 * g) * d + a * d * h + 3 * h * c.ffn_hidden_size + 2 * h
    if c.add_qkv_bias:
        n += (a + 2 * g) * d
    if c.qk_layernorm:
        n += 2 * d
    return n


def num_parameters(config: GPTConfig) -> int:
    """Exact number of (real, unpadded) parameters of the whole model."""
    if config.moe is not None or config.mla is not None or config.mtp is not None:
        from shardwork.models.calculator_moe import moe_param_counts

        return moe_param_counts(config).total  # MoE / MLA / MTP: see calculator_moe.py
    n = config.num_layers * _layer_params(config) + config.hidden_size
    n += config.vocab_size * config.hidden_size
    if not config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size
    return n


def flops_per_token(
    config: GPTConfig, seq_length: int, *, causal: bool = True, full_recompute: bool = False
) -> float:
    """Training FLOPs per token (forward + backward [+ recomputed forward])."""
    if config.moe is not None or config.mla is not None or config.mtp is not None:
        from shardwork.models.calculator_moe import moe_flops_per_token

        fwd_bwd = moe_flops_per_token(config, seq_length, causal=causal)
        return fwd_bwd * (4 / 3 if full_recompute else 1.0)  # recompute: one more forward
    c = config
    d, a, g, h = c.kv_channels, c.num_attention_heads, c.kv_heads, c.hidden_size
    matmul = c.num_layers * (h * (a + 2 * g) * d + a * d * h + 3 * h * c.ffn_hidden_size)
    head = c.padded_vocab_size * h
    attn = c.num_layers * 4 * seq_length * a * d * (0.5 if causal else 1.0)
    layers_fwd = 2 * matmul + attn
    fwd = layers_fwd + 2 * head
    return 3 * fwd + (layers_fwd if full_recompute else 0.0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the most loaded pipeline stage."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def memory_estimate(
    config: GPTConfig,
    *,
    seq_length: int,
    micro_batch_size: int,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    recompute: str | None = None,
) -> MemoryEstimate:
    """Memory per GPU (see module docstring for the formulas)."""
    c = config
    recompute = c.recompute if recompute is None else recompute
    layers_here = -(-c.num_layers // pp)
    emb = c.vocab_size * c.hidden_size
    stage0 = layers_here * _layer_params(c) / tp + emb / tp
    if pp == 1:
        stage0 += (0 if c.tie_word_embeddings else emb / tp) + c.hidden_size
    p_local = stage0
    bytes_param = c.params_dtype.itemsize
    s, b, h, a = seq_length / cp, micro_batch_size, c.hidden_size, c.num_attention_heads
    sp = c.sequence_parallel
    if recompute == "full":
        per_layer = 2 * s * b * h / (tp if sp else 1)
    else:
        per_layer = s * b * h * ((10 / tp if sp else 10) + 24 / tp)
        if recompute != "selective":
            per_layer += s * b * h * 5 * a * s / (h * tp)
    acts = per_layer * layers_here * pp  # 1F1B: pp micro-batches in flight on stage 0
    return MemoryEstimate(
        weights=p_local * bytes_param,
        gradients=p_local * 4,
        optimizer=p_local * 12 / dp,
        activations=acts,
    )
