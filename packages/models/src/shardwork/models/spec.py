"""Declarative model specs: which parts each layer has, derived from a config in one place.

- :class:`LayerSpec`: one decoder layer, ``norm -> mixer -> residual, norm -> mlp -> residual``,
  its parts named by kind (built through :mod:`shardwork.models.layer_kinds`).
- :class:`DecoderSpec`: the whole stack, global and layout-free: every decoder layer's spec
  (``layers[i]`` is global layer ``i``; a pipeline stage builds its range of them), the
  multi-token-prediction depths (``mtp``, global layer numbers ``num_layers + k``), and the
  rotary position table every mixer shares (:class:`RotarySpec`).
- :func:`spec_for` derives the spec of a :class:`~shardwork.models.config.GPTConfig`. It is
  the one place that reads the config's family switches (``mla``, ``moe``'s dense-first layers
  and layer frequency, ``mtp``): ``GPTModel`` builds whatever spec it is given, with no
  branch on a family. A family whose layers differ in other ways passes its own spec
  (``GPTModel(config, groups, spec=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.models.config import GPTConfig

__all__ = ["DecoderSpec", "LayerSpec", "RotarySpec", "spec_for"]


@dataclass(frozen=True)
class LayerSpec:
    """One pre-norm layer's parts, by registered kind."""

    mixer: str = "attention"
    """Token mixer kind: ``"attention"``, ``"mla"`` or a registered one."""
    mlp: str = "dense"
    """Channel MLP kind: ``"dense"`` (SwiGLU), ``"relu2"``, ``"moe"`` or a registered one."""
    norm: str = "rmsnorm"
    """Kind of the layer's two pre-norms (before the mixer and before the MLP)."""


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


def spec_for(config: GPTConfig) -> DecoderSpec:
    """The spec of ``config``: MLA or attention everywhere; MoE where ``config.moe`` says
    (``first_k_dense_replace`` dense layers first, then every ``layer_freq``-th layer, or the
    0/1 pattern); MTP depths use the mixer of the decoder and MoE when the model has MoE.
    Dense MLPs are ``"relu2"`` when ``config.mlp_activation`` says so; the rotary table rotates
    ``config.rotary_dim`` channels (``rotary_percent`` of the head), none without RoPE."""
    mixer = "mla" if config.mla is not None else "attention"
    dense = "relu2" if config.mlp_activation == "relu2" else "dense"
    moe = config.moe
    layers = tuple(
        LayerSpec(mixer, "moe" if moe is not None and moe.is_moe_layer(i) else dense)
        for i in range(config.num_layers)
    )
    depths = config.mtp.num_layers if config.mtp is not None else 0
    mtp = (LayerSpec(mixer, dense if moe is None else "moe"),) * depths
    if config.mla is not None:
        rotary = RotarySpec(config.mla.qk_rope_head_dim, interleaved=True)
    elif config.position_embedding_type == "none":
        rotary = None
    else:
        rotary = RotarySpec(config.rotary_dim)
    return DecoderSpec(layers=layers, rotary=rotary, mtp=mtp)
