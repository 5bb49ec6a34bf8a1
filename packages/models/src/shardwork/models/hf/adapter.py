"""What the Hugging Face bridge knows about one ``model_type``: an :class:`HFAdapter`.

An adapter holds everything family-specific (config fields both ways, which ``GPTConfig`` s
it describes, tensor names, the weight layout on disk), so the generic bridge
(:mod:`~shardwork.models.hf.config_map`, :mod:`~shardwork.models.hf.checkpoint`) only looks
it up in :mod:`~shardwork.models.hf.registry` and never branches on a family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.hf.keys import KEY_RULES

__all__ = ["LAYER_PREFIX", "WEIGHT_LAYOUTS", "HFAdapter"]

#: Regex of the ``decoder.layers.<i>.`` prefix that ``layer_rules`` patterns are relative to.
LAYER_PREFIX = r"decoder\.layers\.(\d+)\."
#: ``dense``: one HF tensor per shardwork key. ``experts``: per-expert tensors on disk, also
#: read from (and written as) the fused transformers-5 layout, plus MTP depths. ``converted``:
#: some HF tensors fuse several shardwork keys in a family-specific order (hybrid mixers, a
#: gated ``q_proj``); the adapter's ``convert_from_hf`` / ``convert_to_hf`` translate those
#: whole, the key rules the rest (:mod:`~shardwork.models.hf.converted`).
WEIGHT_LAYOUTS = ("dense", "experts", "converted")

Tensors = dict[str, Any]
"""Tensors by name (HF names or shardwork keys)."""


@dataclass(frozen=True)
class HFAdapter:
    """The mapping between one HF ``model_type`` and ``GPTConfig`` / checkpoint keys.

    - ``fields_from_hf(hf)``: the ``GPTConfig`` keyword arguments of an HF config dict; raises
      ``ValueError`` naming the field for variants the family's models cannot express.
    - ``fields_to_hf(config)``: the ``config.json`` fields besides ``architectures``,
      ``model_type`` and the dtype, which the bridge adds.
    - ``claims(config)``: whether ``config`` is a model of this ``model_type`` (export picks the
      one adapter that claims it, so the built-in ones are mutually exclusive).
    - ``layer_rules``: (regex, template) pairs for key suffixes after ``decoder.layers.<i>.``
      (template groups count from ``\\1`` inside the suffix), tried before the dense
      ``KEY_RULES``.
    - ``weight_layout``: one of :data:`WEIGHT_LAYOUTS`; ``mtp_copies``: export writes (and
      import checks) DeepSeek-style per-depth copies of the embedding and head.
    - ``hf_layer_prefix``: where the HF layers live (``model.layers``; Nemotron-H:
      ``backbone.layers``); ``global_rules``: the rules of the tensors outside layers
      (embedding, final norm, head), None for the Llama names of ``KEY_RULES``.
    - ``convert_from_hf(hf, config, layers)`` / ``convert_to_hf(state, config)`` (the
      ``converted`` layout): the shardwork keys of the fused HF tensors of decoder layers
      ``layers``, and the HF tensors of the shardwork keys it consumes (popped from ``state``).
    """

    model_type: str
    architecture: str
    fields_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    fields_to_hf: Callable[[GPTConfig], dict[str, Any]]
    claims: Callable[[GPTConfig], bool]
    layer_rules: tuple[tuple[str, str], ...] = ()
    weight_layout: str = "dense"
    mtp_copies: bool = False
    hf_layer_prefix: str = "model.layers"
    global_rules: tuple[tuple[str, str], ...] | None = None
    convert_from_hf: Callable[[Tensors, GPTConfig, set[int]], Tensors] | None = None
    convert_to_hf: Callable[[Tensors, GPTConfig], Tensors] | None = None

    def __post_init__(self) -> None:
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(
                f"HFAdapter({self.model_type!r}).weight_layout={self.weight_layout!r} is not "
                f"known; valid: {', '.join(WEIGHT_LAYOUTS)}"
            )

    def key_rules(self) -> list[tuple[str, str]]:
        """Ordered (regex, template) rules from shardwork keys to this family's HF names."""
        # the prefix adds a group in front, so the suffix's groups shift by one
        shifted = [
            (LAYER_PREFIX + pat, self.hf_layer_prefix + r".\1." + _shift_groups(tpl))
            for pat, tpl in self.layer_rules
        ]
        return shifted + list(KEY_RULES if self.global_rules is None else self.global_rules)


def _shift_groups(template: str) -> str:
    for i in range(9, 0, -1):
        template = template.replace(f"\\{i}", f"\\{i + 1}")
    return template
