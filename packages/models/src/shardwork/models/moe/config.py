"""``MoEConfig``: the mixture-of-experts part of a ``GPTConfig`` (``GPTConfig.moe``).

- One frozen keyword-only dataclass holding the expert layout; every routing option lives in
  ``MoEConfig.router``, a :class:`shardwork.moe_router.RouterConfig` that the MoE layer hands
  to moe-router unchanged (one name per concept, validated by moe-router itself).
- Which layers are MoE: ``first_k_dense_replace`` (DeepSeek: the first k layers keep a dense
  MLP of ``GPTConfig.ffn_hidden_size``) and ``layer_freq`` (an int ``n``: every n-th layer
  counting from 0, or a tuple of 0/1 per layer, Megatron's ``moe_layer_freq``).
- Experts are MLPs of width ``ffn_hidden_size`` with the model's ``GPTConfig.mlp_activation``
  (SwiGLU, or Nemotron-H's non-gated squared ReLU); shared experts (DeepSeek, Qwen2-MoE,
  Nemotron-H) form one dense MLP of that kind of width ``shared_expert_ffn_hidden_size`` (the
  sum over shared experts), optionally scaled by ``sigmoid(x · w_gate)`` (Qwen2-MoE ``shared_expert_gate``).
- Layout checks (``router.num_experts % ep``, ``ffn_hidden_size % etp``) run in
  :meth:`MoEConfig.check_layout`, called from ``GPTConfig.check_layout`` before any group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardwork.models.field_types import check_field_types
from shardwork.moe_router import RouterConfig

__all__ = ["DISPATCHERS", "GROUPED_GEMM", "MoEConfig"]

DISPATCHERS = ("alltoall", "allgather")
GROUPED_GEMM = ("auto", "grouped_mm", "batched")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MoEConfig.{name}={value!r} is invalid: it must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Routed experts (and optional shared experts) replacing the dense MLP of chosen layers."""

    router: RouterConfig
    """Every routing and load-balancing option: moe-router's own config, used as given (its
    ``hidden_size`` must equal ``GPTConfig.hidden_size``; its ``init_std`` initialises the
    gating weight)."""
    ffn_hidden_size: int
    """Width of each routed expert (HF ``moe_intermediate_size``)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Total width of the shared experts (DeepSeek ``n_shared_experts · moe_intermediate_size``,
    Qwen2-MoE ``shared_expert_intermediate_size``); None: no shared experts."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by ``sigmoid(x · w)`` (Qwen2-MoE)."""
    first_k_dense_replace: int = 0
    """The first k layers keep a dense MLP (DeepSeek)."""
    layer_freq: int | tuple[int, ...] = 1
    """MoE layer pattern: int n = layers 0, n, 2n, ... (after ``first_k_dense_replace``), or
    one 0/1 per layer."""
    dispatcher: str = "alltoall"
    """Token dispatcher: ``alltoall`` or ``allgather``."""
    grouped_gemm: str = "auto"
    """Expert GEMMs: ``grouped_mm`` (torch's grouped matmul), ``batched`` (padded bmm), or
    ``auto`` (grouped_mm when the dtype and strides allow it)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if not isinstance(self.router, RouterConfig):
            raise ValueError(
                f"MoEConfig.router={self.router!r} is invalid: it must be a "
                "shardwork.moe_router.RouterConfig, e.g. RouterConfig(num_experts=8, "
                "hidden_size=<GPTConfig.hidden_size>, top_k=2)"
            )
        _positive("ffn_hidden_size", self.ffn_hidden_size)
        if self.shared_expert_ffn_hidden_size is not None:
            _positive("shared_expert_ffn_hidden_size", self.shared_expert_ffn_hidden_size)
        if self.shared_expert_gate and self.shared_expert_ffn_hidden_size is None:
            raise ValueError(
                "MoEConfig.shared_expert_gate=True needs shared_expert_ffn_hidden_size: there is "
                "no shared expert to gate"
            )
        fk = self.first_k_dense_replace
        if isinstance(fk, bool) or not isinstance(fk, int) or fk < 0:
            raise ValueError(
                f"MoEConfig.first_k_dense_replace={fk!r} is invalid: it must be an integer >= 0"
            )
        freq = self.layer_freq
        if isinstance(freq, list):
            freq = tuple(freq)
            # The dataclass is frozen: a list pattern is normalised to a tuple (hashable, compares
            # equal to the tuple form) through object.__setattr__.
            object.__setattr__(self, "layer_freq", freq)
        if isinstance(freq, tuple):
            if not freq or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
                raise ValueError(
                    f"MoEConfig.layer_freq={freq!r} is invalid: a pattern is a non-empty tuple of "
                    "0/1 (1 = MoE layer), one per layer"
                )
        else:
            _positive("layer_freq", freq)
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"MoEConfig.dispatcher={self.dispatcher!r} is invalid: valid are {DISPATCHERS}"
            )
        if self.grouped_gemm not in GROUPED_GEMM:
            raise ValueError(
                f"MoEConfig.grouped_gemm={self.grouped_gemm!r} is invalid: valid are {GROUPED_GEMM}"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has routed experts."""
        if layer < self.first_k_dense_replace:
            return False
        if isinstance(self.layer_freq, tuple):
            return bool(self.layer_freq[layer])
        return (layer - self.first_k_dense_replace) % self.layer_freq == 0

    def moe_layers(self, num_layers: int) -> list[int]:
        """Global indices of the MoE layers of a ``num_layers`` model."""
        return [i for i in range(num_layers) if self.is_moe_layer(i)]

    def validate(self, config: Any) -> None:
        """Checks against the enclosing ``GPTConfig`` (hidden size, layer counts)."""
        if self.router.hidden_size != config.hidden_size:
            raise ValueError(
                f"GPTConfig.moe.router.hidden_size={self.router.hidden_size} differs from "
                f"GPTConfig.hidden_size={config.hidden_size}: the router reads the model's hidden "
                f"states; valid: {config.hidden_size}"
            )
        n = config.num_layers
        if isinstance(self.layer_freq, tuple) and len(self.layer_freq) != n:
            raise ValueError(
                f"MoEConfig.layer_freq has {len(self.layer_freq)} entries, but "
                f"GPTConfig.num_layers={n}: give one 0/1 per layer"
            )
        if self.first_k_dense_replace > n:
            raise ValueError(
                f"MoEConfig.first_k_dense_replace={self.first_k_dense_replace} exceeds "
                f"GPTConfig.num_layers={n}"
            )

    def check_layout(self, parallel: Any) -> None:
        """ValueError unless experts split over ``parallel.ep`` and their width over ``etp``."""
        ep, etp = parallel.ep, parallel.expert_tp
        if self.router.num_experts % ep != 0:
            raise ValueError(
                f"MoEConfig.router.num_experts={self.router.num_experts} is not divisible by ep={ep}: every "
                "expert-parallel rank holds the same number of experts"
            )
        if self.ffn_hidden_size % etp != 0:
            raise ValueError(
                f"MoEConfig.ffn_hidden_size={self.ffn_hidden_size} is not divisible by etp={etp}"
            )
        shared = self.shared_expert_ffn_hidden_size
        if shared is not None and shared % parallel.tp != 0:
            raise ValueError(
                f"MoEConfig.shared_expert_ffn_hidden_size={shared} is not divisible by "
                f"tp={parallel.tp}"
            )

    def replace(self, **changes: Any) -> MoEConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
