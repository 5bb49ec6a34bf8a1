"""Parameter and FLOPs counts layer by layer from the model's spec: total vs. active parameters.

Each layer part kind (mixer or MLP) has a :class:`PartCost`; the counts walk
:func:`~shardwork.models.spec.spec_for`'s layers and MTP depths, so a hybrid stack or a new
kind (registered with :func:`register_part_cost`) is counted like the built-in ones.

Notation as in :mod:`shardwork.models.calculator`, plus ``E`` experts, ``k`` top-k, ``F`` expert
width, ``S`` shared-expert width, ``n`` heads, ``dn``/``dr``/``dv`` MLA head dims, ``rq``/``rkv``
MLA latent ranks, ``D`` MTP depths.

Per layer (exact, as the model builds them):
  attention (GQA)  ``h·(q·a+2g)·d + a·d·h [+ (q·a+2g)·d bias] [+ h proj bias] [+ 2d qk-norm]``
                   (``q`` = 2 with the attention output gate, else 1)
  attention (MLA)  ``[h·rq + rq + rq·n·(dn+dr) | h·n·(dn+dr)] + h·(rkv+dr) + rkv
                   + rkv·n·(dn+dv) + n·dv·h``
  norms            ``n`` per part (``n`` = ``h`` RMSNorm, ``2h`` LayerNorm; twice that with
                   ``sandwich_norm``)
  dense MLP        ``m·h·f [+ (m−1)·f + h bias]`` (``m`` = 3 SwiGLU, 2 squared ReLU or GELU)
  Mamba-2          ``h·(2I+2gN+nh) + I·h`` projections, ``(I+2gN)·k [+ bias]`` conv,
                   ``3·nh + I`` (dt bias, A, D, gated norm); FLOPs in calculator_mamba.py
  Gated DeltaNet   ``h·(2Kd+2Vd+2Nv) + Vd·h`` projections, ``(2Kd+Vd)·K`` conv,
                   ``2·Nv + dv`` (A, dt bias, norm); FLOPs in calculator_deltanet.py
  MoE MLP          total ``E·h (router) + E·m·h·F + m·h·S [+ h gate]``;
                   active ``E·h + k·m·h·F + m·h·S [+ h]`` (``m`` as for the dense MLP)
Model: ``Σ layers + V·h (embedding) [+ P·h learned positions] [+ V·h untied head] + n (final
norm)``; each MTP depth adds
``2h·h (eh_proj) + 3h (norms) +`` one MoE layer (embedding and head are shared).

Training FLOPs per token: ``3 × forward``, forward ``= 2·(matmul weights a token passes
through) + attention scores``.

- Matmul weights per layer are the active weights without norms and biases. Attention is
  ``h·(n+2g)·d + n·d·h`` (GQA) or the MLA projections. The MLP is ``m·h·f`` when dense. An MoE
  MLP is ``E·h`` (router) ``+ k·m·h·F`` (each token passes through exactly ``k`` experts; dropless
  routing) ``+ m·h·S [+ h gate]``.
- The attention scores are ``2·s·n·(dq + dv)·c`` per layer. ``dq`` is the query/key head width,
  and ``c = 1/2`` for causal attention.
- Each MTP depth adds ``2·2h·h`` (``eh_proj``) and one layer. The head, ``2·V_h·h``, is counted
  once per prediction depth (main + D); ``V_h`` is the real vocabulary with the fused linear
  cross-entropy (it skips the padding), the padded one without.
- Full recompute adds one more forward of the ``L`` decoder layers. The head, the embedding
  and the MTP depths are not recomputed (the fused loss's own recomputed logits, in MTP depths
  and low-precision heads, are not counted either).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardwork.models.calculator_deltanet import deltanet_forward_flops
from shardwork.models.calculator_layers import (
    head_columns,
    mlp_bias_params,
    mlp_matrices,
    norm_params,
    norms_per_part,
    position_params,
    proj_bias_params,
    query_blocks,
)
from shardwork.models.calculator_mamba import mamba_forward_flops
from shardwork.models.config import GPTConfig
from shardwork.models.spec import LayerSpec, spec_for

__all__ = [
    "PART_COSTS",
    "ParamCounts",
    "PartCost",
    "moe_flops_per_token",
    "moe_param_counts",
    "register_part_cost",
]


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
    p += proj_bias_params(c)
    if c.add_qkv_bias:
        p += (query_blocks(c) * c.num_attention_heads + 2 * g) * d
    if c.qk_layernorm:
        p += 2 * d
    return p


def _moe_mlp(c: GPTConfig) -> tuple[int, int, int]:
    """(total, active, router) of one MoE MLP."""
    m, h = c.moe, c.hidden_size
    router = m.router.num_experts * h
    mats = mlp_matrices(c)  # experts and shared experts have the dense MLP's activation
    shared = 0
    if m.shared_expert_ffn_hidden_size is not None:
        shared = mats * h * m.shared_expert_ffn_hidden_size + (h if m.shared_expert_gate else 0)
    per_expert = mats * h * m.ffn_hidden_size
    return (
        router + m.router.num_experts * per_expert + shared,
        router + m.router.top_k * per_expert + shared,
        router,
    )


@dataclass(frozen=True)
class PartCost:
    """How a registered layer-part kind counts: its parameters and forward FLOPs per token.

    ``params(config) -> (total, active, router)`` (a dense part: all three ints, router 0);
    ``forward(config, seq_length, causal) -> float``: forward FLOPs per token, 2 per
    multiply-add of the matmuls a token passes through plus sequence terms (attention scores,
    a scan's state updates).
    """

    params: Callable[[GPTConfig], tuple[int, int, int]]
    forward: Callable[[GPTConfig, int, bool], float]


PART_COSTS: dict[str, PartCost] = {}
"""Layer-part kind (a mixer or MLP kind of :mod:`shardwork.models.layer_kinds`) -> its cost."""


def register_part_cost(kind: str, cost: PartCost) -> None:
    """Make the calculator count ``kind`` parts with ``cost``."""
    PART_COSTS[kind] = cost


def _cost(kind: str) -> PartCost:
    if kind not in PART_COSTS:
        raise ValueError(
            f"the calculator has no cost for layer part {kind!r}: register one with "
            f"register_part_cost (known: {sorted(PART_COSTS)})"
        )
    return PART_COSTS[kind]


def _layer_params(c: GPTConfig, spec: LayerSpec) -> tuple[int, int, int]:
    """(total, active, router) of one layer: its parts and one norm per part."""
    total = active = router = 0
    for kind in (spec.mixer, spec.mlp):
        if kind is not None:
            t, a, r = _cost(kind).params(c)
            norms = norms_per_part(c) * norm_params(c)
            total, active, router = (
                total + t + norms,
                active + a + norms,
                router + r,
            )
    return total, active, router


def moe_param_counts(config: GPTConfig) -> ParamCounts:
    """Total and active parameters (see module docstring), layer by layer from the model's
    spec; works for dense and hybrid configs too."""
    c, h = config, config.hidden_size
    spec = spec_for(c)
    total = active = router = 0
    for layer in spec.layers:
        t, a, r = _layer_params(c, layer)
        total, active, router = total + t, active + a, router + r
    emb = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + norm_params(c)
    emb += position_params(c)
    mtp = mtp_active = 0
    for layer in spec.mtp:
        t, a, r = _layer_params(c, layer)
        # eh_proj [h, 2h] and enorm + hnorm + final norm around the depth's layer.
        extra = 2 * h * h + 3 * h
        mtp, mtp_active, router = mtp + extra + t, mtp_active + extra + a, router + r
    return ParamCounts(
        total=total + emb + mtp,
        active=active + emb + mtp_active,
        mtp=mtp,
        router=router,
        mtp_active=mtp_active,
    )


def _layer_forward(c: GPTConfig, spec: LayerSpec, seq_length: int, causal: bool) -> float:
    """Forward FLOPs per token of one layer (its parts' matmuls and sequence terms)."""
    kinds = [k for k in (spec.mixer, spec.mlp) if k is not None]
    return sum(_cost(kind).forward(c, seq_length, causal) for kind in kinds)


def moe_flops_per_token(
    config: GPTConfig, seq_length: int, *, causal: bool = True, full_recompute: bool = False
) -> float:
    """Training FLOPs per token (forward + backward [+ recomputed layers]; module docstring)."""
    c, h = config, config.hidden_size
    spec = spec_for(c)
    layers = sum(_layer_forward(c, layer, seq_length, causal) for layer in spec.layers)
    mtp = sum(2 * 2 * h * h + _layer_forward(c, layer, seq_length, causal) for layer in spec.mtp)
    # The columns the head multiplies (the padded vocabulary unless the fused loss skips them).
    heads = (1 + len(spec.mtp)) * 2 * head_columns(c) * h
    return 3 * (layers + mtp + heads) + (layers if full_recompute else 0.0)


def _attention_forward(c: GPTConfig, seq_length: int, causal: bool) -> float:
    n = c.num_attention_heads
    dq, dv = (c.kv_channels,) * 2 if c.mla is None else (c.mla.qk_head_dim, c.mla.v_head_dim)
    # QKᵀ over dq and AV over dv, 2 FLOPs per multiply-add, for s keys per query per head.
    scores = 2 * seq_length * n * (dq + dv) * (0.5 if causal else 1.0)
    return 2 * _attention_matmul(c) + scores


def _attention_params(c: GPTConfig) -> tuple[int, int, int]:
    p = _attention(c)
    return p, p, 0


def _dense_params(c: GPTConfig) -> tuple[int, int, int]:
    """A dense MLP (SwiGLU or squared ReLU, whichever ``mlp_activation`` names), its biases."""
    p = mlp_matrices(c) * c.hidden_size * c.ffn_hidden_size + mlp_bias_params(c)
    return p, p, 0


def _dense_forward(c: GPTConfig, seq_length: int, causal: bool) -> float:
    return 2 * mlp_matrices(c) * c.hidden_size * c.ffn_hidden_size  # matmuls only


# Every MoE MLP weight is a matmul weight; ``active`` is what one token passes through (router,
# k experts, shared expert and gate).
_ATTENTION = PartCost(_attention_params, _attention_forward)
register_part_cost("attention", _ATTENTION)
register_part_cost("mla", _ATTENTION)
register_part_cost("dense", PartCost(_dense_params, _dense_forward))
register_part_cost("relu2", PartCost(_dense_params, _dense_forward))
register_part_cost("gelu", PartCost(_dense_params, _dense_forward))
register_part_cost("moe", PartCost(_moe_mlp, lambda c, s, causal: 2 * _moe_mlp(c)[1]))


def _mamba_params(c: GPTConfig) -> tuple[int, int, int]:
    m, h = c.mamba, c.hidden_size
    inner, heads, channels = m.inner_size, m.num_heads, m.conv_channels
    proj = h * (2 * inner + 2 * m.num_groups * m.state_size + heads) + inner * h
    if m.proj_bias:
        proj += 2 * inner + 2 * m.num_groups * m.state_size + heads + h
    conv = channels * m.conv_kernel + (channels if m.conv_bias else 0)
    p = proj + conv + 3 * heads + inner  # dt_bias, A_log, D; the gated norm
    return p, p, 0


def _deltanet_params(c: GPTConfig) -> tuple[int, int, int]:
    g, h = c.linear_attention, c.hidden_size
    kd, vd, nv = g.key_dim, g.value_dim, g.num_value_heads
    proj = h * (2 * kd + 2 * vd + 2 * nv) + vd * h
    p = proj + (2 * kd + vd) * g.conv_kernel + 2 * nv + g.value_head_dim  # A_log, dt_bias, norm
    return p, p, 0


register_part_cost(
    "mamba",
    PartCost(_mamba_params, lambda c, s, causal: mamba_forward_flops(c, 1, s).total / s),
)
register_part_cost(
    "gated_deltanet",
    PartCost(
        _deltanet_params,
        lambda c, s, causal: deltanet_forward_flops(c, batch=1, seq_length=s).total / s,
    ),
)
