"""Hybrid layer patterns: Megatron-Core's strings such as ``"M-M*-E/*E"``, read into layer specs.

A pattern gives one character per decoder layer; each layer holds one part behind its own
pre-norm and residual (Megatron's hybrid stack, Nemotron-H's blocks):

- ``M``: a Mamba-2 mixer (``GPTConfig.mamba``), ``G``: a Gated DeltaNet mixer
  (``GPTConfig.linear_attention``; shardwork's symbol, Megatron has none), ``*``: attention
  (MLA when ``GPTConfig.mla`` is set);
- ``-``: a dense MLP, ``E``: a mixture-of-experts MLP (``GPTConfig.moe``).

After the decoder's characters, ``/`` introduces the multi-token-prediction depths, one part
per depth, all equal (Megatron's ``"<main>/<depth>/<depth>"``). A shardwork MTP depth is one
layer: its part is one mixer character, one MLP character, or a mixer followed by an MLP
(``*-``, ``ME``), which makes an ordinary mixer + MLP layer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HYBRID_SYMBOLS", "HybridPattern", "parse_hybrid_pattern"]

HYBRID_SYMBOLS = {"M": "mamba", "G": "gated_deltanet", "*": "attention", "-": "dense", "E": "moe"}
"""Pattern character -> the part it places (a mixer or an MLP kind)."""
_MIXERS = "MG*"
_MLPS = "-E"


@dataclass(frozen=True)
class HybridPattern:
    """A parsed pattern: the decoder's characters and the characters of each MTP depth."""

    decoder: str
    mtp: tuple[str, ...] = ()

    @property
    def symbols(self) -> set[str]:
        """Every character used, decoder and MTP."""
        return set(self.decoder).union(*self.mtp)


def _check_symbols(field: str, part: str, pattern: str) -> None:
    for char in part:
        if char not in HYBRID_SYMBOLS:
            raise ValueError(
                f"{field}={pattern!r} is invalid: {char!r} is not a layer symbol; valid are "
                f"{', '.join(repr(s) for s in HYBRID_SYMBOLS)} and '/' before each MTP depth"
            )


def parse_hybrid_pattern(pattern: str, field: str = "GPTConfig.hybrid_layer_pattern"):
    """Split ``pattern`` into decoder and MTP parts; ValueError naming ``field`` when invalid."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{field}={pattern!r} is invalid: it must be a non-empty string")
    decoder, *depths = pattern.split("/")
    if not decoder:
        raise ValueError(f"{field}={pattern!r} is invalid: it has no decoder layers before '/'")
    _check_symbols(field, decoder, pattern)
    for depth in depths:
        _check_symbols(field, depth, pattern)
        if depth != depths[0]:
            raise ValueError(
                f"{field}={pattern!r} is invalid: every MTP depth must have the same layer "
                f"(got {depths[0]!r} and {depth!r})"
            )
        one_part = len(depth) == 1
        mixer_then_mlp = len(depth) == 2 and depth[0] in _MIXERS and depth[1] in _MLPS
        if not (one_part or mixer_then_mlp):
            raise ValueError(
                f"{field}={pattern!r} is invalid: MTP depth {depth!r} must be one layer: one "
                "symbol, or a mixer symbol (M, G, *) followed by an MLP symbol (-, E)"
            )
    return HybridPattern(decoder, tuple(depths))


def split_depth(depth: str) -> tuple[str | None, str | None]:
    """The (mixer symbol, MLP symbol) of one layer's characters, None where absent."""
    mixer = next((c for c in depth if c in _MIXERS), None)
    mlp = next((c for c in depth if c in _MLPS), None)
    return mixer, mlp
