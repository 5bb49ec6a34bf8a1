"""``GatedDeltaNetConfig``: the shapes of Gated DeltaNet token mixers (``GPTConfig.linear_attention``),
validated on construction.

Its own module so that ``GPTConfig`` (which holds one) and :mod:`shardwork.models.deltanet`
(which builds the layer from one) both depend on it, and not on each other.

Fixed by the architecture (as in Qwen3-Next's linear-attention layers), not configurable:
SiLU after the short convolution and on the output gate, ``beta = sigmoid(b)``,
``g = -exp(A_log) * softplus(a + dt_bias)``, queries scaled by ``1/sqrt(key_head_dim)``.
The gated RMSNorm uses the model's ``GPTConfig.norm_epsilon`` (Qwen3-Next's ``rms_norm_eps``).

Context parallelism is refused (:meth:`GatedDeltaNetConfig.check_layout`): the recurrent state
of a chunk depends on every earlier token, so a cp rank would need the final state of the
ranks before it (a sequential pass across ranks), which is not implemented.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardwork.models.deltanet_kernels import FLA_GATED_DELTA_RULE
from shardwork.models.field_types import check_field_types
from shardwork.models.scan_kernels import check_scan_backend

__all__ = ["GatedDeltaNetConfig"]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"GatedDeltaNetConfig.{name}={value!r} is invalid: it must be an integer >= 1"
        )


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetConfig:
    """Shapes of the Gated DeltaNet mixer (``GPTConfig.linear_attention``)."""

    num_key_heads: int
    """Query/key heads ``nk`` (Qwen3-Next-80B: 16)."""
    num_value_heads: int
    """Value heads ``nv``, a multiple of ``num_key_heads``: key head ``i`` serves the
    ``nv/nk`` consecutive value heads ``i·nv/nk ...`` (Qwen3-Next-80B: 32)."""
    key_head_dim: int
    """Per-head query/key width ``dk`` (Qwen3-Next-80B: 128)."""
    value_head_dim: int
    """Per-head value width ``dv`` (Qwen3-Next-80B: 128)."""
    conv_kernel: int = 4
    """Width of the causal depthwise convolution over the q|k|v channels."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked (WY-form) delta rule: a speed knob, exact either way."""
    qk_l2norm_epsilon: float = 1e-6
    """Epsilon of the L2 normalisation of queries and keys (``x * rsqrt(sum(x²) + eps)``)."""
    kernel_backend: str = "auto"
    """The delta rule: "torch" (plain-torch reference), "triton" (flash-linear-attention's
    Triton kernel, which must import when a GPTConfig holds this config) or "auto" (the
    kernel for CUDA tensors when it imports); see :mod:`shardwork.models.scan_kernels`."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in (
            "num_key_heads",
            "num_value_heads",
            "key_head_dim",
            "value_head_dim",
            "conv_kernel",
            "chunk_size",
        ):
            _positive(name, getattr(self, name))
        if self.num_value_heads % self.num_key_heads != 0:
            raise ValueError(
                f"GatedDeltaNetConfig.num_value_heads={self.num_value_heads} is invalid: it must "
                f"be a multiple of num_key_heads={self.num_key_heads}"
            )
        eps = self.qk_l2norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(
                f"GatedDeltaNetConfig.qk_l2norm_epsilon={self.qk_l2norm_epsilon!r} is invalid: "
                "it must be a number > 0"
            )
        check_scan_backend("GatedDeltaNetConfig", self.kernel_backend)

    @property
    def key_dim(self) -> int:
        """Width of all query (or key) heads together, ``nk·dk``."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of all value heads together, ``nv·dv``."""
        return self.num_value_heads * self.value_head_dim

    def validate(self, config: Any) -> None:
        """Called by ``GPTConfig``: a model that asks for ``kernel_backend="triton"`` needs
        flash-linear-attention importable here, refused now rather than when the mixer runs.
        Nothing else to check against ``config``: the mixer's widths are its own."""
        if self.kernel_backend == "triton":
            FLA_GATED_DELTA_RULE.require()

    def check_layout(self, parallel: Any) -> None:
        """Heads split over tp (whole key heads per rank, so whole value groups too); cp refused."""
        if parallel.cp > 1:
            raise ValueError(
                f"Gated DeltaNet layers do not support context parallelism (cp={parallel.cp}): "
                "each chunk's recurrent state depends on every earlier token of the sequence, "
                "and passing it between context-parallel ranks is not implemented; use cp=1"
            )
        if self.num_key_heads % parallel.tp != 0:
            raise ValueError(
                f"GatedDeltaNetConfig.num_key_heads={self.num_key_heads} is not divisible by "
                f"tp={parallel.tp}: each tensor-parallel rank needs whole key heads (and their "
                "value heads); choose tp among the divisors of num_key_heads"
            )

    def replace(self, **changes: Any) -> GatedDeltaNetConfig:
        return dataclasses.replace(self, **changes)
