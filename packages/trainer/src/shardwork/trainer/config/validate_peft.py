"""The ``[peft]`` section: its LoRAConfig, and its checks before any work starts.

Checked: the method, each LoRA option (shardwork.models' ``LoRAConfig`` does the checking;
its messages are renamed to the ``peft.*`` keys), the targets against the model's modules (a
world-size-1 model built on the meta device, so nothing is allocated: a target that matches
no module is named with the module-name suffixes that exist), and combinations the LoRA path
does not serve: experts adapted under expert tensor parallelism (etp > 1) and the Muon
optimizer. ``checkpoint.hf_export`` of a LoRA run writes the merged model. ``peft.export``
(a PEFT folder of the adapters) needs ``checkpoint.hf_init`` (the base it attaches to), a new
or empty directory, one model chunk per rank, and a PEFT counterpart for every adapted linear.
``peft.init`` (a PEFT folder to start the adapters from) needs ``checkpoint.hf_init`` and
the folder's LoRA options written in the section.
"""

from __future__ import annotations

from pathlib import Path

from shardwork.models import GPTConfig, GPTModel, LoRAConfig
from shardwork.models.hf.peft_import import import_peft
from shardwork.models.hf.peft_modules import is_routed_experts, peft_linears
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
        if p.export is not None:
            problems.append(
                f"peft.export={p.export!r} needs peft.method='lora' (there are no adapters to "
                "export); set method='lora' or leave export unset"
            )
        if p.init is not None:
            problems.append(
                f"peft.init={p.init!r} needs peft.method='lora' (there are no adapters to "
                "load it into); set method='lora' or leave init unset"
            )
        return
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
    if p.export is not None:
        _check_export(config, model, lora, names, problems)
    if p.init is not None:
        _check_init(config, model, lora, problems)


def _check_init(config, model: GPTConfig, lora: LoRAConfig, problems) -> None:
    """``peft.init``: a PEFT folder for the hf_init model whose LoRA options are the section's."""
    where = f"peft.init={config.peft.init!r}"
    if config.checkpoint.hf_init is None:
        problems.append(f"{where} needs checkpoint.hf_init: the Hugging Face model it adapts")
        return
    try:
        _, found = import_peft(config.peft.init, model.replace(sequence_parallel=False))
    except (ValueError, OSError) as exc:
        problems.append(f"{where}: {exc}")
        return
    fields = ("rank", "alpha", "use_rslora", "target_modules")
    differ = [f for f in fields if getattr(found, f) != getattr(lora, f)]
    if differ:
        want = ", ".join(f"{f} = {getattr(found, f)!r}" for f in fields)
        problems.append(
            f"{where} holds adapters with other LoRA options ({', '.join(differ)} differ): "
            f"write in [peft]: {want}"
        )


def _check_export(config, model: GPTConfig, lora: LoRAConfig, names, problems) -> None:
    """``peft.export``: where it goes, and that PEFT has a module for every adapted linear."""
    where = f"peft.export={config.peft.export!r}"
    path = Path(config.peft.export)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        problems.append(f"{where}: exists and is not an empty directory; valid: a new path")
    if config.checkpoint.hf_init is None:
        problems.append(
            f"{where} needs checkpoint.hf_init: a PEFT adapter attaches to a Hugging Face base "
            "model, and the run's base must be that model"
        )
    if config.parallel.vpp is not None and config.parallel.vpp > 1:
        problems.append(f"{where} with parallel.vpp={config.parallel.vpp}: leave vpp unset")
    try:
        linears = peft_linears(model.replace(sequence_parallel=False))
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
        return
    missing = [n for n in names if n not in linears and not is_routed_experts(n)]
    if missing:
        problems.append(
            f"{where}: PEFT has no module for {missing[:3]} ({len(missing)} adapted linears); "
            f"exportable targets: {sorted({n.rsplit('.', 1)[-1] for n in linears})}"
        )
    if lora.dropout and any(is_routed_experts(n) for n in names):
        problems.append(
            f"{where} with adapted experts needs peft.dropout=0 (PEFT refuses dropout on "
            f"expert parameters), got {lora.dropout}"
        )
