"""The ``[peft]`` section: its LoRAConfig, and its checks before any work starts.

Checked: the method, each LoRA option (shardwork.models' ``LoRAConfig`` does the checking;
its messages are renamed to the ``peft.*`` keys), the targets against the model's modules (a
world-size-1 model built on the meta device, so nothing is allocated: a target that matches
no module is named with the module-name suffixes that exist), and combinations the LoRA path
does not serve: experts adapted under expert tensor parallelism (etp > 1), the Muon
optimizer, and ``checkpoint.hf_export`` (it would drop the adapters).
"""

from __future__ import annotations

from shardwork.models import GPTConfig, GPTModel, LoRAConfig
from shardwork.models.lora import lora_target_names
from shardwork.parallel_state import ProcessGroups

__all__ = ["PEFT_METHODS", "check_peft", "lora_config_of"]

PEFT_METHODS = ("none", "lora")


def lora_config_of(config) -> LoRAConfig | None:
    """The run's ``LoRAConfig`` (None without ``peft.method = 'lora'``); ValueError if invalid."""
    p = config.peft
    if p.method != "lora":
        return None
    try:
        return LoRAConfig(
            rank=p.rank,
            alpha=p.alpha,
            dropout=p.dropout,
            use_rslora=p.use_rslora,
            target_modules=p.target_modules,
        )
    except ValueError as exc:
        raise ValueError(str(exc).replace("LoRAConfig.", "peft.")) from None


def check_peft(config, model: GPTConfig | None, expert_tp: int, problems: list[str]) -> None:
    """Append a line per problem of ``config.peft`` (``model``: the resolved GPTConfig, None
    when it could not be built; ``expert_tp``: the run's etp)."""
    p = config.peft
    if p.method not in PEFT_METHODS:
        problems.append(f"peft.method={p.method!r}: must be one of {list(PEFT_METHODS)}")
        return
    try:
        lora = lora_config_of(config)
    except ValueError as exc:
        problems.append(str(exc))
        return
    if lora is None:
        return
    if config.checkpoint.hf_export is not None:
        problems.append(
            f"peft.method='lora' with checkpoint.hf_export={config.checkpoint.hf_export!r} is "
            "not supported: the Hugging Face export writes base weights only and would drop the "
            "adapters; leave hf_export unset (the run's checkpoints hold the adapters)"
        )
    if config.optimizer.name == "muon":
        problems.append(
            "peft.method='lora' with optimizer.name='muon' is not supported: Muon orthogonalises "
            "whole weight matrices, and LoRA trains rank-r factors; use optimizer.name='adamw'"
        )
    if model is None:
        return
    # World size 1 on the meta device: module names do not depend on the layout, so SP (which
    # needs tp > 1) is switched off for this shape-only build.
    meta = GPTModel(model.replace(sequence_parallel=False), ProcessGroups.single(), device="meta")
    try:
        names = lora_target_names(meta, lora)
    except ValueError as exc:
        problems.append(str(exc).replace("LoRAConfig.", "peft."))
        return
    experts = [n for n in names if ".experts." in n]
    if experts and expert_tp > 1:
        problems.append(
            f"peft.target_modules adapts experts ({experts[0]}, ...) but parallel.etp="
            f"{expert_tp}: LoRA on experts needs etp=1 (set parallel.etp=1 or leave the "
            "experts out of target_modules)"
        )
