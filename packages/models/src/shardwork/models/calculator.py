"""Parameter, FLOPs and memory estimates for a ``GPTConfig`` at a layout (formulas below).

Notation: ``L`` layers, ``h`` hidden, ``a`` query heads, ``g`` kv heads, ``d`` head dim,
``f`` MLP width, ``V`` vocab (real; padding excluded), ``s`` sequence, ``b`` micro-batch,
``q`` query-sized blocks of the QKV projection (2 with ``attention_output_gate``: Q and the
gate; else 1), ``m`` matrices of the dense MLP (3 SwiGLU, 2 ``mlp_activation="relu2"`` or
``"gelu_tanh"``), ``n`` elements of a norm (``h`` RMSNorm, ``2h`` LayerNorm), ``P`` rows of the
learned position table (``max_position_embeddings``; 0 unless ``learned_absolute``).

Parameters (exact, matches the model's real rows):
  per layer  ``P_L = h·(q·a+2g)·d [+ (q·a+2g)·d bias] + a·d·h [+ h proj bias] + m·h·f
             [+ (m−1)·f + h MLP bias] + 2·k·n [+ 2·d qk-norm]`` (``k`` norms per part: 2 with
             ``sandwich_norm``, else 1)
  total      ``P = L·P_L + V·h (embedding) + P·h (positions) + V·h (head, if untied)
             + n (final norm)``

Training FLOPs per token (matmuls only, forward + backward = 3 × forward):
  ``forward = 2·(L·(h·(q·a+2g)·d + a·d·h + m·h·f) + V_h·h) + Σ_layers 4·a·d·k``
  (``V_h``: the columns the head multiplies, the work actually done: the real ``V`` with the
  fused linear cross-entropy, which skips the padding, the padded ``V_pad`` without it; biases,
  norms and the position lookup are no matmuls and add nothing), where the last term is QKᵀ and AV
  with ``k = s·c`` keys per query, ``c = 1/2`` for causal attention (only the lower triangle is
  useful work; the convention of FlashAttention/MFU reports), and ``k = W − W²/(2s)`` for a
  causal sliding-window layer with window ``W < s``
  (:func:`~shardwork.models.calculator_layers.attended_keys`; the MoE/MLA/hybrid calculator
  counts full causal attention in every layer). Full recompute
  adds one more forward of the layers. The fused loss's own recomputed logits (MTP depths and
  low-precision heads, ``2·V·h`` per head) are recompute too and not counted.

Memory per GPU: :func:`memory_estimate`, formulas in :mod:`shardwork.models.calculator_memory`
(exact local parameters of dense, MoE, MLA and MTP models at tp/pp/ep/etp; gradients in fp32;
ZeRO-1 optimizer state over dp×cp for dense and edp for expert parameters; activations as
the tensors this implementation saves for backward, checked against saved-tensor hooks).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.models.calculator_layers import (
    attended_keys,
    head_columns,
    mlp_bias_params,
    mlp_matrices,
    norm_params,
    norms_per_part,
    position_params,
    proj_bias_params,
    query_blocks,
)
from shardwork.models.calculator_memory import local_parameters, stage_activation_bytes
from shardwork.models.calculator_moe import moe_flops_per_token, moe_param_counts
from shardwork.models.config import RECOMPUTE_MODES, GPTConfig
from shardwork.models.pipeline.plan import peak_in_flight

__all__ = ["MemoryEstimate", "flops_per_token", "memory_estimate", "num_parameters"]


def _layer_params(c: GPTConfig) -> int:
    d, a, g, h = c.kv_channels, c.num_attention_heads, c.kv_heads, c.hidden_size
    qa, f = query_blocks(c) * a, c.ffn_hidden_size
    n = h * (qa + 2 * g) * d + a * d * h + mlp_matrices(c) * h * f + mlp_bias_params(c)
    n += 2 * norms_per_part(c) * norm_params(c) + proj_bias_params(c)
    if c.add_qkv_bias:
        n += (qa + 2 * g) * d
    if c.qk_layernorm:
        n += 2 * d
    return n


def _not_plain_dense(c: GPTConfig) -> bool:
    """Whether the config needs the layer-by-layer counts of calculator_moe.py."""
    parts = (c.moe, c.mla, c.mtp, c.hybrid_layer_pattern)
    return any(part is not None for part in parts)


def num_parameters(config: GPTConfig) -> int:
    """Exact number of (real, unpadded) parameters of the whole model."""
    if _not_plain_dense(config):
        return moe_param_counts(config).total  # MoE / MLA / MTP: see calculator_moe.py
    n = config.num_layers * _layer_params(config) + norm_params(config)
    n += config.vocab_size * config.hidden_size + position_params(config)
    if not config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size
    return n


def flops_per_token(
    config: GPTConfig, seq_length: int, *, causal: bool = True, full_recompute: bool = False
) -> float:
    """Training FLOPs per token (forward + backward [+ recomputed forward])."""
    if _not_plain_dense(config):
        return moe_flops_per_token(config, seq_length, causal=causal, full_recompute=full_recompute)
    c = config
    d, a, g, h = c.kv_channels, c.num_attention_heads, c.kv_heads, c.hidden_size
    qa, mlp = query_blocks(c) * a, mlp_matrices(c) * h * c.ffn_hidden_size
    matmul = c.num_layers * (h * (qa + 2 * g) * d + a * d * h + mlp)
    head = head_columns(c) * h
    # QKᵀ and AV: each 2·d FLOPs per attended key per query per head (a multiply-add per
    # element); sliding-window layers attend fewer keys.
    keys = sum(attended_keys(c, i, seq_length, causal) for i in range(c.num_layers))
    attn = 4 * a * d * keys
    # 2 FLOPs (multiply + add) per weight per token in a matmul.
    layers_fwd = 2 * matmul + attn
    fwd = layers_fwd + 2 * head
    # Backward costs two forwards (input and weight gradients), hence 3×: the 6·N per token of
    # Kaplan et al. 2020 (sec. 2.1) and Narayanan et al. 2021's FLOPs formula.
    return 3 * fwd + (layers_fwd if full_recompute else 0.0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on one pipeline rank (by default the most loaded one)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    params: int = 0
    """Parameter elements on the rank (dense + expert, padded vocabulary rows included)."""
    expert_params: int = 0
    """Of which routed-expert elements (optimizer state sharded over edp)."""
    pp_rank: int = 0
    """The pipeline rank these numbers are for."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")


def memory_estimate(
    config: GPTConfig,
    *,
    seq_length: int,
    micro_batch_size: int,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    vpp: int | None = None,
    pp_rank: int | None = None,
    num_microbatches: int | None = None,
    recompute: str | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
) -> MemoryEstimate:
    """Memory per GPU (formulas: :mod:`shardwork.models.calculator_memory`).

    ``dp`` is the data-parallel size without cp (world ``= tp·cp·dp·pp``); experts shard over
    ``ep × etp`` (``etp`` defaults to ``tp``) and their optimizer state over
    ``edp = tp·cp·dp/(ep·etp)``. ``pp_rank=None`` returns the rank with the largest total.
    Activations: the most a rank holds at once under the trainer's schedule
    (``shardwork.models.pipeline.peak_in_flight``): under 1F1B ``min(pp − r, num_microbatches)``
    micro-batches on rank ``r`` (``num_microbatches`` defaults to ``pp``) times one
    micro-batch's saved tensors; interleaved (``vpp > 1``), the walk of Megatron's order with
    each chunk's own bytes (about ``1 + (pp − 1)/(pp·vpp)`` times the 1F1B count with even
    chunks, Narayanan et al. 2021 §2.2.2). ``first_stage_layers`` / ``last_stage_layers`` /
    ``first_virtual_stage_layers`` / ``last_virtual_stage_layers``: an uneven pipeline split,
    as the trainer's ``parallel`` options of the same names (None: an even split).
    """
    c = config
    etp = tp if etp is None else etp
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)):
        _positive(name, value)
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep), ("etp", etp)):
        _positive(name, value)
    m = pp if num_microbatches is None else num_microbatches
    _positive("num_microbatches", m)
    if (tp * cp * dp) % (ep * etp) != 0:
        raise ValueError(
            f"ep={ep} x etp={etp} does not divide tp·cp·dp={tp * cp * dp}: the expert layout "
            "(etp, ep, edp) must tile the same ranks as the dense one (tp, cp, dp)"
        )
    # Expert layout (etp, ep, edp) tiles the same tp·cp·dp ranks as the dense one.
    edp = tp * cp * dp // (ep * etp)
    recompute = c.recompute if recompute is None else recompute
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is invalid: valid are {RECOMPUTE_MODES}")
    v = 1 if vpp is None else vpp
    if v > 1 and m % pp != 0:
        raise ValueError(
            f"num_microbatches={m} is invalid with vpp={vpp}: the interleaved schedule runs "
            f"micro-batches in groups of pp={pp}, so it must be a multiple of {pp}"
        )
    ranks = range(pp) if pp_rank is None else [pp_rank]
    split = dict(
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        first_virtual_stage_layers=first_virtual_stage_layers,
        last_virtual_stage_layers=last_virtual_stage_layers,
    )
    kw = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, tp=tp, pp=pp, cp=cp)
    best = None
    for r in ranks:
        local = local_parameters(c, tp=tp, pp=pp, ep=ep, etp=etp, pp_rank=r, vpp=vpp, **split)
        chunk_bytes = [
            stage_activation_bytes(
                c, etp=etp, pp_rank=r, vpp=vpp, recompute=recompute, vp_chunk=k, **kw, **split
            )
            for k in range(v)
        ]
        est = MemoryEstimate(
            weights=local.total * c.params_dtype.itemsize,
            # fp32 main_grad whatever params_dtype is (the DDP default grad_reduce_in_fp32=True).
            gradients=local.total * 4,
            # Adam's fp32 master weight, m and v: 12 bytes per parameter (ZeRO paper's K = 12),
            # sharded over the replicas (ZeRO-1): dp×cp for dense, edp for expert parameters.
            optimizer=12 * (local.dense / (dp * cp) + local.expert / edp),
            # 1F1B keeps at most pp - r micro-batches' activations alive on rank r (its warm-up
            # depth + 1); the interleaved order more, chunk by chunk.
            activations=peak_in_flight(pp, r, m, chunk_bytes),
            params=local.total,
            expert_params=local.expert,
            pp_rank=r,
        )
        if best is None or est.total > best.total:
            best = est
    return best
