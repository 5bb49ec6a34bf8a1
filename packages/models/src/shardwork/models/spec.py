"""Declarative model specs: which parts each layer has, derived from a config in one place.

- :class:`LayerSpec`: one decoder layer, ``norm -> mixer -> residual, norm -> mlp -> residual``,
  its parts named by kind (built through :mod:`shardwork.models.layer_kinds`). A hybrid
  stack's layer may hold only a mixer or only an MLP (``mlp=None`` / ``mixer=None``).
- :class:`DecoderSpec`: the whole stack, global and layout-free: every decoder layer's spec
  (``layers[i]`` is global layer ``i``; a pipeline stage builds its range of them), the
  multi-token-prediction depths (``mtp``, global layer numbers ``num_layers + k``), and the
  rotary position table every mixer shares (:class:`RotarySpec`).
- :func:`spec_for` derives the spec of a :class:`~shardwork.models.config.GPTConfig`. It is
  the one place that reads the config's family switches (``mla``, ``moe``'s dense-first layers
  and layer frequency, ``mtp``, ``hybrid_layer_pattern``): ``GPTModel`` builds whatever spec
  it is given, with no
  branch on a family. A family whose layers differ in other ways passes its own spec
  (``GPTModel(config, groups, spec=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.models.config import GPTConfig, is_linear_attention_layer
from shardwork.models.hybrid_pattern import HYBRID_SYMBOLS, parse_hybrid_pattern, split_depth

__all__ = ["DecoderSpec", "LayerSpec", "RotarySpec", "spec_for"]


@dataclass(frozen=True)
class LayerSpec:
    """One pre-norm layer's parts, by registered kind."""

    mixer: str | None = "attention"
    """Token mixer kind: ``"attention"``, ``"mla"`` or a registered one; None: no mixer."""
    mlp: str | None = "dense"
    """Channel MLP kind: ``"dense"`` (SwiGLU), ``"relu2"``, ``"gelu"``, ``"moe"`` or a registered
    one; None: no MLP."""
    norm: str = "rmsnorm"
    """Kind of the layer's pre-norms (one before each part it holds)."""

    def __post_init__(self) -> None:
        if self.mixer is None and self.mlp is None:
            raise ValueError("LayerSpec(mixer=None, mlp=None) is invalid: a layer needs a part")


@dataclass(frozen=True)
class RotarySpec:
    """The rotary table shared by the stack's mixers (theta and scaling come from the config)."""

    dim: int
    """Rotated channels per head."""
    interleaved: bool = False
    """Rotate neighbouring channel pairs (MLA) instead of the two halves (Llama)."""


@dataclass(frozen=True)
class DecoderSpec:
    """The layer specs of a whole model (all stages), its MTP depths and positions."""

    layers: tuple[LayerSpec, ...]
    rotary: RotarySpec | None
    """The rotary table, or None for a model without one (``position_embedding_type="none"``, or
    a stack without attention)."""
    mtp: tuple[LayerSpec, ...] = ()
    final_norm: str = "rmsnorm"
    """Kind of the norm after the last layer (on the last pipeline stage)."""

    def check(self, config: GPTConfig) -> None:
        """Raise when the spec's layer counts disagree with ``config``."""
        if len(self.layers) != config.num_layers:
            raise ValueError(
                f"DecoderSpec.layers has {len(self.layers)} entries: it needs one per layer, "
                f"num_layers={config.num_layers}"
            )
        depths = config.mtp.num_layers if config.mtp is not None else 0
        if len(self.mtp) != depths:
            raise ValueError(
                f"DecoderSpec.mtp has {len(self.mtp)} entries: it needs one per MTP depth, "
                f"config.mtp.num_layers={depths}"
            )
        if self.rotary is None and config.position_embedding_type == "rope":
            mixers = {s.mixer for s in (*self.layers, *self.mtp)} & {"attention", "mla"}
            if mixers:
                raise ValueError(
                    f"DecoderSpec.rotary=None but its {sorted(mixers)} mixers rotate with "
                    "position_embedding_type='rope': give a RotarySpec or set "
                    "position_embedding_type='none'"
                )


def _pattern_layer(config: GPTConfig, chars: str) -> LayerSpec:
    """The layer of one pattern part (one symbol, or a mixer symbol then an MLP symbol)."""
    mixer, mlp = split_depth(chars)
    kinds = [None if c is None else HYBRID_SYMBOLS[c] for c in (mixer, mlp)]
    if kinds[0] == "attention" and config.mla is not None:
        kinds[0] = "mla"
    if kinds[1] == "dense":
        kinds[1] = _dense_mlp(config)
    return LayerSpec(kinds[0], kinds[1], norm=config.normalization)


def _dense_mlp(config: GPTConfig) -> str:
    """The dense MLP kind of ``config.mlp_activation``."""
    return {"relu2": "relu2", "gelu_tanh": "gelu"}.get(config.mlp_activation, "dense")


def spec_for(config: GPTConfig) -> DecoderSpec:
    """The spec of ``config``.

    With ``hybrid_layer_pattern``: one single-part layer per decoder character and the MTP
    depths' parts (:mod:`shardwork.models.hybrid_pattern`). Otherwise: MLA or attention
    everywhere, except Gated DeltaNet where ``linear_attention_freq`` says; MoE where
    ``config.moe`` says (``first_k_dense_replace`` dense layers first, then every
    ``layer_freq``-th layer, or the 0/1 pattern); MTP depths use the decoder's attention (or
    MLA) mixer, and MoE when the model has MoE. Dense MLPs are ``"relu2"`` or ``"gelu"`` when
    ``config.mlp_activation`` says so, every norm (layers and final) is of the kind
    ``config.normalization`` names; the rotary table rotates ``config.rotary_dim``
    channels (``rotary_percent`` of the head), none without RoPE (learned absolute positions
    are added at the embedding instead)."""
    mixer = "mla" if config.mla is not None else "attention"
    dense, norm = _dense_mlp(config), config.normalization
    moe = config.moe
    if config.hybrid_layer_pattern is not None:
        pattern = parse_hybrid_pattern(config.hybrid_layer_pattern)
        layers = tuple(_pattern_layer(config, c) for c in pattern.decoder)
        mtp = tuple(_pattern_layer(config, depth) for depth in pattern.mtp)
    else:
        layers = tuple(
            LayerSpec(
                "gated_deltanet" if is_linear_attention_layer(config, i) else mixer,
                "moe" if moe is not None and moe.is_moe_layer(i) else dense,
                norm=norm,
            )
            for i in range(config.num_layers)
        )
        depths = config.mtp.num_layers if config.mtp is not None else 0
        mtp = (LayerSpec(mixer, dense if moe is None else "moe"),) * depths
    if config.mla is not None:
        rotary = RotarySpec(config.mla.qk_rope_head_dim, interleaved=True)
    elif config.position_embedding_type != "rope":  # none, or learned at the embedding
        rotary = None
    else:
        rotary = RotarySpec(config.rotary_dim)
    return DecoderSpec(layers=layers, rotary=rotary, mtp=mtp, final_norm=norm)
