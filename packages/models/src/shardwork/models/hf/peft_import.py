"""Import a Hugging Face PEFT LoRA folder as shardwork adapters (the rank-kr block rule).

PEFT trains an independent ``A`` per projection; shardwork's fused ``linear_qkv`` (``fc1``) has
one ``A`` for all its parts. When the targeted parts' ``A`` s are identical (a shardwork export),
the fused adapter is that ``A`` at rank ``r``, each part keeping its ``B`` (an untargeted part
gets a zero ``B``). Otherwise the ``k`` targeted parts become a rank-``k r`` block:
``A = cat(A_q, A_k, A_v)`` ``[k r, in]`` and each part's ``B`` is ``[out_part, k r]`` with its
own ``B`` in its ``r`` columns and zeros elsewhere (a part PEFT did not target is all zeros), so
``B_part A = B_part' A_part'`` exactly.

One ``LoRAConfig`` holds one rank, so every adapter is brought to the largest rank ``R = k r``
found, the smaller ones padded with zero rows of ``A`` and zero columns of ``B`` (their product
is unchanged, and the padding's gradients stay zero), and ``alpha`` is rescaled so the scale is
unchanged: ``alpha' = k alpha`` (``alpha / r``) or ``alpha sqrt(k)`` (rsLoRA, ``alpha / sqrt(r)``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.hf.peft_experts import EXPERT_PARAMS, expert_layers, experts_from_peft
from shardwork.models.hf.peft_format import read_peft_folder
from shardwork.models.hf.peft_modules import (
    PeftLinear,
    is_routed_experts,
    peft_linears,
    weight_shapes,
)
from shardwork.models.lora_config import LoRAConfig, lora_key_names

__all__ = ["import_peft"]

Factors = dict[str, dict[str, torch.Tensor]]


def _by_linear(
    modules: Factors, linears: dict[str, PeftLinear], rank: int, source: Path
) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """``{shardwork prefix: {part: (A, B)}}``; ValueError for HF modules with no shardwork twin."""
    owner = {m: (x.prefix, i) for x in linears.values() for i, m in enumerate(x.hf_modules)}
    unknown = sorted(m for m in modules if m not in owner)
    if unknown:
        experts = (
            " (routed experts are not mapped)" if any(".experts." in m for m in unknown) else ""
        )
        examples = ", ".join(list(owner)[:3])
        raise ValueError(
            f"{source}: adapters on {unknown[:4]} ({len(unknown)} modules) have no shardwork "
            f"linear{experts}; valid modules look like {examples}"
        )
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, f in modules.items():
        prefix, i = owner[module]
        linear = linears[prefix]
        want = {"A": (rank, linear.in_size), "B": (linear.out_sizes[i], rank)}
        for factor, shape in want.items():
            if tuple(f[factor].shape) != shape:
                raise ValueError(
                    f"{source}: {module}.lora_{factor} has shape {tuple(f[factor].shape)}, "
                    f"expected {shape} (r={rank})"
                )
        out.setdefault(prefix, {})[linear.parts[i]] = (f["A"], f["B"])
    return out


def _fuse(linear: PeftLinear, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """``(A, {part: B})`` of one fused linear: shared ``A`` when equal, else the block rule."""
    targeted = [p for p in linear.parts if p in parts]
    a_first, b_first = parts[targeted[0]]
    shared = all(torch.equal(parts[p][0], a_first) for p in targeted)
    blocks = [a_first] if shared else [parts[p][0] for p in targeted]
    a = torch.cat(blocks)
    r = a_first.shape[0]
    bs = {}
    for part, rows in zip(linear.parts, linear.out_sizes):
        b = b_first.new_zeros(rows, a.shape[0])
        if part in parts:
            col = 0 if shared else targeted.index(part) * r
            b[:, col : col + r] = parts[part][1]
        bs[part] = b
    return a, bs


def _pad(a: torch.Tensor, bs: dict[str, torch.Tensor], rank: int):
    """Zero rows of ``A`` and zero columns of each ``B`` up to ``rank``."""
    extra = rank - a.shape[0]
    a = torch.cat([a, a.new_zeros(extra, a.shape[1])])
    return a, {p: torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1) for p, b in bs.items()}


def _targets(chosen: set[str], order: dict[str, int]) -> tuple[str, ...] | str:
    """Leaf names when every module of those names is adapted, else a regex of the full names."""
    chosen_sorted = sorted(chosen, key=order.__getitem__)
    leaves = tuple(dict.fromkeys(p.rsplit(".", 1)[-1] for p in chosen_sorted))
    every = {p for p in order if p.rsplit(".", 1)[-1] in leaves}
    if every == chosen:
        return leaves
    return "|".join(p.replace(".", r"\.") for p in chosen_sorted)


def _experts(cfg, modules: Factors, shapes, rank: int, source: Path) -> dict[str, torch.Tensor]:
    """shardwork keys of the routed-expert adapters (``target_parameters``), popped from
    ``modules``; ValueError for parameter targets other than the fused experts'."""
    targets = list(cfg.get("target_parameters") or [])
    if not targets:
        return {}
    bad = [t for t in targets if t.rsplit(".", 1)[-1] not in EXPERT_PARAMS]
    layers = expert_layers(shapes)
    if bad or not layers:
        raise ValueError(
            f"{source}: target_parameters={bad or targets} cannot be imported: shardwork maps "
            f"only the routed experts' fused {' / '.join(EXPERT_PARAMS)} of mlp.experts"
            + ("" if layers else ", and this model has no routed experts")
        )
    return experts_from_peft(modules, targets, layers, rank)


def _pad_all(out: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Zero rows (``A``) or columns (``B``) up to ``rank`` on single adapter tensors."""
    padded = {}
    for key, t in out.items():
        if ".lora_A." in key:
            padded[key] = torch.cat([t, t.new_zeros(rank - t.shape[0], t.shape[1])])
        else:
            padded[key] = torch.cat([t, t.new_zeros(t.shape[0], rank - t.shape[1])], dim=1)
    return padded


def import_peft(
    folder: str | Path, config: GPTConfig
) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """Read a PEFT LoRA folder as ``(full adapters by shardwork key, LoRAConfig)`` for ``config``.

    The adapters are full (unsharded) tensors keyed like
    :func:`~shardwork.models.lora_key_names`, on every linear PEFT adapted (routed experts from
    ``target_parameters`` included); fused blocks follow the rank-``k r`` rule of this module's
    docstring, and the returned config's rank and alpha give every adapter PEFT's scale.
    ValueError (before anything is built) for a missing file, an unsupported PEFT option,
    adapters on modules shardwork cannot target, or wrong shapes.
    """
    folder = Path(folder)
    cfg, modules = read_peft_folder(folder)
    if not modules:
        raise ValueError(f"{folder}: adapter_model.safetensors holds no LoRA factor")
    shapes = weight_shapes(config)
    linears = peft_linears(config, shapes)
    rank = int(cfg["r"])
    experts = _experts(cfg, modules, shapes, rank, folder)
    grouped = _by_linear(modules, linears, rank, folder)
    fused = {p: _fuse(linears[p], grouped[p]) for p in linears if p in grouped}
    big = max([rank] + [a.shape[0] for a, _ in fused.values()])
    k = big // rank
    out: dict[str, torch.Tensor] = _pad_all(experts, big) if big > rank else experts
    for prefix, (a, bs) in fused.items():
        a, bs = _pad(a, bs, big)
        for part, b in bs.items():
            a_key, b_key = lora_key_names(linears[prefix].base_key(part))
            out[a_key], out[b_key] = a, b
    order: dict[str, int] = {}
    for key in shapes:
        prefix = key.partition(".weight")[0]
        if prefix in linears or is_routed_experts(prefix):
            order.setdefault(prefix, len(order))
    chosen = {key.partition(".lora_")[0] for key in out}
    use_rslora = bool(cfg.get("use_rslora", False))
    alpha = cfg["lora_alpha"] * (k**0.5 if use_rslora else k)
    lora = LoRAConfig(
        rank=big,
        alpha=alpha if k > 1 else cfg["lora_alpha"],
        dropout=float(cfg.get("lora_dropout") or 0.0),
        use_rslora=use_rslora,
        target_modules=_targets(chosen, order),
    )
    return out, lora
