"""LoRA on a shardwork model: add adapters, merge/unmerge, adapter-only state.

- :func:`apply_lora` freezes every parameter of the model and gives each linear matched by
  ``LoRAConfig.target_modules`` (on global module names, see
  :meth:`ShardedModule.named_sharded_modules`) its ``lora_A`` / ``lora_B`` factors
  (:mod:`shardwork.models.lora_linear`, :mod:`shardwork.models.lora_experts`), the only
  parameters left trainable. Initial values are PEFT's default, ``A ~ U(-1/sqrt(in),
  1/sqrt(in))`` (kaiming-uniform with ``a = sqrt(5)``) and ``B = 0``, drawn per global key
  like the base weights, so every layout holds the same global adapter for a seed.
- :func:`merge_lora` / :func:`unmerge_lora` fold the adapters into each rank's base shard and
  restore the kept shard bit-exactly.
- :func:`lora_state_dict` is the model's sharded state dict restricted to adapter keys (for
  adapter-only checkpoints); :func:`load_lora_state` fills the adapters from full (unsharded)
  tensors keyed like :func:`full_state_dict` (PEFT import, tests), slicing per rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.models.lora_config import LoRAConfig
from shardwork.models.lora_experts import LoRAExpertLinear, LoRAExpertShards
from shardwork.models.lora_linear import (
    LoRAColumnParallelLinear,
    LoRAFactor,
    LoRALinearMixin,
    LoRAReplicatedLinear,
    LoRARowParallelLinear,
)
from shardwork.models.mla import ReplicatedLinear
from shardwork.models.module import ShardedModule
from shardwork.models.moe.experts import SHARDS_ATTRIBUTE, ExpertLinear
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.sharding import UniformInit, describe_param, init_from_shards, param_blocks
from shardwork.parallel_state import ParamMeta, get_param_meta

__all__ = [
    "apply_lora",
    "is_base_key",
    "is_lora_key",
    "load_lora_state",
    "lora_modules",
    "lora_state_dict",
    "lora_target_names",
    "merge_lora",
    "unmerge_lora",
]

_LORA_CLASS = {
    ColumnParallelLinear: LoRAColumnParallelLinear,
    RowParallelLinear: LoRARowParallelLinear,
    ReplicatedLinear: LoRAReplicatedLinear,
    ExpertLinear: LoRAExpertLinear,
}
_HEAD = "output_layer"


def is_lora_key(key: str) -> bool:
    """Whether checkpoint key ``key`` names an adapter factor."""
    return ".lora_A.weight" in key or ".lora_B.weight" in key


def is_base_key(key: str) -> bool:
    """Whether checkpoint key ``key`` names a model tensor, not an adapter factor (the keys a
    Hugging Face export of a merged LoRA model writes)."""
    return not is_lora_key(key)


def _adaptable(name: str, module: torch.nn.Module) -> bool:
    return type(module) in _LORA_CLASS and name.split(".", 1)[0] != _HEAD


def lora_target_names(
    model: ShardedModule, config: LoRAConfig, *, require_every_target: bool = True
) -> list[str]:
    """Global names of the modules ``config`` adapts in ``model``; raises ``ValueError`` when a
    target matches a module LoRA cannot adapt, or (with ``require_every_target``) a target
    matches nothing. A pipeline stage passes False: its layers may hold only some targets (the
    whole model was checked once, e.g. by the trainer's config validation)."""
    named = list(model.named_sharded_modules())
    suffixes = sorted({n.rsplit(".", 1)[-1] for n, m in named if _adaptable(n, m)})
    chosen = []
    for name, module in named:
        if not name or not config.matches(name):
            continue
        if not _adaptable(name, module):
            why = "the LM head" if name.startswith(_HEAD) else type(module).__name__
            raise ValueError(
                f"LoRAConfig.target_modules={_show(config.target_modules)} matches {name!r} "
                f"({why}), which LoRA cannot adapt: targets must be linear layers, e.g. "
                f"{suffixes}"
            )
        chosen.append(name)
    targets = config.target_modules
    unmatched = (
        [t for t in targets if not any(_matches_one(n, t) for n in chosen)]
        if isinstance(targets, tuple)
        else ([] if chosen else [targets])
    )
    if unmatched and require_every_target:
        raise ValueError(
            f"LoRAConfig.target_modules: {unmatched} match no module of this model; "
            f"available module-name suffixes: {suffixes}{_regex_hint(targets, unmatched)}"
        )
    return chosen


_REGEX_ONLY_CHARACTERS = frozenset("\\*+?[](){}|^$")
"""Characters no module name holds but regular expressions do ('.' is in dotted suffixes)."""


def _regex_hint(targets, unmatched: list[str]) -> str:
    """Where a list entry that matched nothing looks like a regular expression (a command line
    makes a list of one value), how to give one."""
    if not isinstance(targets, tuple) or not any(
        _REGEX_ONLY_CHARACTERS & set(t) for t in unmatched
    ):
        return ""
    return (
        "; a list entry is a module-name suffix, not a regular expression: to choose modules by "
        "regular expression give target_modules as one string (in a config file: "
        "target_modules = '<regex>')"
    )


def _matches_one(name: str, target: str) -> bool:
    """PEFT's suffix rule for one list entry (see :class:`LoRAConfig`)."""
    return name == target or name.endswith("." + target)


def _show(targets) -> str:
    return repr(list(targets)) if isinstance(targets, tuple) else repr(targets)


def apply_lora(
    model: ShardedModule, config: LoRAConfig, *, require_every_target: bool = True
) -> list[str]:
    """Freeze ``model`` and add adapters to the linears ``config`` targets (see module
    docstring); returns the adapted modules' global names. ``model`` must have a ``config``
    (``init_seed``, ``init_method_std``, ``num_layers``) and may have an ``rng_tracker``.
    ``require_every_target``: see :func:`lora_target_names`."""
    if any(isinstance(m, LoRALinearMixin) for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    names = lora_target_names(model, config, require_every_target=require_every_target)
    modules = dict(model.named_sharded_modules())
    for name in names:
        module = modules[name]
        if isinstance(module, ExpertLinear) and module.shards.etp_size > 1:
            raise ValueError(
                f"LoRA on experts ({name}) needs expert tensor parallelism 1, got etp="
                f"{module.shards.etp_size}; use etp=1 or leave the experts out of target_modules"
            )
    for p in model.parameters():
        p.requires_grad_(False)
    rng = getattr(model, "rng_tracker", None)
    for name in names:
        _add_adapter(modules[name], config, rng)
    cfg = model.config
    for key, param, module in model.named_param_keys():
        if is_lora_key(key) and param.device.type != "meta":
            init_from_shards(
                param,
                key,
                module.shard_ctx,
                init_seed=cfg.init_seed,
                std=cfg.init_method_std,
                num_layers=cfg.num_layers,
            )
    return names


def _add_adapter(module: ShardedModule, config: LoRAConfig, rng) -> None:
    a, b = (
        _expert_factors(module, config.rank)
        if isinstance(module, ExpertLinear)
        else _dense_factors(module, config.rank)
    )
    module.__class__ = _LORA_CLASS[type(module)]
    module.attach_lora(LoRAFactor(module.groups, a), LoRAFactor(module.groups, b), config, rng)


def _factor(shape, like: torch.Tensor, meta: ParamMeta, init, blocks=None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device))
    return describe_param(p, meta, init=init, blocks=blocks)


def _kaiming(fan_in: int) -> UniformInit:
    # PEFT's default A init: kaiming_uniform_(a=sqrt(5)) has bound gain·sqrt(3/fan_in) with
    # gain = sqrt(2/(1+a²)) = sqrt(1/3), i.e. 1/sqrt(fan_in).
    bound = fan_in**-0.5
    return UniformInit(-bound, bound)


def _dense_factors(module, r: int):
    w = module.weight
    out_local, in_local = w.shape
    sp = getattr(module, "sequence_parallel", False)
    if isinstance(module, ColumnParallelLinear):
        base = get_param_meta(w)
        a = _factor((r, in_local), w, ParamMeta(sequence_parallel=sp), _kaiming(in_local))
        b_meta = ParamMeta(tp_axis=0, tp_partition_sizes=base.tp_partition_sizes)
        b = _factor((out_local, r), w, b_meta, "zeros", blocks=param_blocks(w))
    elif isinstance(module, RowParallelLinear):
        a = _factor((r, in_local), w, ParamMeta(tp_axis=1), _kaiming(module.input_size))
        b = _factor((out_local, r), w, ParamMeta(sequence_parallel=sp), "zeros")
    else:
        a = _factor((r, in_local), w, ParamMeta(), _kaiming(in_local))
        b = _factor((out_local, r), w, ParamMeta(), "zeros")
    return a, b


def _expert_factors(module: ExpertLinear, r: int):
    """Stacked ``A [L, r, in]`` / ``B [L, out, r]`` with per-expert shards (etp == 1 here)."""
    w, s = module.weight, module.shards
    L, out_local, in_local = w.shape
    common = dict(
        first_expert=s.first_expert,
        etp_rank=s.etp_rank,
        etp_size=s.etp_size,
        replica_rank=s.replica_rank,
        init=s.init,
    )
    base = get_param_meta(w)
    fc1 = s.ffn_axis == 1  # fc1's ffn axis is its output; fc2's its input
    fan_in = in_local if fc1 else s.ffn_size
    a_shards = LoRAExpertShards(
        ffn_axis=1 if fc1 else 2,
        ffn_size=r if fc1 else s.ffn_size,
        blocks=None,
        bound=fan_in**-0.5,
        **common,
    )
    b_shards = LoRAExpertShards(
        ffn_axis=1 if fc1 else 2,
        ffn_size=s.ffn_size if fc1 else r,
        blocks=s.blocks if fc1 else None,
        bound=None,
        **common,
    )
    a_meta = ParamMeta(is_expert=True, tp_axis=None if fc1 else 2)
    b_meta = (
        ParamMeta(is_expert=True, tp_axis=1, tp_partition_sizes=base.tp_partition_sizes)
        if fc1
        else ParamMeta(is_expert=True)
    )
    a = _factor((L, r, in_local), w, a_meta, "zeros")
    b = _factor((L, out_local, r), w, b_meta, "zeros")
    setattr(a, SHARDS_ATTRIBUTE, a_shards)
    setattr(b, SHARDS_ATTRIBUTE, b_shards)
    return a, b


def lora_modules(model: torch.nn.Module) -> Iterator[LoRALinearMixin]:
    """Every adapted linear of ``model``."""
    return (m for m in model.modules() if isinstance(m, LoRALinearMixin))


def merge_lora(model: torch.nn.Module) -> None:
    """Fold every adapter into its base shard (per rank, no gather); forward then runs the
    base weights only. The original shards are kept for :func:`unmerge_lora`."""
    for module in lora_modules(model):
        module.merge_lora()


def unmerge_lora(model: torch.nn.Module) -> None:
    """Restore every base shard kept by :func:`merge_lora`, bit-exactly."""
    for module in lora_modules(model):
        module.unmerge_lora()


def lora_state_dict(model: ShardedModule) -> dict[str, ShardedTensor]:
    """The adapter factors of ``model`` as ShardedTensors in global coordinates."""
    return {k: st for k, st in model.sharded_state_dict().items() if is_lora_key(k)}


@torch.no_grad()
def load_lora_state(model: ShardedModule, full: Mapping[str, torch.Tensor]) -> None:
    """Fill ``model``'s adapters from full (unsharded) tensors keyed like
    :func:`lora_key_names` (what ``full_state_dict`` gives), each rank copying its slice."""
    template = lora_state_dict(model)
    given = {k for k in full if is_lora_key(k)}
    missing, unexpected = sorted(set(template) - given), sorted(given - set(template))
    if missing or unexpected:
        raise ValueError(
            f"load_lora_state: adapter keys differ from the model's: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
            f"{' ...' if len(unexpected) > 4 else ''} (was the adapter made with another "
            "target_modules or model?)"
        )
    for key, st in template.items():
        tensor = full[key]
        if tuple(tensor.shape) != tuple(st.global_shape):
            raise ValueError(
                f"load_lora_state: {key} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(st.global_shape)} (a different LoRA rank?)"
            )
        index = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.data.shape))
        st.data.copy_(tensor[index])
