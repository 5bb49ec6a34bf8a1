"""shardwork's router in transformers MoE models: ``swap_routers(model, **options)``.

Needs transformers >= 5 (``pip install 'shardwork-moe-router[transformers]'``). Supported:
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE, gpt-oss (router classes in
``families.ROUTING_RULES``).

- :func:`swap_routers` replaces every router module in place; outputs equal the original's
  to fp32 rounding; load-balancing options (aux / seq-aux / global-aux losses, z-loss,
  capacity, expert-bias rate) on top; state-dict names unchanged, so ``save_pretrained``
  output loads in stock transformers.
- The losses' value is in ``outputs.aux_loss`` (weighted by their coefficients, summed over
  layers) and added to ``outputs.loss``; their gradient follows ``outputs.loss``'s scaling.
- :class:`RouterSwap`: ``step()`` once per optimizer step (expert bias, per-step counts,
  tracker summary), or ``attach(optimizer)`` to run it from the optimizer's step hook.
- :func:`router_config_for`: the :class:`RouterConfig` a swap would use, without swapping.
"""

from shardwork.moe_router.integrations.transformers.families import BALANCING_OPTIONS
from shardwork.moe_router.integrations.transformers.gate import HFRouterGate
from shardwork.moe_router.integrations.transformers.swap import (
    RouterSwap,
    router_config_for,
    swap_routers,
)

__all__ = ["BALANCING_OPTIONS", "HFRouterGate", "RouterSwap", "router_config_for", "swap_routers"]
