"""Parameter and FLOPs counts for MoE / MLA / MTP configs: total vs. active parameters.

Notation as in :mod:`shardwork.models.calculator`, plus ``E`` experts, ``k`` top-k, ``F`` expert
width, ``S`` shared-expert width, ``n`` heads, ``dn``/``dr``/``dv`` MLA head dims, ``rq``/``rkv``
MLA latent ranks, ``D`` MTP depths.

Per layer (exact, as the model builds them):
  attention (GQA)  ``h·(q·a+2g)·d + a·d·h [+ (q·a+2g)·d bias] [+ 2d qk-norm]`` (``q`` = 2
                   with the attention output gate, else 1)
  attention (MLA)  ``[h·rq + rq + rq·n·(dn+dr) | h·n·(dn+dr)] + h·(rkv+dr) + rkv
                   + rkv·n·(dn+dv) + n·dv·h``
  norms            ``2h``
  dense MLP        ``m·h·f [+ (m−1)·f + h bias]`` (``m`` = 3 SwiGLU, 2 squared ReLU)
  MoE MLP          total ``E·h (router) + E·3·h·F + 3·h·S [+ h gate]``;
                   active ``E·h + k·3·h·F + 3·h·S [+ h]``
Model: ``Σ layers + V·h (embedding) [+ V·h untied head] + h (final norm)``; each MTP depth adds
``2h·h (eh_proj) + 3h (norms) +`` one MoE layer (embedding and head are shared).

Training FLOPs per token: ``3 × forward``, forward ``= 2·(matmul weights a token passes
through) + attention scores``.

- Matmul weights per layer are the active weights without norms and biases. Attention is
  ``h·(n+2g)·d + n·d·h`` (GQA) or the MLA projections. The MLP is ``m·h·f`` when dense. An MoE
  MLP is ``E·h`` (router) ``+ k·3·h·F`` (each token passes through exactly ``k`` experts; dropless
  routing) ``+ 3·h·S [+ h gate]``.
- The attention scores are ``2·s·n·(dq + dv)·c`` per layer. ``dq`` is the query/key head width,
  and ``c = 1/2`` for causal attention.
- Each MTP depth adds ``2·2h·h`` (``eh_proj``) and one layer. The head, ``2·V_pad·h``, is counted
  once per prediction depth (main + D).
- Full recompute adds one more forward of the ``L`` decoder layers. The head, the embedding
  and the MTP depths are not recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.models.calculator_layers import mlp_bias_params, mlp_matrices, query_blocks
from shardwork.models.config import GPTConfig

__all__ = ["ParamCounts", "moe_flops_per_token", "moe_param_counts"]


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts of a config (real vocabulary rows, no padding)."""

    total: int
    """All parameters, MTP included."""
    active: int
    """Parameters used per token (routed experts counted k of E), MTP included."""
    mtp: int
    """Parameters of the MTP depths (already in ``total``)."""
    router: int
    """Gating weights of all routers (already in ``total``)."""

    @property
    def total_without_mtp(self) -> int:
        return self.total - self.mtp

    @property
    def active_without_mtp(self) -> int:
        return self.active - self.mtp_active

    mtp_active: int = 0
    """Active parameters of the MTP depths."""


def _attention_matmul(c: GPTConfig) -> int:
    """Matmul weights of one attention block (biases and norms excluded)."""
    h, n = c.hidden_size, c.num_attention_heads
    if c.mla is None:
        d, g = c.kv_channels, c.kv_heads
        return h * (query_blocks(c) * n + 2 * g) * d + n * d * h
    m = c.mla
    if m.q_lora_rank is None:
        q = h * n * m.qk_head_dim
    else:
        q = h * m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * n * (
        m.qk_nope_head_dim + m.v_head_dim
    )
    return q + kv + n * m.v_head_dim * h


def _attention(c: GPTConfig) -> int:
    """All parameters of one attention block: its matmul weights plus biases and norms."""
    p = _attention_matmul(c)
    if c.mla is not None:  # the q and kv low-rank norms
        return p + c.mla.kv_lora_rank + (c.mla.q_lora_rank or 0)
    d, g = c.kv_channels, c.kv_heads
    if c.add_qkv_bias:
        p += (query_blocks(c) * c.num_attention_heads + 2 * g) * d
    if c.qk_layernorm:
        p += 2 * d
    return p


def _moe_mlp(c: GPTConfig) -> tuple[int, int, int]:
    """(total, active, router) of one MoE MLP."""
    m, h = c.moe, c.hidden_size
    router = m.router.num_experts * h
    shared = 0
    if m.shared_expert_ffn_hidden_size is not None:
        shared = 3 * h * m.shared_expert_ffn_hidden_size + (h if m.shared_expert_gate else 0)
    per_expert = 3 * h * m.ffn_hidden_size
    return (
        router + m.router.num_experts * per_expert + shared,
        router + m.router.top_k * per_expert + shared,
        router,
    )


def moe_param_counts(config: GPTConfig) -> ParamCounts:
    """Total and active parameters (see module docstring); works for dense configs too."""
    c, h = config, config.hidden_size
    base = _attention(c) + 2 * h
    total = active = router = 0
    for layer in range(c.num_layers):
        if c.moe is not None and c.moe.is_moe_layer(layer):
            t, a, r = _moe_mlp(c)
        else:
            t = a = mlp_matrices(c) * h * c.ffn_hidden_size + mlp_bias_params(c)
            r = 0
        total += base + t
        active += base + a
        router += r
    emb = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h
    total += emb
    active += emb
    mtp = mtp_active = 0
    if c.mtp is not None:
        if c.moe is not None:
            t, a, r = _moe_mlp(c)
        else:
            t = a = mlp_matrices(c) * h * c.ffn_hidden_size + mlp_bias_params(c)
            r = 0
        # eh_proj [h, 2h], enorm + hnorm + final norm, and the depth's attention + layer norms.
        extra = 2 * h * h + 3 * h + base
        mtp = c.mtp.num_layers * (extra + t)
        mtp_active = c.mtp.num_layers * (extra + a)
        router += c.mtp.num_layers * r
    return ParamCounts(
        total=total + mtp,
        active=active + mtp_active,
        mtp=mtp,
        router=router,
        mtp_active=mtp_active,
    )


def _mlp_matmul(c: GPTConfig, moe_layer: bool) -> int:
    """Matmul weights one token passes through in an MLP (router and k experts if MoE)."""
    if not moe_layer:
        return mlp_matrices(c) * c.hidden_size * c.ffn_hidden_size
    return _moe_mlp(c)[1]  # active: router + k experts + shared (+ gate); all matmuls


def _layer_forward(c: GPTConfig, seq_length: int, moe_layer: bool, causal: bool) -> float:
    """Forward FLOPs per token of one transformer layer (matmuls and attention scores)."""
    n = c.num_attention_heads
    dq, dv = (c.kv_channels,) * 2 if c.mla is None else (c.mla.qk_head_dim, c.mla.v_head_dim)
    # QKᵀ over dq and AV over dv, 2 FLOPs per multiply-add, for s keys per query per head.
    scores = 2 * seq_length * n * (dq + dv) * (0.5 if causal else 1.0)
    return 2 * (_attention_matmul(c) + _mlp_matmul(c, moe_layer)) + scores


def moe_flops_per_token(
    config: GPTConfig, seq_length: int, *, causal: bool = True, full_recompute: bool = False
) -> float:
    """Training FLOPs per token (forward + backward [+ recomputed layers]; module docstring)."""
    c, h = config, config.hidden_size
    moe = c.moe
    layers = sum(
        _layer_forward(c, seq_length, moe is not None and moe.is_moe_layer(i), causal)
        for i in range(c.num_layers)
    )
    depths = c.mtp.num_layers if c.mtp is not None else 0
    mtp = depths * (2 * 2 * h * h + _layer_forward(c, seq_length, moe is not None, causal))
    # The padded vocabulary: the head computes those columns too (real work, unlike parameters).
    heads = (1 + depths) * 2 * c.padded_vocab_size * h
    return 3 * (layers + mtp + heads) + (layers if full_recompute else 0.0)
