"""Memory per rank of any ``GPTConfig`` (dense, MoE, MLA, MTP) at a layout (formulas below).

Notation as in :mod:`shardwork.models.calculator` and :mod:`shardwork.models.calculator_moe`;
``tp pp dp cp ep etp`` the layout (``dp`` excludes cp, world ``= tp·cp·dp·pp``), expert data
parallel ``edp = tp·cp·dp / (ep·etp)``, ``V_p`` the padded vocabulary.

Parameters (exact local elements, the shapes the model allocates on that rank; padded vocab
rows included, so the count is what occupies memory):
  dense   attention ``/tp`` along heads (with the output gate a fourth ``linear_qkv``
          block as wide as Q; MLA: its down projections and latent norms are replicated),
          Mamba-2 and Gated DeltaNet ``/tp`` along heads and groups
          (:mod:`shardwork.models.calculator_memory_hybrid` lists their tensors), norms and
          routers replicated (LayerNorm: weight and bias), MLPs and shared experts ``/tp``
          (SwiGLU ``3·h·f``, squared ReLU and GELU ``2·h·f``), embedding / untied head / MTP
          embedding copy ``V_p·h/tp``, learned position table ``P·h`` (replicated, first
          stage), MTP ``eh_proj 2h·h/tp``; biases of ``add_proj_bias`` / ``add_mlp_bias``
  expert  ``(E/ep) · m·h·F/etp`` per MoE layer (``ParamMeta.is_expert``; ``m`` = 3 SwiGLU,
          2 squared ReLU, like the shared experts)
Bytes: weights ``P·bytes(params_dtype)``; gradients ``P·4`` (fp32 ``main_grad``); optimizer
(ZeRO-1: fp32 master + two Adam moments = 12 bytes a parameter) ``12·(P_dense/(dp·cp) +
P_expert/edp)`` — dense state shards over dp×cp, expert state over edp (bucket padding ignored).

Activations: bytes saved for backward by this implementation's torch-backend kernels, per
micro-batch, counted tensor by tensor (:func:`layer_activation_bytes`; docs/models-moe.md
lists every term); with ``kernel_backend="triton"`` (what ``"auto"`` runs on CUDA,
:func:`fused_kernels`) those of the fused Triton kernels where they differ: a norm saves its
input (``e``) and fp32 mean and rstd (``Tn·(h·e + 8)``), a SwiGLU its ``[gate | up]`` input
(``T·3f/tp·e`` with the down projection's input), the rotary its cos and sin expanded per
token for q and for k (``4·T·r·e``, ``r`` the rotated width), QK-norm a contiguous copy of q
and k, MLA's latent norm a copy of the latent, the MoE router's fused top-k no dense or group
scores, MTP's two norms ``Tn·(h·e + 16)``. ``T = s·b/cp`` local tokens, ``Tn`` the tokens a
norm sees (``T/tp`` under
sequence parallelism, else ``T``), ``e`` the activation bytes, ``c`` the norm/SwiGLU
arithmetic bytes (4, or 8 for float64). Per layer, recompute ``none``:
  norms      RMSNorm ``Tn·(h+1)·c + T·h·e`` each (x̂ and rstd of the closed-form backward; the
             next matmul's input); LayerNorm ``Tn·(2h+1)·c + T·h·e`` (x − mean, rstd, their
             product; the bias add saves nothing); a sandwich post-norm without the matmul term
  attention  flash-style SDPA with ``enable_gqa`` (query and value head widths equal): q
             ``T·(a/tp)·d·e``, k and v ``T·cp·(g/tp)·d·e`` each (v copied at cp = 1, gathered
             over cp otherwise; without RoPE and QK-norm q, k and v at cp = 1 are views of the
             fused qkv output instead, which stays alive whole, ``T·(a+2g)/tp·d·e``), the
             output ``T·(a/tp)·d·e`` and the log-sum-exp
             ``T·(a/tp)·4``; with ``attn_logit_softcapping`` the explicit path keeps its
             matmuls' copies of q and of k and v broadcast over query heads (``3·T·(a/tp)·d·e``
             at cp = 1; nothing keeps the qkv output), its tanh and softmax outputs
             ``T·(a/tp)·s·(e + c [+ e])`` instead of the log-sum-exp, an upper bound with
             packing or a window, where each query segment scores only its key span);
             sliding-window, packed and cp > 1 layers save no mask (block masks are rebuilt in
             backward: a tiny Llama with window 8 measures equal to one without);
             math SDPA (MLA, widths differ): ``q, k, v`` plus ``T·(n/tp)·s·e``
             probabilities and the output projection's input (packed or cp > 1 MLA runs the
             block-mask path instead: ``v`` and the output padded to the query width, a
             log-sum-exp, no probabilities; not modelled). Without RoPE (``none`` or
             ``learned_absolute``) and QK-norm, q and k are views of the fused qkv output too;
             QK-norm adds its x̂ and rstd ``T·(a+g)/tp·(d+1)·c``; the output gate adds
             ``2·T·(n/tp)·d·e`` (its sigmoid and the gated output) and widens the kept qkv
             output by its block. RoPE (the torch backend) keeps only its tables. Where q and k
             are new tensors (RoPE or QK-norm) v is copied at cp = 1 (``T·(g/tp)·d·e``) and the
             qkv output is not kept
  MLA        ``q_down → norm → q_up`` and ``kv_down → latent norm → kv_up`` intermediates
  Mamba-2,   the convolution, scan or delta rule and gated norm, tensor by tensor in
  DeltaNet   :mod:`shardwork.models.calculator_memory_hybrid` (terms over the sequence rounded
             up to whole chunks where the chunked scan pads it)
  MLP        SwiGLU ``T·(3f/tp·c + f/tp·e)``; squared ReLU ``2·T·f/tp·e`` (relu's output, which
             the square also keeps, and the square); GELU the same (its input and output); MoE:
             router scores and indices, and for ``R = T·k·etp/tp`` routed rows (expected,
             uniform load) ``R·(h·e + 3F/etp·c + F/etp·e + c)`` in SwiGLU experts (the row's
             probability is their token weight) plus ``(T·k/tp)·16`` to unpermute (two
             indices); squared ReLU ``R·(h·e + 2F/etp·e)`` plus ``(T·k/tp)·(h·e + e + 16)``
             (the combine weights the rows); shared experts like an MLP and their sigmoid gate
             ``Tn·(h + 1)·e`` (the shared output and the gate)
``selective`` keeps the core attention's inputs instead of its internals; ``full`` keeps only
the layer input ``Tn·h·e``. The last stage adds the final norm and the head input (once per MTP
depth too) and what the loss keeps: with ``fused_linear_cross_entropy`` (default) no logits —
the main head of a float32/float64 model its weight gradient computed in the forward
``V_p/tp·h·c`` (its input gradient replaces the input), every other head ``T·(8 + 1 + 2c)``
(labels, in-shard mask, lse, token weights); without it the logits ``T·V_p/tp·e`` (twice with
``final_logit_softcapping``, tanh's output) plus ``T·14`` of labels, masks and losses. Under
1F1B stage ``r`` holds ``min(pp − r, m)`` micro-batches in flight (interleaved:
``shardwork.models.pipeline.peak_in_flight`` per chunk). Not counted: aux-loss statistics
(``O(T·E)`` when enabled), dropout masks, the transient recompute of one layer in backward, and
what does not grow with the batch: causal masks, ``A``, RoPE's cos/sin slices, the fp32 (or
``1 + w``) weight copies a norm makes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwork.models.calculator_layers import (
    mlp_bias_params,
    mlp_matrices,
    norm_params,
    norms_per_part,
    position_params,
    proj_bias_params,
    query_blocks,
)
from shardwork.models.calculator_memory_hybrid import (
    deltanet_bytes,
    deltanet_params,
    deltanet_state_elements,
    mamba_bytes,
    mamba_params,
    mamba_state_elements,
)
from shardwork.models.config import GPTConfig
from shardwork.models.pipeline.split import layer_split
from shardwork.models.spec import LayerSpec, spec_for
from shardwork.parallel_state import ParallelConfig

__all__ = [
    "MIXER_MEMORY",
    "MLP_MEMORY",
    "LocalParams",
    "MixerMemory",
    "MlpMemory",
    "fused_kernels",
    "kv_cache_bytes_per_token",
    "layer_activation_bytes",
    "local_parameters",
    "recurrent_state_bytes",
    "register_mixer_memory",
    "register_mlp_memory",
    "stage_activation_bytes",
]


@dataclass(frozen=True)
class LocalParams:
    """Parameter elements one rank allocates, split by gradient/optimizer group."""

    dense: int
    """Non-expert parameters (gradients over dp×cp)."""
    expert: int
    """Routed-expert parameters (``ParamMeta.is_expert``; gradients over edp)."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


@functools.lru_cache(maxsize=64)
def _cached_spec(config: GPTConfig):
    return spec_for(config)


def _spec(config: GPTConfig):
    """``spec_for(config)``, cached: the estimate asks for it once per layer and per rank, and
    the layout planner prices thousands of layouts of one model (the spec is immutable)."""
    try:
        return _cached_spec(config)
    except TypeError:  # a config holding a list-valued option cannot be hashed
        return spec_for(config)


def _check_layout(config: GPTConfig, *, tp: int, ep: int, etp: int) -> None:
    for name, value in (("tp", tp), ("ep", ep), ("etp", etp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")
    # etp defaults to tp (as ParallelConfig), so a dense model at tp > 1 has etp == tp
    if config.moe is None and (ep > 1 or etp not in (1, tp)):
        raise ValueError(f"ep={ep}, etp={etp} need GPTConfig.moe: a dense model has no experts")
    if config.moe is not None:
        config.moe.check_layout(ParallelConfig(tp=tp, ep=ep, etp=etp))


def _attention_params(c: GPTConfig, tp: int) -> int:
    h, n = c.hidden_size, c.num_attention_heads
    if c.mla is None:
        d, g = c.kv_channels, c.kv_heads
        # linear_qkv's rows: Q, K, V and, with the output gate, a G block as wide as Q
        qkv = (query_blocks(c) * n + 2 * g) * d // tp
        p = qkv * h + (qkv if c.add_qkv_bias else 0) + n * d // tp * h + proj_bias_params(c)
        return p + (2 * d if c.qk_layernorm else 0)
    m = c.mla
    if m.q_lora_rank is None:
        q = n * m.qk_head_dim // tp * h
    else:
        q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * (n * m.qk_head_dim // tp)
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    kv += m.kv_lora_rank * (n * (m.qk_nope_head_dim + m.v_head_dim) // tp)
    return q + kv + n * m.v_head_dim // tp * h


def _swiglu_params(c: GPTConfig, *, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) local elements of a SwiGLU MLP: gate, up and down ``/tp`` (and the
    biases of ``add_mlp_bias``)."""
    return 3 * c.hidden_size * (c.ffn_hidden_size // tp) + mlp_bias_params(c, tp), 0


def _relu2_params(c: GPTConfig, *, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) local elements of a squared-ReLU MLP: ``fc1`` and ``fc2`` ``/tp`` (and
    the biases of ``add_mlp_bias``)."""
    return 2 * c.hidden_size * (c.ffn_hidden_size // tp) + mlp_bias_params(c, tp), 0


def _moe_params(c: GPTConfig, *, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) local elements of an MoE MLP."""
    h, m = c.hidden_size, c.moe
    mats = mlp_matrices(c)  # 3 SwiGLU (gate, up, down), 2 squared ReLU (up, down)
    dense = m.router.num_experts * h  # router, replicated
    if m.shared_expert_ffn_hidden_size is not None:
        dense += mats * h * (m.shared_expert_ffn_hidden_size // tp)
        dense += h if m.shared_expert_gate else 0
    expert = m.router.num_experts // ep * mats * h * (m.ffn_hidden_size // etp)
    return dense, expert


def _layer_params(c: GPTConfig, spec: LayerSpec, *, tp: int, ep: int, etp: int):
    """(dense, expert) local elements of one layer: its parts and a norm per part."""
    dense = expert = 0
    norms = norms_per_part(c) * norm_params(c)
    if spec.mixer is not None:
        dense += _part(MIXER_MEMORY, spec.mixer).params(c, tp) + norms
    if spec.mlp is not None:
        d, e = _part(MLP_MEMORY, spec.mlp).params(c, tp=tp, ep=ep, etp=etp)
        dense, expert = dense + d + norms, expert + e
    return dense, expert


def _stage_layout(
    config: GPTConfig,
    pp: int,
    pp_rank: int,
    vpp: int | None,
    split: dict,
    vp_chunk: int | None = None,
):
    """(global layer indices, holds the embedding, holds head/final norm/MTP) of rank
    ``pp_rank``'s chunks, or of its chunk ``vp_chunk`` alone.

    ``split``: the uneven ends of :func:`shardwork.models.pipeline.layer_split` (the trainer's
    ``parallel.first_stage_layers`` ... ``last_virtual_stage_layers``); empty: an even split.
    """
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank!r} is invalid: it must be in [0, pp={pp})")
    chunks = layer_split(config.num_layers, pp, vpp=vpp, **split)[pp_rank]
    if vp_chunk is None:
        return [i for chunk in chunks for i in chunk], pp_rank == 0, pp_rank == pp - 1
    last = len(chunks) - 1
    if isinstance(vp_chunk, bool) or not isinstance(vp_chunk, int) or not 0 <= vp_chunk <= last:
        raise ValueError(f"vp_chunk={vp_chunk!r} is invalid: it must be in [0, vpp={last + 1})")
    first_stage, last_stage = pp_rank == 0 and vp_chunk == 0, pp_rank == pp - 1 and vp_chunk == last
    return list(chunks[vp_chunk]), first_stage, last_stage


def _split(first, last, first_virtual, last_virtual) -> dict:
    """The uneven-ends keywords of ``layer_split`` that are set."""
    ends = dict(
        first_stage_layers=first,
        last_stage_layers=last,
        first_virtual_stage_layers=first_virtual,
        last_virtual_stage_layers=last_virtual,
    )
    return {k: v for k, v in ends.items() if v is not None}


def local_parameters(
    config: GPTConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    pp_rank: int = 0,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
) -> LocalParams:
    """Exact parameter elements on a rank of pipeline rank ``pp_rank`` (all its vpp chunks).

    Every tp/ep/etp rank of a stage holds the same shapes, so only ``pp_rank`` matters.
    ``etp`` defaults to ``tp`` (as ``ParallelConfig``). ``first_stage_layers`` /
    ``last_stage_layers`` (per rank) or ``first_virtual_stage_layers`` /
    ``last_virtual_stage_layers``: an uneven pipeline split
    (``shardwork.models.pipeline.layer_split``).
    """
    etp = tp if etp is None else etp
    _check_layout(config, tp=tp, ep=ep, etp=etp)
    c, h = config, config.hidden_size
    split = _split(
        first_stage_layers, last_stage_layers, first_virtual_stage_layers, last_virtual_stage_layers
    )
    layers, pre, post = _stage_layout(c, pp, pp_rank, vpp, split)
    vocab = c.padded_vocab_size // tp * h
    spec = _spec(c)
    dense = expert = 0
    for layer in layers:
        d, e = _layer_params(c, spec.layers[layer], tp=tp, ep=ep, etp=etp)
        dense, expert = dense + d, expert + e
    if pre:
        dense += vocab + position_params(c)  # the position table is replicated over TP
    if post:
        dense += norm_params(c)  # final norm
        if not c.tie_word_embeddings or not pre:
            dense += vocab  # untied head, or the tied head's copy on the last stage
        if c.mtp is not None:
            for layer in spec.mtp:
                d, e = _layer_params(c, layer, tp=tp, ep=ep, etp=etp)
                dense += 3 * h + 2 * h * h // tp + d
                expert += e
            if not pre and not c.tie_word_embeddings:
                dense += vocab  # MTP's copy of the input embedding
    return LocalParams(dense=dense, expert=expert)


def kv_cache_bytes_per_token(config: GPTConfig, *, tp: int = 1) -> int:
    """Inference KV-cache bytes per token per rank, all layers (MTP excluded).

    GQA caches ``2·g/tp·d`` values a layer; MLA caches its compressed latent and the shared
    rope key, ``rkv + dr`` a layer, replicated over TP (the up projections are re-applied, or
    absorbed into the query and output projections, at decode time). Mamba-2 and Gated
    DeltaNet layers cache nothing per token: their fixed-size state per sequence is
    :func:`recurrent_state_bytes`.
    """
    c = config
    per_layer = (
        # K and V per kv head on this rank; GQA shares them across the query heads of a group.
        2 * (c.kv_heads // tp) * c.kv_channels
        if c.mla is None
        else c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    )
    # Only attention layers cache keys and values (a hybrid stack's other mixers keep a state).
    attention = sum(layer.mixer in ("attention", "mla") for layer in spec_for(c).layers)
    return attention * per_layer * c.activation_dtype.itemsize


def recurrent_state_bytes(config: GPTConfig, *, tp: int = 1) -> int:
    """Generation-state bytes per sequence on a rank, all layers (MTP excluded): what a
    recurrent mixer keeps instead of a KV cache, the same for any sequence length.

    Mamba-2: conv state ``(I + 2gN)/tp·(k-1)`` + SSM state ``nh/tp·p·N``; Gated DeltaNet:
    conv state ``(2Kd + Vd)/tp·(K-1)`` + delta-rule state ``Nv/tp·dk·dv``; elements in the
    scans' dtype (``params_dtype``, at least float32), as the mixers' ``init_state`` holds
    them. Attention layers add nothing here (their cache is :func:`kv_cache_bytes_per_token`).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} is invalid: it must be an integer >= 1")
    for part in (config.mamba, config.linear_attention):
        if part is not None:
            part.check_layout(ParallelConfig(tp=tp))
    itemsize = torch.promote_types(config.params_dtype, torch.float32).itemsize
    layers = spec_for(config).layers
    mixers = [_part(MIXER_MEMORY, s.mixer) for s in layers if s.mixer is not None]
    elements = sum(m.state(config, tp) for m in mixers if m.state is not None)
    return elements * itemsize


@dataclass(frozen=True)
class MixerMemory:
    """How the memory estimate counts a mixer kind on one rank.

    ``params(config, tp)``: local parameter elements; ``activations(config, t, tp, cp, seq,
    recompute, c, e)``: bytes saved for backward for ``t`` local tokens (``c``: the norm /
    fp32-arithmetic bytes, ``e``: activation bytes; see the module docstring);
    ``state(config, tp)``: generation-state elements per sequence of a recurrent mixer, None
    for one that caches keys and values per token instead.
    """

    params: Callable[[GPTConfig, int], int]
    activations: Callable[..., float]
    state: Callable[[GPTConfig, int], int] | None = None


@dataclass(frozen=True)
class MlpMemory:
    """How the memory estimate counts an MLP kind on one rank.

    ``params(config, *, tp, ep, etp)``: local ``(dense, expert)`` parameter elements;
    ``activations(config, t, tn, tp, etp, c, e)``: bytes saved for backward for ``t`` local
    tokens (``tn`` of them seen by the norms; see the module docstring).
    """

    params: Callable[..., tuple[int, int]]
    activations: Callable[..., float]


MIXER_MEMORY: dict[str, MixerMemory] = {}
"""Mixer kind -> its memory formulas (attention, MLA, Mamba-2 and Gated DeltaNet built in)."""
MLP_MEMORY: dict[str, MlpMemory] = {}
"""MLP kind -> its memory formulas (``dense`` SwiGLU, ``relu2`` and ``moe`` built in)."""


def register_mixer_memory(kind: str, memory: MixerMemory) -> None:
    """Make the memory estimate count ``kind`` mixers with ``memory``."""
    MIXER_MEMORY[kind] = memory


def register_mlp_memory(kind: str, memory: MlpMemory) -> None:
    """Make the memory estimate count ``kind`` MLPs with ``memory``."""
    MLP_MEMORY[kind] = memory


def _part(table: dict, kind: str):
    if kind not in table:
        raise ValueError(
            f"the memory estimate has no formula for layer part {kind!r} (known: {sorted(table)})"
        )
    return table[kind]


def fused_kernels(config: GPTConfig) -> bool:
    """True when the model runs this package's Triton kernels (``kernel_backend="triton"``,
    which ``"auto"`` resolves to on CUDA): the norms and gated MLPs then save less."""
    return config.kernel_backend == "triton"


def _norm_saved(cfg: GPTConfig, tn: float, width: int, c: int, e: int) -> float:
    """What one norm over ``width`` saves for ``tn`` tokens: the Triton kernel its input and
    fp32 mean and rstd (``triton_norms._Norm``); the torch backend's RMSNorm (closed-form
    backward) x̂ and rstd; its LayerNorm (the autograd reference) x - mean, rstd and product."""
    if fused_kernels(cfg):
        return tn * (width * e + 8)
    per_token = width + 1 if cfg.normalization == "rmsnorm" else 2 * width + 1
    return tn * per_token * c


def _norm(cfg: GPTConfig, tn: float, t: float, width: int, c: int, e: int) -> float:
    """A norm (:func:`_norm_saved`) plus the following matmul's input."""
    return _norm_saved(cfg, tn, width, c, e) + t * width * e


def _glu_saves(t: float, f: float, c: int, e: int, fused: bool) -> float:
    """A SwiGLU/GeGLU on ``t`` rows of width ``f`` and the down projection's input: the
    torch backend's fp32 gate, up and activation; the Triton kernel its ``[gate | up]`` input."""
    return t * (2 * f * e + f * e) if fused else t * (3 * f * c + f * e)


def _attention_bytes(cfg: GPTConfig, t, tp, cp, seq, recompute, c, e) -> float:
    n = cfg.num_attention_heads // tp
    if cfg.mla is None:
        d, g = cfg.kv_channels, cfg.kv_heads // tp
        gate = n if cfg.attention_output_gate else 0
        # Without RoPE (none, or learned positions added at the embedding) and QK-norm, q and k
        # reach SDPA (or the checkpoint) as views of qkv.
        q_view = cfg.position_embedding_type != "rope" and not cfg.qk_layernorm
        fused = fused_kernels(cfg)
        # Where q and k are new tensors (rotated or normalised), so is v: copied at cp == 1
        # (apply_rotary_qkv, or Attention._heads), gathered at cp > 1; nothing keeps the qkv
        # output. Otherwise q and k are views of it and keep it alive whole (gate block included).
        pinned = q_view
        capped = cfg.attn_logit_softcapping is not None and recompute != "selective"
        # The explicit soft-capped attention's matmuls save their own copies instead (below).
        extra = t * (n + 2 * g + gate) * d * e if pinned and not capped else 0.0
        if cfg.qk_layernorm and fused:  # the kernel saves a contiguous copy of q and k
            extra += t * (n + g) * (d * e + 8)
        elif cfg.qk_layernorm:  # normalised q and k and their 1/rms, in float32
            extra += t * (n + g) * (d + 1) * c
        extra += 2 * t * gate * d * e  # sigmoid(gate) and the gated output (linear_proj's input)
        if fused:  # the Triton rotary saves cos and sin expanded per token, for q and for k
            extra += 4 * t * cfg.rotary_dim * e
        kq = 0 if q_view else t * n * d  # q (rotated or normalised)
        # k (rotated or normalised, or gathered over cp); a view of qkv when neither
        kk = 0 if q_view and cp == 1 else t * cp * g * d
        kv_ = kk  # v likewise: a view of qkv, or copied, or gathered over cp
        if capped:
            # Explicit soft-capped attention instead of SDPA's log-sum-exp: its matmuls save
            # copies of q and of k and v broadcast over each group's query heads; tanh's output
            # (e), softmax's (c) and, when c != e, the probabilities cast back for the AV matmul
            # (e), each over the ``seq`` keys.
            probs = t * n * seq * (e + c + (0 if c == e else e))
            return extra + (t * n * d + 2 * t * cp * n * d) * e + t * n * d * e + probs
        # SDPA keeps q, k, v grouped (enable_gqa) and its output (linear_proj's input), plus the
        # log-sum-exp; selective recompute keeps the core's inputs and output only.
        lse = 0 if recompute == "selective" else t * n * 4
        return extra + (kq + kk + kv_) * e + t * n * d * e + lse
    m = cfg.mla
    dq, dv = m.qk_head_dim, m.v_head_dim
    rkv = m.kv_lora_rank
    if fused_kernels(cfg):
        # the q_down output (the norm's input), its norm's mean and rstd and q_up's input; the
        # latent norm's contiguous copy of its input (a slice of kv_down's output, which then
        # stays unpinned) and its statistics; kv_up's input; and the Triton rotary's cos and
        # sin per token, for q and for k
        proj = _norm(cfg, t, t, m.q_lora_rank, c, e) if m.q_lora_rank is not None else 0.0
        proj += _norm(cfg, t, t, rkv, c, e) + 4 * t * m.qk_rope_head_dim * e
    else:
        # Each latent RMSNorm keeps x̂ and 1/rms (c), and its output is the up projection's input.
        proj = 0.0
        if m.q_lora_rank is not None:
            proj += t * (m.q_lora_rank + 1) * c + t * m.q_lora_rank * e
        proj += t * (rkv + 1) * c + t * rkv * e
    math = dq != dv  # torch's SDPA takes its math path (on CPU in float32 arithmetic)
    qkv_b = c if math and recompute != "selective" else e
    core = (t * n * dq + t * cp * n * (dq + dv)) * qkv_b + t * n * dv * e  # q, k, v, proj in
    if recompute != "selective":
        core += t * n * seq * c if math else t * n * 4  # math-path probs, or flash lse
    return proj + core


def _swiglu_bytes(cfg: GPTConfig, t, tn, tp, etp, c, e) -> float:
    return _glu_saves(t, cfg.ffn_hidden_size // tp, c, e, fused_kernels(cfg))


def _relu2_bytes(cfg: GPTConfig, t, tn, tp, etp, c, e) -> float:
    """relu's output (also square's input) and the square (``fc2``'s input), both ``e`` wide."""
    return 2 * t * (cfg.ffn_hidden_size // tp) * e


def _moe_bytes(cfg: GPTConfig, t, tn, tp, etp, c, e) -> float:
    h, m = cfg.hidden_size, cfg.moe
    r = m.router
    k, experts = r.top_k, r.num_experts
    router_tokens = tn if cfg.sequence_parallel else t
    fused = fused_kernels(cfg)
    router = k * (8 + c)  # top-k indices and probabilities
    if r.score_function != "softmax" or r.pre_softmax:
        # dense scores (the fused top-k keeps none) and the renormalisation
        router += c if fused else experts * c + c
    if r.num_groups is not None and not fused:  # group scores, kept groups, indices
        g, gk = r.num_groups, r.group_top_k
        router += experts * c + g * (8 + c) + gk * 8 + gk * experts // g * c + k * 8
    router *= router_tokens
    sent = t / tp * k  # (token, expert) pairs this rank dispatches
    rows = sent * etp  # rows its experts compute (expected under a uniform load)
    f = m.ffn_hidden_size // etp
    relu2 = cfg.mlp_activation == "relu2"
    # per row: fc1's input, then SwiGLU's fp32 intermediates and output, or relu's output and
    # the square (fc2's input)
    # SwiGLU experts also keep each row's probability (their token weight: the torch backend
    # in float32, the Triton kernel as sent, in the activation dtype); the combine then keeps
    # only the two int64 indices. Squared-ReLU experts leave the probabilities to the combine,
    # which also keeps the rows and the probabilities.
    act = 2 * f * e if relu2 else _glu_saves(1, f, c, e, fused) + (e if fused else c)
    combine = h * e + e + 16 if relu2 else 16
    out = router + rows * (h * e + act) + sent * combine
    if m.shared_expert_ffn_hidden_size is not None:
        s = m.shared_expert_ffn_hidden_size // tp
        out += 2 * t * s * e if relu2 else _glu_saves(t, s, c, e, fused)
        if m.shared_expert_gate:  # the shared output and its sigmoid gate (the gate's input
            out += tn * (h + 1) * e  # is the norm output, counted with the norm)
    return out


def layer_activation_bytes(
    config: GPTConfig,
    layer: int,
    *,
    seq_length: int,
    micro_batch_size: int,
    tp: int = 1,
    cp: int = 1,
    etp: int | None = None,
    recompute: str | None = None,
) -> float:
    """Bytes one layer (global index; ``>= num_layers``: an MTP layer) saves for backward."""
    cfg = config
    etp = tp if etp is None else etp
    recompute = cfg.recompute if recompute is None else recompute
    e = cfg.activation_dtype.itemsize
    # Norms and SwiGLU compute in fp32 (fp64 in fp64 runs) whatever the activation dtype, so
    # the intermediates they save have that width.
    c = 8 if cfg.activation_dtype == torch.float64 else 4
    # Each cp rank holds s/cp tokens of every sequence (two load-balanced chunks).
    t = seq_length * micro_batch_size / cp
    tn = t / tp if cfg.sequence_parallel else t
    h = cfg.hidden_size
    if recompute == "full" and layer < cfg.num_layers:
        return tn * h * e
    spec = _spec(cfg)
    part = spec.layers[layer] if layer < cfg.num_layers else spec.mtp[layer - cfg.num_layers]
    out = 0.0
    # A sandwich (post-)norm saves what a norm saves; its output goes to the residual add,
    # which saves nothing.
    norms = _norm(cfg, tn, t, h, c, e) + (norms_per_part(cfg) - 1) * _norm_saved(cfg, tn, h, c, e)
    if part.mixer is not None:
        mixer = _part(MIXER_MEMORY, part.mixer)
        out += norms + mixer.activations(cfg, t, tp, cp, seq_length, recompute, c, e)
    if part.mlp is not None:
        mlp = _part(MLP_MEMORY, part.mlp)
        out += norms + mlp.activations(cfg, t, tn, tp, etp, c, e)
    return out


def _loss_bytes(cfg: GPTConfig, t: float, vocab: int, h: int, c: int, e: int, *, main: bool):
    """What a head's loss saves for backward beyond its input (counted by ``_norm``)."""
    if not cfg.fused_linear_cross_entropy:
        loss = t * (vocab * e + 8 + 2 + 4)  # logits, labels, masks, per-token loss
        if cfg.final_logit_softcapping is not None:
            loss += t * vocab * e  # tanh's output, which its backward reads
        return loss
    if main and cfg.head_grads_in_forward:
        # Gradients computed in the forward: d hidden (in place of the head input) and the
        # float32/float64 d weight of this rank's vocabulary shard.
        return vocab * h * c
    # Recomputed in backward: labels, the in-shard mask, lse and the token weights.
    return t * (8 + 1 + 2 * c)


def stage_activation_bytes(
    config: GPTConfig,
    *,
    seq_length: int,
    micro_batch_size: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    etp: int | None = None,
    pp_rank: int = 0,
    vpp: int | None = None,
    recompute: str | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
    vp_chunk: int | None = None,
) -> float:
    """Bytes one micro-batch's forward saves on pipeline rank ``pp_rank`` (see module doc):
    in all its chunks, or in chunk ``vp_chunk`` alone."""
    cfg = config
    split = _split(
        first_stage_layers, last_stage_layers, first_virtual_stage_layers, last_virtual_stage_layers
    )
    layers, pre, post = _stage_layout(cfg, pp, pp_rank, vpp, split, vp_chunk)
    kw = dict(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        tp=tp,
        cp=cp,
        etp=etp,
        recompute=recompute,
    )
    total = sum(layer_activation_bytes(cfg, i, **kw) for i in layers)
    t = seq_length * micro_batch_size / cp
    tn = t / tp if cfg.sequence_parallel else t
    h, e = cfg.hidden_size, cfg.activation_dtype.itemsize
    c = 8 if cfg.activation_dtype == torch.float64 else 4
    fused = fused_kernels(cfg)
    vocab = cfg.padded_vocab_size // tp
    if pre:
        total += t * 8  # token ids
    if post:
        total += _norm(cfg, tn, t, h, c, e) + _loss_bytes(cfg, t, vocab, h, c, e, main=True)
        if cfg.mtp is not None:
            # token ids, the embedding and hidden norms, eh_proj's [2h] input. The Triton hidden
            # norm keeps its input, the main head's input, which that head keeps too unless
            # its gradients were computed in the forward.
            norms = 2 * _norm_saved(cfg, tn, h, c, e)
            if fused and not cfg.head_grads_in_forward:
                norms -= tn * h * e
            depth = t * 8 + norms + t * 2 * h * e
            depth += _norm(cfg, tn, t, h, c, e) + _loss_bytes(cfg, t, vocab, h, c, e, main=False)
            for k in range(cfg.mtp.num_layers):
                total += depth + layer_activation_bytes(cfg, cfg.num_layers + k, **kw)
    return total


_ATTENTION = MixerMemory(_attention_params, _attention_bytes)
register_mixer_memory("attention", _ATTENTION)
register_mixer_memory("mla", _ATTENTION)
register_mixer_memory("mamba", MixerMemory(mamba_params, mamba_bytes, mamba_state_elements))
register_mixer_memory(
    "gated_deltanet", MixerMemory(deltanet_params, deltanet_bytes, deltanet_state_elements)
)
register_mlp_memory("dense", MlpMemory(_swiglu_params, _swiglu_bytes))
register_mlp_memory("relu2", MlpMemory(_relu2_params, _relu2_bytes))
# The GELU MLP has the squared-ReLU MLP's two linears, and GELU saves one tensor (its input,
# fc1's output) where relu² saves relu's output: the same bytes.
register_mlp_memory("gelu", MlpMemory(_relu2_params, _relu2_bytes))
register_mlp_memory("moe", MlpMemory(_moe_params, _moe_bytes))
