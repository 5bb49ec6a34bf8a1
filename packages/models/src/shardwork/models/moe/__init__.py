"""shardwork.models.moe: mixture-of-experts layers for GPTModel (Mixtral, Qwen-MoE, DeepSeek-V3).

- :class:`MoEConfig` (``GPTConfig.moe``): experts, routing (``router``: moe-router's
  ``RouterConfig``), shared experts, dense-first layers and layer patterns, dispatcher and
  GEMM choice.
- :class:`MoELayer`: router (:class:`MoERouter`, moe-router's ``TopKRouter``) → dispatcher
  (moe-router's all-to-all / all-gather over ep × etp) → :class:`GroupedExperts` (grouped
  GEMM SwiGLU) → combine, plus shared experts with an optional sigmoid gate.
- Model-owned state and hooks: :func:`attach_moe`, :func:`moe_finalize_kwargs` (tracker
  reduction and expert-bias update inside ``finalize_model_grads``), :func:`expert_load`,
  :func:`moe_routers`.
"""

from shardwork.models.moe.config import DISPATCHERS, GROUPED_GEMM, MoEConfig
from shardwork.models.moe.experts import ExpertLinear, ExpertShards, GroupedExperts, grouped_linear
from shardwork.models.moe.layer import MoELayer, SharedExpertGate
from shardwork.models.moe.router import MoERouter
from shardwork.models.moe.state import attach_moe, expert_load, moe_finalize_kwargs, moe_routers

__all__ = [
    "DISPATCHERS",
    "GROUPED_GEMM",
    "ExpertLinear",
    "ExpertShards",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "MoERouter",
    "SharedExpertGate",
    "attach_moe",
    "expert_load",
    "grouped_linear",
    "moe_finalize_kwargs",
    "moe_routers",
]
