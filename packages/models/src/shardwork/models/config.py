"""``GPTConfig``: the shape and precision of a dense decoder-only transformer, validated on construction.

- One frozen, keyword-only dataclass; each field carries its docstring. Invalid values raise
  ``ValueError`` naming the field, the value and what would be valid.
- Layout-dependent checks (heads divisible by tp, vocab rows divisible by tp, sequence
  length vs. tp/cp) live in :meth:`GPTConfig.check_layout`, which takes a
  :class:`~shardwork.parallel_state.ParallelConfig`, so they run before any process group exists.
- The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by`` only (not of tp):
  the padded size, and therefore logits and checkpoints, do not depend on the layout.
- ``params_dtype`` is the storage dtype of parameters, ``compute_dtype`` the dtype activations
  are computed in (weights are cast on the fly when they differ). Softmax and the loss run in
  at least float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardwork.fused_kernels import LinearRopeScaling, Llama3RopeScaling, YarnRopeScaling
from shardwork.models.field_types import check_field_types
from shardwork.models.hybrid_pattern import parse_hybrid_pattern
from shardwork.models.layer_options import check_layer_options

if TYPE_CHECKING:
    from shardwork.models.deltanet_config import GatedDeltaNetConfig
    from shardwork.models.mamba_config import MambaConfig
    from shardwork.models.mla_config import MLAConfig
    from shardwork.models.moe.config import MoEConfig
    from shardwork.models.mtp_config import MTPConfig

__all__ = ["RECOMPUTE_MODES", "GPTConfig"]

RECOMPUTE_MODES = ("none", "selective", "full")
_BACKENDS = ("auto", "torch", "triton", "te")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name}={value!r} is invalid: it must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A dense GPT / Llama / Qwen-style decoder (pre-norm, RMSNorm, SwiGLU, RoPE)."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width ``h``."""
    num_attention_heads: int
    """Query heads."""
    ffn_hidden_size: int
    """MLP intermediate size (each of SwiGLU's gate and up; the squared-ReLU MLP's up)."""
    vocab_size: int
    """Real vocabulary size (rows of the embedding that are saved and exported)."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None means equal to ``num_attention_heads``."""
    head_dim: int | None = None
    """Per-head width; None means ``hidden_size // num_attention_heads``."""
    make_vocab_size_divisible_by: int = 128
    """The embedding/head rows are padded to a multiple of this (layout-independent)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is meant for: the rows of the position table with
    ``position_embedding_type="learned_absolute"`` (a longer sequence is refused), otherwise
    informational (RoPE has no table limit)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | LinearRopeScaling | None = None
    """RoPE frequency scaling (Llama 3.1 / YaRN / linear), from ``shardwork.fused_kernels``; with
    ``rope_local_theta`` it applies to the global (not sliding-window) layers only."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm (RMSNorm or LayerNorm)."""
    normalization: str = "rmsnorm"
    """Kind of every norm of the layers and the final norm: "rmsnorm" or "layernorm"
    (LayerNorm with weight and bias, GPT-2; Megatron's ``normalization``)."""
    qk_layernorm: bool = False
    """RMSNorm over each query/key head before RoPE (Qwen3)."""
    add_qkv_bias: bool = False
    """Bias on the fused QKV projection (Qwen2)."""
    attention_output_gate: bool = False
    """Gated attention (Qwen3-Next): the QKV projection also yields a per-head gate ``g`` and the
    attention output is multiplied by ``sigmoid(g)`` before the output projection."""
    position_embedding_type: str = "rope"
    """Position encoding: "rope", "none" (no positional signal, Nemotron-H) or
    "learned_absolute" (a ``[max_position_embeddings, h]`` table added to the word embedding
    on the first pipeline stage, GPT-2; Megatron's name)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels RoPE rotates (the first ``int(rotary_percent·head_dim)``;
    the rest pass through): Qwen3-Next's ``partial_rotary_factor``."""
    layernorm_zero_centered_gamma: bool = False
    """Every RMSNorm computes ``x̂·(1 + w)`` with ``w`` initialised to zeros (Qwen3-Next)."""
    mlp_activation: str = "swiglu"
    """Dense MLP: "swiglu" (gated SiLU), "geglu" (gated GELU, tanh approximation: Gemma's
    ``gelu_pytorch_tanh``), "relu2" (``down(relu(up(x))²)``, Nemotron-H) or "gelu_tanh"
    (``fc2(gelu_tanh(fc1(x)))``, not gated, GPT-2's ``gelu_new``)."""
    add_mlp_bias: bool = False
    """Biases on the dense MLP's two linears (Hugging Face's ``mlp_bias``); not with ``moe``."""
    add_proj_bias: bool = False
    """Bias on attention's output projection (GPT-2; with ``add_qkv_bias`` and
    ``add_mlp_bias`` Megatron's ``add_bias_linear``); under TP it is added once, after the
    reduction of the row-parallel partial sums."""
    scale_embedding: bool = False
    """Multiply the input embeddings by ``sqrt(hidden_size)`` (Gemma; the factor is rounded to
    float32 and then to the embedding's dtype, as transformers does)."""
    sandwich_norm: bool = False
    """Each sub-layer's output is normalised again before the residual add (Gemma's
    ``post_attention_layernorm`` / ``post_feedforward_layernorm``), besides the pre-norms."""
    attn_logit_softcapping: float | None = None
    """Attention scores become ``cap·tanh(scores / cap)`` before masking and softmax (Gemma 2:
    50); such layers compute attention explicitly instead of SDPA. None: no cap."""
    final_logit_softcapping: float | None = None
    """The LM head's logits become ``cap·tanh(logits / cap)`` (Gemma 2: 30), in inference and in
    the loss (applied in ``LMHead.forward``, the one place). None: no cap."""
    query_pre_attn_scalar: float | None = None
    """Attention scale ``query_pre_attn_scalar^-0.5`` instead of ``head_dim^-0.5`` (Gemma)."""
    sliding_window: int | None = None
    """Sliding-window layers let a query at position ``q`` attend to keys ``k`` with
    ``0 <= q - k < sliding_window`` (Hugging Face's semantics), also under context parallelism and
    packing. None: every layer attends globally."""
    sliding_window_pattern: int | tuple[int, ...] | None = None
    """Which layers slide (needs ``sliding_window``): None every layer; an int ``n`` gives
    ``n - 1`` sliding layers then one global layer, repeating (Gemma 2: 2, Gemma 3: 6, HF's
    ``sliding_window_pattern``); a tuple gives 1 (sliding) or 0 (global) per layer."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window layers, which then rotate without ``rope_scaling``
    (Gemma 3's ``rope_local_base_freq``); None: every layer uses ``rope_theta``/``rope_scaling``."""
    tie_word_embeddings: bool = False
    """LM head reuses the input embedding (kept in sync across pipeline stages)."""
    hidden_dropout: float = 0.0
    """Dropout on the embedding output and on each sub-layer output before the residual add."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections (attention out, MLP down) use
    ``std / sqrt(2 * num_layers)``."""
    init_seed: int = 1234
    """Base seed of the layout-independent initialisation (each parameter gets its own seed)."""
    dropout_seed: int = 1234
    """Seed of the model's RNG tracker (dropout)."""
    params_dtype: torch.dtype = torch.float32
    """Storage dtype of parameters."""
    compute_dtype: torch.dtype | None = None
    """Activation dtype; None means ``params_dtype``."""
    sequence_parallel: bool = False
    """Shard activations along the sequence between TP regions (needs tp > 1)."""
    recompute: str = "none"
    """Activation recompute: "none", "selective" (core attention) or "full" (whole layers)."""
    kernel_backend: str = "auto"
    """Backend of every fused-kernels op in this model: "auto", "torch", "triton" or "te"."""
    fused_linear_cross_entropy: bool = True
    """Training losses (a forward with labels, main head and MTP depths) go through
    ``LMHead.token_loss``: the output projection and the cross entropy in chunks, never the
    ``[tokens, vocab]`` logits or their gradient. False: the head's logits, then the vocab-parallel
    cross entropy. A forward without labels (evaluation, sampling) returns logits either way."""
    moe: MoEConfig | None = None
    """Mixture of experts (``shardwork.models.moe.MoEConfig``); None: dense MLPs only."""
    mla: MLAConfig | None = None
    """Multi-head latent attention (``shardwork.models.mla.MLAConfig``); None: standard
    grouped-query attention."""
    mtp: MTPConfig | None = None
    """Multi-token prediction (``shardwork.models.mtp.MTPConfig``); None: no MTP depths."""
    mamba: MambaConfig | None = None
    """Mamba-2 mixers (``shardwork.models.MambaConfig``) for layers whose spec says
    ``mixer="mamba"``; None: the model has none."""
    linear_attention: GatedDeltaNetConfig | None = None
    """Gated DeltaNet mixers (``shardwork.models.GatedDeltaNetConfig``) for the layers whose
    spec names ``mixer="gated_deltanet"``; None: no such layers."""
    hybrid_layer_pattern: str | None = None
    """Megatron-style hybrid stack, one character per layer (``M`` Mamba-2, ``G`` Gated
    DeltaNet, ``*`` attention, ``-`` dense MLP, ``E`` MoE; ``/`` before each MTP depth), e.g.
    ``"M-M*-"`` (:mod:`shardwork.models.hybrid_pattern`). None: every layer is attention + MLP."""
    linear_attention_freq: int | tuple[int, ...] | None = None
    """Which layers of an attention + MLP stack use a Gated DeltaNet mixer instead of attention
    (Qwen3-Next; Megatron's ``linear_attention_freq``): an int ``n`` gives ``n - 1`` DeltaNet
    layers then one attention layer, repeating; a tuple gives 1 (DeltaNet) or 0 (attention)
    per layer. Needs ``linear_attention``. None: attention everywhere."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            _positive_int(name, getattr(self, name))
        _positive_int("vocab_size", self.vocab_size)
        _positive_int("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        _positive_int("max_position_embeddings", self.max_position_embeddings)
        if self.num_query_groups is not None:
            _positive_int("num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups != 0:
                raise ValueError(
                    f"GPTConfig.num_query_groups={self.num_query_groups} is invalid: it must "
                    f"divide num_attention_heads={self.num_attention_heads}"
                )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"GPTConfig.hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}: set head_dim explicitly "
                    "or choose a multiple"
                )
        else:
            _positive_int("head_dim", self.head_dim)
        check_layer_options(self)
        if not self.rope_theta > 1:
            raise ValueError(f"GPTConfig.rope_theta={self.rope_theta} is invalid: it must be > 1")
        if self.rope_scaling is not None and not isinstance(
            self.rope_scaling, (Llama3RopeScaling, YarnRopeScaling, LinearRopeScaling)
        ):
            raise ValueError(
                f"GPTConfig.rope_scaling={self.rope_scaling!r} is invalid: valid are None, "
                "Llama3RopeScaling(...), YarnRopeScaling(...) or LinearRopeScaling(...)"
            )
        if not self.norm_epsilon > 0:
            raise ValueError(f"GPTConfig.norm_epsilon={self.norm_epsilon} must be > 0")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name}={p} is invalid: it must be in [0, 1)")
        if not self.init_method_std > 0:
            raise ValueError(f"GPTConfig.init_method_std={self.init_method_std} must be > 0")
        for name in ("params_dtype", "compute_dtype"):
            dt = getattr(self, name)
            if dt is None and name == "compute_dtype":
                continue
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(
                    f"GPTConfig.{name}={dt!r} is invalid: it must be a floating torch.dtype "
                    "(torch.float32, torch.bfloat16, torch.float16, torch.float64)"
                )
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"GPTConfig.recompute={self.recompute!r} is invalid: valid are {RECOMPUTE_MODES}"
            )
        if not isinstance(self.fused_linear_cross_entropy, bool):
            raise ValueError(
                f"GPTConfig.fused_linear_cross_entropy={self.fused_linear_cross_entropy!r} is "
                "invalid: it must be True or False"
            )
        if self.kernel_backend not in _BACKENDS:
            raise ValueError(
                f"GPTConfig.kernel_backend={self.kernel_backend!r} is invalid: valid are {_BACKENDS}"
            )
        if self.hybrid_layer_pattern is not None:
            check_hybrid_pattern(self)
        if self.linear_attention_freq is not None:
            check_linear_attention_freq(self)
        # MoE / DeepSeek / hybrid-mixer parts validate themselves.
        for name in ("moe", "mla", "mtp", "mamba", "linear_attention"):
            part = getattr(self, name)
            if part is not None:
                part.validate(self)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """Key/value heads (``num_query_groups`` or ``num_attention_heads``)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each query/key head that RoPE rotates (0 without RoPE)."""
        if self.position_embedding_type != "rope":
            return 0
        return int(self.kv_channels * self.rotary_percent)

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by``."""
        m = self.make_vocab_size_divisible_by
        # ceil(vocab_size / m) · m via negated floor division, exact in integers (no float
        # rounding).
        return -(-self.vocab_size // m) * m

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.params_dtype

    @property
    def head_grads_in_forward(self) -> bool:
        """The main head's fused loss takes its gradients in the forward (3 GEMMs, ``dW`` held
        until backward): only when ``dW`` accumulates in the activations' own float32/float64
        dtype; lower precision recomputes in backward instead (no float32 copy of ``dW``). The
        model and the memory estimate both read this, so they cannot disagree."""
        return self.fused_linear_cross_entropy and self.activation_dtype in (
            torch.float32,
            torch.float64,
        )

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with ``changes`` applied (validated again).

        The router of an inherited ``moe`` (one not passed in ``changes``) follows the model,
        as it reads the model's hidden states and was initialised like it: a changed
        ``hidden_size`` becomes ``moe.router.hidden_size``, and a changed ``init_method_std``
        becomes ``moe.router.init_std`` when that equalled the old ``init_method_std``. A
        ``moe`` passed in ``changes`` is taken as given (a router whose ``hidden_size`` differs
        from the model's is refused by validation).
        """
        if self.moe is not None and "moe" not in changes:
            router = self.moe.router
            follow: dict[str, Any] = {}
            if changes.get("hidden_size", self.hidden_size) != self.hidden_size:
                follow["hidden_size"] = changes["hidden_size"]
            std = changes.get("init_method_std", self.init_method_std)
            if std != self.init_method_std and router.init_std == self.init_method_std:
                follow["init_std"] = std
            try:
                followed = dataclasses.replace(router, **follow) if follow else None
            except ValueError:
                # An invalid new value: the router keeps its own, and GPTConfig's validation
                # below names the field the caller gave (not the router's copy of it).
                followed = None
            if followed is not None:
                changes["moe"] = self.moe.replace(router=followed)
        return dataclasses.replace(self, **changes)

    # ---- layout checks -------------------------------------------------------------------
    def check_layout(self, parallel: Any, *, seq_length: int | None = None) -> None:
        """Raise ``ValueError`` if this model cannot run on ``parallel`` (a ParallelConfig).

        Checks heads, query groups and vocabulary rows against tp, sequence parallelism
        against tp, and ``seq_length`` (if given) against tp (sequence parallel) and 2·cp
        (context parallel load balancing). How layers split over pp/vpp is checked by
        ``shardwork.models.pipeline`` (stages may be uneven, even empty).
        """
        tp, cp = parallel.tp, parallel.cp
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"GPTConfig.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"tp={tp}: choose tp among the divisors of the head count"
            )
        if self.kv_heads % tp != 0:
            raise ValueError(
                f"GPTConfig.num_query_groups={self.kv_heads} is not divisible by tp={tp}: "
                "each tensor-parallel rank needs whole key/value heads"
            )
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"GPTConfig.ffn_hidden_size={self.ffn_hidden_size} is not divisible by tp={tp}"
            )
        if self.padded_vocab_size % tp != 0:
            raise ValueError(
                f"GPTConfig.make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} "
                f"gives padded_vocab_size={self.padded_vocab_size}, not divisible by tp={tp}: "
                "use a multiple of tp for make_vocab_size_divisible_by"
            )
        if self.sequence_parallel and tp == 1:
            raise ValueError(
                "GPTConfig.sequence_parallel=True needs tp > 1 (got tp=1): set "
                "sequence_parallel=False or use tensor parallelism"
            )
        # MoE (ep/etp), MTP (cp), Mamba / DeltaNet (tp, cp) layout checks
        for part in (self.moe, self.mla, self.mtp, self.mamba, self.linear_attention):
            if part is not None:
                part.check_layout(parallel)
        if seq_length is not None:
            check_sequence_length(self, seq_length, tp=tp, cp=cp)


def check_hybrid_pattern(config: GPTConfig) -> None:
    """ValueError unless the pattern parses, fits ``num_layers`` and ``mtp``, and every symbol
    it uses has the config part that shapes it."""
    pattern = parse_hybrid_pattern(config.hybrid_layer_pattern)
    field = f"GPTConfig.hybrid_layer_pattern={config.hybrid_layer_pattern!r}"
    if len(pattern.decoder) != config.num_layers:
        raise ValueError(
            f"{field} has {len(pattern.decoder)} decoder layers but num_layers="
            f"{config.num_layers}: give one symbol per layer"
        )
    depths = config.mtp.num_layers if config.mtp is not None else 0
    if len(pattern.mtp) != depths:
        raise ValueError(
            f"{field} has {len(pattern.mtp)} MTP depths but mtp.num_layers={depths}: give one "
            "'/<layer>' per depth, and set mtp=MTPConfig(num_layers=...) to match"
        )
    needs = {
        "E": ("moe", "MoEConfig"),
        "M": ("mamba", "MambaConfig"),
        "G": ("linear_attention", "GatedDeltaNetConfig"),
    }
    for symbol, (name, cls) in needs.items():
        if symbol in pattern.symbols and getattr(config, name, None) is None:
            raise ValueError(f"{field} uses {symbol!r}, which needs GPTConfig.{name}={cls}(...)")
    moe = config.moe
    if moe is not None and (moe.first_k_dense_replace != 0 or moe.layer_freq != 1):
        raise ValueError(
            f"{field} places the MoE layers ('E'), so moe.first_k_dense_replace="
            f"{moe.first_k_dense_replace!r} and moe.layer_freq={moe.layer_freq!r} must keep "
            "their defaults (0 and 1)"
        )


def check_linear_attention_freq(config: GPTConfig) -> None:
    """ValueError unless ``linear_attention_freq`` is a valid int or 0/1 tuple of num_layers."""
    freq, field = config.linear_attention_freq, "GPTConfig.linear_attention_freq"
    if config.hybrid_layer_pattern is not None:
        raise ValueError(
            f"{field}={freq!r} and hybrid_layer_pattern are exclusive: the pattern places "
            "DeltaNet layers with 'G'"
        )
    if getattr(config, "linear_attention", None) is None:
        raise ValueError(
            f"{field}={freq!r} needs GPTConfig.linear_attention=GatedDeltaNetConfig(...)"
        )
    if isinstance(freq, tuple):
        if len(freq) != config.num_layers or any(v not in (0, 1) for v in freq):
            raise ValueError(
                f"{field}={freq!r} is invalid: a tuple needs one 0 or 1 per layer "
                f"(num_layers={config.num_layers})"
            )
    elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ValueError(f"{field}={freq!r} is invalid: an integer >= 1 or a tuple of 0/1")


def is_linear_attention_layer(config: GPTConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` of a non-pattern stack has a Gated DeltaNet mixer."""
    freq = config.linear_attention_freq
    if freq is None:
        return False
    if isinstance(freq, tuple):
        return bool(freq[layer])
    return (layer + 1) % freq != 0


def check_sequence_length(config: GPTConfig, seq_length: int, *, tp: int, cp: int) -> None:
    """ValueError unless ``seq_length`` (global, per sample) fits sequence/context parallelism."""
    if cp > 1 and seq_length % (2 * cp) != 0:
        raise ValueError(
            f"seq_length={seq_length} is not divisible by 2*cp={2 * cp}: context parallelism "
            "splits the sequence into 2·cp load-balanced chunks"
        )
    if (
        config.position_embedding_type == "learned_absolute"
        and seq_length > config.max_position_embeddings
    ):
        raise ValueError(
            f"seq_length={seq_length} is longer than max_position_embeddings="
            f"{config.max_position_embeddings}: the learned position table has one row per "
            "position; use a shorter sequence"
        )
    local = seq_length // cp
    if config.sequence_parallel and local % tp != 0:
        raise ValueError(
            f"seq_length={seq_length} (per context-parallel rank {local}) is not divisible by "
            f"tp={tp}: sequence parallelism splits the sequence across tensor-parallel ranks"
        )
