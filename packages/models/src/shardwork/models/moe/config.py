"""``MoEConfig``: the mixture-of-experts part of a ``GPTConfig`` (``GPTConfig.moe``).

- One frozen keyword-only dataclass; routing fields mirror
  :class:`shardwork.moe_router.RouterConfig` (same names and meanings) and
  :meth:`MoEConfig.router_config` builds that config, so the router is moe-router's, unchanged.
- Which layers are MoE: ``first_k_dense_replace`` (DeepSeek: the first k layers keep a dense
  MLP of ``GPTConfig.ffn_hidden_size``) and ``layer_freq`` (an int ``n``: every n-th layer
  counting from 0, or a tuple of 0/1 per layer, Megatron's ``moe_layer_freq``).
- Experts are SwiGLU MLPs of width ``ffn_hidden_size``; shared experts (DeepSeek, Qwen2-MoE)
  form one dense SwiGLU of width ``shared_expert_ffn_hidden_size`` (the sum over shared
  experts), optionally scaled by ``sigmoid(x · w_gate)`` (Qwen2-MoE ``shared_expert_gate``).
- Layout checks (``num_experts % ep``, ``ffn_hidden_size % etp``) run in
  :meth:`MoEConfig.check_layout`, called from ``GPTConfig.check_layout`` before any group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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

    num_experts: int
    """Routed experts E."""
    ffn_hidden_size: int
    """SwiGLU width of each routed expert (HF ``moe_intermediate_size``)."""
    top_k: int = 2
    """Experts per token."""
    score_function: str = "softmax"
    """``softmax``, ``sigmoid`` (DeepSeek-V3) or ``sqrtsoftplus``."""
    pre_softmax: bool = False
    """Softmax over all experts before top-k without renormalising (Qwen2-MoE
    ``norm_topk_prob=False``); False = softmax over the k selected logits (Mixtral, Qwen3-MoE)."""
    top_k_scaling_factor: float | None = None
    """Multiply the selected probabilities (DeepSeek-V3 ``routed_scaling_factor`` 2.5)."""
    num_groups: int | None = None
    """Group-limited routing: expert groups (DeepSeek ``n_group``)."""
    group_top_k: int | None = None
    """Groups kept per token (DeepSeek ``topk_group``)."""
    load_balancing_type: str | tuple[str, ...] = "aux_loss"
    """As ``RouterConfig.load_balancing_type``."""
    aux_loss_coeff: float | tuple[float, ...] = 0.0
    """As ``RouterConfig.aux_loss_coeff`` (0 disables)."""
    z_loss_coeff: float | None = None
    """Router z-loss coefficient (None disables)."""
    capacity_factor: float | None = None
    """Token dropping at ``ceil(T·k/E·factor)`` tokens per expert; None is dropless."""
    token_drop_policy: str = "probs"
    """``probs`` or ``position``."""
    pad_to_capacity: bool = False
    """Pad every expert to its capacity (static shapes)."""
    enable_expert_bias: bool = False
    """Aux-loss-free balancing bias (DeepSeek-V3 ``e_score_correction_bias``)."""
    expert_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""
    router_dtype: str | None = None
    """None (activation dtype), ``fp32`` or ``fp64``."""
    input_jitter_eps: float | None = None
    """Router input jitter (training only; off in equivalence tests)."""
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
        _positive("num_experts", self.num_experts)
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
        try:  # router options are validated by moe-router itself (hidden size is a placeholder)
            self.router_config(hidden_size=1)
        except ValueError as err:
            raise ValueError(f"MoEConfig: {err}".replace("RouterConfig.", "")) from err

    def router_config(self, *, hidden_size: int, init_std: float = 0.02) -> RouterConfig:
        """The moe-router :class:`RouterConfig` of these options."""
        return RouterConfig(
            num_experts=self.num_experts,
            hidden_size=hidden_size,
            top_k=self.top_k,
            score_function=self.score_function,
            pre_softmax=self.pre_softmax,
            top_k_scaling_factor=self.top_k_scaling_factor,
            num_groups=self.num_groups,
            group_top_k=self.group_top_k,
            load_balancing_type=self.load_balancing_type,
            aux_loss_coeff=self.aux_loss_coeff,
            z_loss_coeff=self.z_loss_coeff,
            capacity_factor=self.capacity_factor,
            token_drop_policy=self.token_drop_policy,
            pad_to_capacity=self.pad_to_capacity,
            router_dtype=self.router_dtype,
            input_jitter_eps=self.input_jitter_eps,
            enable_expert_bias=self.enable_expert_bias,
            expert_bias_update_rate=self.expert_bias_update_rate,
            init_std=init_std,
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
        """Checks against the enclosing ``GPTConfig`` (layer counts)."""
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
        if self.num_experts % ep != 0:
            raise ValueError(
                f"MoEConfig.num_experts={self.num_experts} is not divisible by ep={ep}: every "
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
