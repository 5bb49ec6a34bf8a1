"""``MoELayer``: the MLP of an MoE transformer layer (router → dispatch → experts → combine
[+ shared experts]).

Shapes: hidden ``[s(/tp under SP), b, h]`` in and out, like the dense MLP it replaces.

- Router: :class:`~shardwork.models.moe.router.MoERouter` (moe-router's TopKRouter). Its
  losses' token groups: under sequence parallelism the TP ranks hold different tokens, so
  counts reduce over tp×cp (global loss: tp×dp×cp); without it TP ranks hold the same tokens
  and counts reduce over cp (dp×cp).
- Dispatcher: moe-router's all-to-all (or all-gather) dispatcher over the ``ep`` and ``etp``
  groups. Without sequence parallelism the hidden states are replicated over TP and the
  dispatcher is given the TP group: each TP rank dispatches 1/tp of the tokens and the outputs
  are all-gathered back, so no token is computed twice.
- Experts: :class:`~shardwork.models.moe.experts.GroupedExperts` (grouped GEMM, EP × ETP).
  SwiGLU experts get each row's routing probability from the dispatcher (exchanged with the
  rows) and scale their activation by it, and the combine only sums each token's copies: no
  ``[N, h]`` product pass, and the probability's gradient comes out of the activation's
  backward. Squared-ReLU experts leave the probabilities to the combine.
- Shared experts: a dense tensor-parallel MLP (``mlp.shared_experts``; SwiGLU, or squared
  ReLU when ``GPTConfig.mlp_activation == "relu2"`` as in Nemotron-H) on every token,
  optionally scaled by ``sigmoid(x · w_gate)`` (``mlp.shared_experts_gate.weight [1, h]``,
  Qwen2-MoE), added to the routed output.
"""

from __future__ import annotations

import torch

from shardwork.models.mlp import SwiGLUMLP
from shardwork.models.module import ShardedModule
from shardwork.models.moe.experts import GroupedExperts
from shardwork.models.moe.router import MoERouter
from shardwork.models.recompute import RecomputeReplay
from shardwork.models.sharding import describe_param
from shardwork.models.squared_relu_mlp import SquaredReLUMLP
from shardwork.moe_router import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    AuxLossScale,
    AuxLossTracker,
)
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["MoELayer", "SharedExpertGate"]

_DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


class SharedExpertGate(ShardedModule):
    """``sigmoid(x · wᵀ)`` with ``w [1, h]`` replicated over TP."""

    def __init__(
        self,
        hidden_size: int,
        groups: ProcessGroups,
        *,
        sequence_parallel: bool,
        params_dtype: torch.dtype,
        device,
    ) -> None:
        super().__init__(groups)
        self.weight = describe_param(
            torch.nn.Parameter(torch.empty((1, hidden_size), dtype=params_dtype, device=device)),
            ParamMeta(sequence_parallel=sequence_parallel),
            init="normal",
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(hidden @ self.weight.to(hidden.dtype).t())


class MoELayer(ShardedModule):
    """Routed (and shared) experts for global layer ``layer_number`` (see module docstring)."""

    def __init__(
        self,
        config,
        groups: ProcessGroups,
        *,
        layer_number: int,
        tracker: AuxLossTracker | None = None,
        loss_scale: AuxLossScale | None = None,
        replay: RecomputeReplay | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        moe = config.moe
        if moe is None:
            raise ValueError("MoELayer needs GPTConfig.moe (a MoEConfig)")
        tp = groups.size("tp")
        # Under SP the TP ranks hold different tokens, so the router's token counts must reduce over
        # tp too; without SP they hold the same tokens and reducing over tp would count them tp
        # times.
        sp = config.sequence_parallel and tp > 1
        self.layer_number = layer_number
        self.router = MoERouter(
            moe.router,
            groups,
            sequence_parallel=sp,
            tp_cp_group=groups.group("tp_cp") if sp else groups.group("cp"),
            tp_dp_cp_group=groups.group("tp_dp_cp") if sp else groups.group("dp_cp"),
            tracker=tracker,
            loss_scale=loss_scale,
            replay=replay,
            layer_index=layer_number,
            params_dtype=config.params_dtype,
            device=device,
        )
        self.dispatcher = _DISPATCHERS[moe.dispatcher](
            moe.router.num_experts,
            ep_group=groups.group("ep"),
            etp_group=groups.group("etp"),
            # Without SP every TP rank holds all tokens: each dispatches 1/tp of them and the
            # dispatcher all-gathers the outputs, so no token runs through the experts tp times.
            tp_group=groups.tp if tp > 1 and not sp else None,
        )
        self.experts = GroupedExperts(
            num_experts=moe.router.num_experts,
            hidden_size=config.hidden_size,
            ffn_hidden_size=moe.ffn_hidden_size,
            groups=groups,
            activation=config.mlp_activation,
            grouped_gemm=moe.grouped_gemm,
            kernel_backend=config.kernel_backend,
            params_dtype=config.params_dtype,
            device=device,
        )
        self.shared_experts = None
        self.shared_experts_gate = None
        if moe.shared_expert_ffn_hidden_size is not None:
            shared_cls = SquaredReLUMLP if config.mlp_activation == "relu2" else SwiGLUMLP
            self.shared_experts = shared_cls(
                config,
                groups,
                ffn_hidden_size=moe.shared_expert_ffn_hidden_size,
                bias=False,
                device=device,
            )
            if moe.shared_expert_gate:
                self.shared_experts_gate = SharedExpertGate(
                    config.hidden_size,
                    groups,
                    # Replicated over TP; under SP each rank sees only its tokens, so the gradient
                    # is all-reduced.
                    sequence_parallel=sp,
                    params_dtype=config.params_dtype,
                    device=device,
                )
        self.last_routing_map: torch.Tensor | None = None
        """``[T, E]`` bool map of the last forward (for inspection; not kept for backward)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> same shape."""
        probs_TE, map_TE = self.router(hidden)
        self.last_routing_map = map_TE.detach()
        # SwiGLU experts weight their rows by the routing probabilities themselves (on the
        # [N, f] activation, Megatron's per_token_scale), and then combine only sums the copies.
        in_experts = self.experts.scales_by_probs
        dispatched, handle = self.dispatcher.dispatch(
            hidden, probs_TE, map_TE, with_probs=in_experts
        )
        expert_out = self.experts(
            dispatched.tokens, dispatched.tokens_per_expert, probs_N=dispatched.probs
        )
        out = self.dispatcher.combine(expert_out, handle, apply_probs=not in_experts)
        out = out.to(hidden.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden)
            if self.shared_experts_gate is not None:
                shared = shared * self.shared_experts_gate(hidden)
            out = out + shared
        return out
