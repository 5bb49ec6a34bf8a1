"""``swap_routers``: one call that puts shardwork's router into a transformers MoE model.

- Finds every transformers router module (``mlp.gate``; gpt-oss ``mlp.router``) of a class in
  :data:`families.ROUTING_RULES`, builds the :class:`RouterConfig` that routes as it does (plus
  the caller's load-balancing options) and puts an :class:`HFRouterGate` in its place, in
  place: same Parameters, same state-dict names, same call contract.
- transformers 5 records ``router_logits`` with forward hooks on its router modules,
  installed lazily on the first ``output_router_logits=True`` call and matched by class: they
  are installed before the swap and moved to the new modules, so the recording keeps working.
- A pre-hook on each MoE block gives its router the block input's [B, S] (the block calls it
  with flattened rows); a pre-hook on the model gives every router the ``attention_mask``'s
  padding and a fresh :class:`AuxLossScale`; a post-hook writes this forward's losses into
  ``outputs.aux_loss`` and ``outputs.loss`` (:mod:`.loss`).
- With shardwork losses configured, transformers' own router loss is switched off on the
  model instance (``router_aux_loss_coef = 0``) so it is not counted twice.
- :class:`RouterSwap` (returned) holds the routers, their config and tracker, and
  :meth:`RouterSwap.step`, the once-per-optimizer-step update (expert bias, global aux-loss
  counts, tracker), which :meth:`RouterSwap.attach` hooks to an optimizer.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch

from shardwork.moe_router.aux_loss import AuxLossScale
from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.integrations.transformers.families import (
    GATE_ATTRIBUTES,
    ROUTING_RULES,
    config_for_router,
    is_hf_router,
)
from shardwork.moe_router.integrations.transformers.gate import HFRouterGate
from shardwork.moe_router.integrations.transformers.loss import (
    LossGradientToScale,
    loss_coefficients,
    weighted_total,
)
from shardwork.moe_router.router import update_expert_bias
from shardwork.moe_router.tracker import AuxLossTracker

try:
    import transformers
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils import ModelOutput
except ImportError as error:  # the [transformers] extra
    raise ImportError(
        "shardwork.moe_router.integrations.transformers needs transformers >= 5.19: "
        "pip install 'shardwork-moe-router[transformers]'"
    ) from error
try:
    from transformers.utils.output_capturing import maybe_install_capturing_hooks
except ImportError:  # releases that record router logits without these hooks
    maybe_install_capturing_hooks = None


#: The oldest transformers whose MoE routers this integration knows (the `transformers` extra's
#: bound, which CI installs): 5.0-5.18 named the routers' settings otherwise (DeepSeek-V3's
#: router had no ``top_k``) and returned no aux loss from DeepSeek-V3.
OLDEST_TRANSFORMERS = (5, 19)


def _release() -> tuple[int, int]:
    """(major, minor) of the installed transformers; (0, 0) when its version is unreadable."""
    parts = transformers.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return (0, 0)


def _find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(block name, block, attribute) of every known transformers router, in module order."""
    sites = []
    for name, block in model.named_modules():
        for attribute in GATE_ATTRIBUTES:
            child = block._modules.get(attribute)
            if child is not None and is_hf_router(child):
                sites.append((name, block, attribute))
    return sites


def _install_output_recorders(model: torch.nn.Module, block_names: list[str]) -> None:
    """Install transformers' output-recording hooks on each MoE block's nearest
    ``PreTrainedModel`` (the one whose forward records them) while they still match the
    original router classes."""
    if maybe_install_capturing_hooks is None:
        return
    owners = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, PreTrainedModel)
    ]
    done = set()
    for block_name in block_names:
        inside = [
            (name, m) for name, m in owners if name == "" or block_name.startswith(name + ".")
        ]
        owner = max(inside, key=lambda item: len(item[0]))[1]
        if id(owner) not in done:
            maybe_install_capturing_hooks(owner)
            done.add(id(owner))


def _move_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Register ``old``'s forward hooks and pre-hooks on ``new`` (same flags)."""
    for key, hook in old._forward_pre_hooks.items():
        new.register_forward_pre_hook(hook, with_kwargs=key in old._forward_pre_hooks_with_kwargs)
    for key, hook in old._forward_hooks.items():
        new.register_forward_hook(
            hook,
            with_kwargs=key in old._forward_hooks_with_kwargs,
            always_call=key in old._forward_hooks_always_called,
        )


def _record_layout(router: HFRouterGate, block: torch.nn.Module, args) -> None:
    """Block pre-hook: the router learns the block input's [B, S]."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
        router.token_layout = (args[0].shape[0], args[0].shape[1])


def _sites_and_config(model: torch.nn.Module, options: dict):
    """The routers to replace and the one config they share; ValueError when unsupported."""
    if _release() < OLDEST_TRANSFORMERS:
        raise ValueError(
            f"transformers {transformers.__version__} is not supported: its MoE routers differ "
            "from those this integration replaces; valid: transformers >= "
            f"{'.'.join(map(str, OLDEST_TRANSFORMERS))} "
            "(pip install 'shardwork-moe-router[transformers]')"
        )
    sites = _find_routers(model)
    if not sites:
        raise ValueError(
            f"model {type(model).__name__} has no transformers MoE router of a supported class "
            f"{tuple(ROUTING_RULES)} under an attribute in {GATE_ATTRIBUTES}"
        )
    hf_config = model.config.to_dict()
    configs = [config_for_router(getattr(b, a), hf_config, **options) for _, b, a in sites]
    config = configs[0]
    for (name, _, attribute), other in zip(sites, configs):
        if other != config:
            raise ValueError(
                f"router {name}.{attribute} routes differently from the first one ({other} vs "
                f"{config}): one model's MoE layers must share one routing"
            )
    return sites, config


def router_config_for(model: torch.nn.Module, **options) -> RouterConfig:
    """The :class:`RouterConfig` ``swap_routers(model, **options)`` gives every router,
    without changing the model (ValueError as :func:`swap_routers`)."""
    return _sites_and_config(model, options)[1]


def swap_routers(model: torch.nn.Module, *, dp_group=None, **options) -> RouterSwap:
    """Replace, in place, every router of a transformers 5 MoE model by shardwork's.

    ``model``: a ``PreTrainedModel`` (``...ForCausalLM`` or its base model) of Mixtral,
    Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE or gpt-oss. ``options``: load-balancing fields
    of :class:`RouterConfig` (``families.BALANCING_OPTIONS``: ``load_balancing_type``,
    ``aux_loss_coeff``, ``z_loss_coeff``, ``capacity_factor``, ``token_drop_policy``,
    ``expert_bias_update_rate``, ``input_jitter_eps``, ``check_finite``); the routing comes
    from the model. ``dp_group``: the data-parallel group (global aux loss and expert-bias
    update count tokens over it); None for one process.

    Without options the outputs equal the original model's to fp32 rounding. Returns the
    :class:`RouterSwap`; call its :meth:`~RouterSwap.step` after every optimizer step (or
    :meth:`~RouterSwap.attach` it to the optimizer). Bad input raises ValueError before the
    model is changed.
    """
    if any(isinstance(module, HFRouterGate) for module in model.modules()):
        raise ValueError("model already has shardwork routers: swap_routers was called on it")
    sites, config = _sites_and_config(model, options)
    _install_output_recorders(model, [name for name, _, _ in sites])
    device = getattr(sites[0][1], sites[0][2]).weight.device
    tracker = AuxLossTracker(num_layers=len(sites), num_experts=config.num_experts, device=device)
    routers = []
    for index, (_, block, attribute) in enumerate(sites):
        hf_router = getattr(block, attribute)
        router = HFRouterGate(
            config, hf_router=hf_router, tracker=tracker, layer_index=index, dp_group=dp_group
        )
        _move_hooks(hf_router, router)
        setattr(block, attribute, router)
        block.register_forward_pre_hook(partial(_record_layout, router))
        routers.append(router)
    return RouterSwap(model, routers, config=config, tracker=tracker, dp_group=dp_group)


class RouterSwap:
    """The routers :func:`swap_routers` put into a model, and the calls a training loop makes.

    Attributes: ``routers`` (the :class:`HFRouterGate` modules, MoE-layer order), ``config``
    (their :class:`RouterConfig`), ``tracker`` (per-layer loss values without coefficients and
    token counts of the current step), ``last_step_summary`` (what :meth:`step` returned).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        routers: list[HFRouterGate],
        *,
        config: RouterConfig,
        tracker: AuxLossTracker,
        dp_group=None,
    ) -> None:
        self.routers = routers
        self.config = config
        self.tracker = tracker
        self.dp_group = dp_group
        self.last_step_summary: dict[str, float] = {}
        self._coefficients = loss_coefficients(config)
        self._has_losses = bool((self._coefficients > 0).any())
        self._signature = inspect.signature(model.forward)
        self._forward_state: tuple[AuxLossScale, torch.Tensor] | None = None
        self._micro_batches = 0
        if self._has_losses and hasattr(model, "router_aux_loss_coef"):
            # transformers' own load-balancing loss would count a second time.
            model.router_aux_loss_coef = 0.0
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward, with_kwargs=True)

    def step(self) -> dict[str, float]:
        """Once per optimizer step, after it (every rank of ``dp_group``): move the expert
        bias by its token counts summed over ``dp_group``, clear the global aux loss's running
        counts, reduce the tracker over ``dp_group`` and return its summary (losses without
        coefficients, mean over layers and micro-batches; ``load_imbalance``), then reset it."""
        update_expert_bias(self.routers, group=self.dp_group)
        for router in self.routers:
            router.reset_step_state()
        if self.dp_group is not None:
            self.tracker.reduce(dp_group=self.dp_group)
        summary = self.tracker.summary(num_micro_batches=max(self._micro_batches, 1))
        self.tracker.reset()
        self._micro_batches = 0
        self.last_step_summary = summary
        return summary

    def attach(self, optimizer: torch.optim.Optimizer):
        """Run :meth:`step` after every ``optimizer.step()``; returns the removable handle."""
        return optimizer.register_step_post_hook(lambda *_: self.step())

    def _before_forward(self, model, args, kwargs):
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        mask = bound.get("attention_mask")
        padding_BS = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            padding_BS = mask == 0
        scale = AuxLossScale(1.0)
        for router in self.routers:
            router.loss_scale = scale
            router.padding_BS = padding_BS
            router.recomputing = False
        self._forward_state = (scale, self.tracker.losses.clone())

    def _after_forward(self, model, args, kwargs, output):
        scale, losses_before = self._forward_state
        for router in self.routers:  # a call from now on recomputes this forward's
            router.recomputing = True
        if model.training and torch.is_grad_enabled():
            self._micro_batches += 1
        if not self._has_losses or not isinstance(output, ModelOutput):
            return None
        if not hasattr(output, "aux_loss"):
            return None
        total = weighted_total(losses_before, self.tracker.losses, self._coefficients)
        loss = output.get("loss")
        output["aux_loss"] = total.to(torch.float32)
        if loss is not None:
            if loss.requires_grad:
                loss = LossGradientToScale.apply(loss, scale)
            output["loss"] = loss + total.to(device=loss.device, dtype=loss.dtype)
        return output
