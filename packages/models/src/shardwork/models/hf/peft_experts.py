"""Routed-expert LoRA adapters to and from PEFT's ``target_parameters`` layout (transformers 5).

transformers 5 keeps a MoE layer's experts as two 3-D parameters of ``model.layers.<L>.mlp.experts``:
``gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj
[E, H, I]``. PEFT adapts them with ``target_parameters`` (``lora.ParamWrapper``): one
``lora_A [E r, H_in]`` and one ``lora_B [out, r E]`` per parameter, expert ``e``'s update being
``B[:, e::E] @ A[e r:(e + 1) r]`` (PEFT reshapes ``A`` to ``(E, r, in)`` and ``B`` to
``(out, r, E)``). shardwork's expert ``e`` has ``linear_fc1`` ``A_e [r, H]`` shared by its gate
and up ``B`` s and ``linear_fc2`` ``A_e [r, I]``, ``B_e [H, r]``: the same products, so the
mapping is exact both ways (gate/up ``B`` s stacked into ``[2I, r]``).

Names in the file: PEFT nests one wrapper per targeted parameter in the parameters' registration
order (``gate_up_proj`` first), so with both targeted ``gate_up_proj``'s factors are
``...mlp.experts.base_layer.lora_A.weight`` and ``down_proj``'s ``...mlp.experts.lora_A.weight``;
with one targeted its factors have no ``base_layer``. PEFT refuses dropout on parameter targets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shardwork.models.lora_config import lora_key_names

__all__ = [
    "EXPERT_PARAMS",
    "ExpertsLayer",
    "expert_layers",
    "experts_from_peft",
    "experts_to_peft",
    "targeted_params",
]

#: transformers 5 fused expert parameters, in registration order (PEFT's nesting order).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_FC = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}
_FC1_GATE = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc1\.weight\.(\d+)\.gate")


@dataclass(frozen=True)
class ExpertsLayer:
    """The routed experts of decoder layer ``layer``: ``num_experts`` of width ``ffn`` on
    ``hidden``; ``hf_module`` is their transformers 5 module."""

    layer: int
    num_experts: int
    hidden: int
    ffn: int

    @property
    def hf_module(self) -> str:
        return f"model.layers.{self.layer}.mlp.experts"

    def base_key(self, param: str, expert: int, part: str = "") -> str:
        """shardwork checkpoint key of ``expert``'s weight of fused parameter ``param``."""
        suffix = f".{part}" if part else ""
        return f"decoder.layers.{self.layer}.mlp.experts.{_FC[param]}.weight.{expert}{suffix}"

    def file_module(self, param: str, targeted: tuple[str, ...]) -> str:
        """The module name PEFT's file uses for ``param``'s factors (see the module docstring)."""
        outer = targeted[-1]
        return self.hf_module + ("" if param == outer else ".base_layer")


def expert_layers(shapes: dict[str, tuple[int, ...]]) -> dict[int, ExpertsLayer]:
    """The gated routed-expert layers among checkpoint ``shapes`` (:func:`weight_shapes`)."""
    experts: dict[int, set[int]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for key, shape in shapes.items():
        if (m := _FC1_GATE.fullmatch(key)) is not None:
            experts.setdefault(int(m[1]), set()).add(int(m[2]))
            sizes[int(m[1])] = shape  # [I, H]
    return {
        layer: ExpertsLayer(layer, len(ids), sizes[layer][1], sizes[layer][0])
        for layer, ids in sorted(experts.items())
    }


def _param_factors(full, x: ExpertsLayer, param: str, rank: int):
    """``(lora_A [E r, in], lora_B [out, r E])`` of one fused parameter from shardwork keys."""
    a_parts, b_parts = [], []
    parts = ("gate", "up") if param == "gate_up_proj" else ("",)
    a_shape = (rank, x.hidden if param == "gate_up_proj" else x.ffn)
    b_rows = x.ffn if param == "gate_up_proj" else x.hidden
    for e in range(x.num_experts):
        bs = []
        for part in parts:
            a_key, b_key = lora_key_names(x.base_key(param, e, part))
            for key, shape in ((a_key, a_shape), (b_key, (b_rows, rank))):
                if key not in full:
                    raise ValueError(f"full_adapters has no {key!r} (every expert needs A and B)")
                if tuple(full[key].shape) != shape:
                    raise ValueError(
                        f"full_adapters[{key!r}] has shape {tuple(full[key].shape)}, expected {shape}"
                    )
            bs.append(full[b_key])
        a_parts.append(full[a_key])
        b_parts.append(torch.cat(bs))  # [out, r]: gate rows then up rows
    # column j * E + e of PEFT's B is column j of expert e's B
    return torch.cat(a_parts), torch.stack(b_parts, dim=2).flatten(1)


def experts_to_peft(
    full: dict[str, torch.Tensor], layers: dict[int, ExpertsLayer], rank: int
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str], set[str]]:
    """``({file module name: (A, B)}, target_parameters, shardwork keys used)`` of the expert
    adapters in ``full``; ``target_parameters`` are suffixes (``mlp.experts.down_proj``) when
    every MoE layer has the same targets, else full parameter names."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    per_layer: dict[int, tuple[str, ...]] = {}
    used: set[str] = set()
    for x in layers.values():
        targeted = tuple(p for p in EXPERT_PARAMS if lora_key_names(x.base_key(p, 0))[0] in full)
        per_layer[x.layer] = targeted
        for param in targeted:
            out[x.file_module(param, targeted)] = _param_factors(full, x, param, rank)
            parts = ("gate", "up") if param == "gate_up_proj" else ("",)
            for e in range(x.num_experts):
                for part in parts:
                    used.update(lora_key_names(x.base_key(param, e, part)))
    if len(set(per_layer.values())) == 1:
        targets = [f"mlp.experts.{p}" for p in next(iter(per_layer.values()))]
    else:
        targets = [f"{layers[i].hf_module}.{p}" for i, ps in per_layer.items() for p in ps]
    return out, targets, used


def targeted_params(x: ExpertsLayer, target_parameters: list[str]) -> tuple[str, ...]:
    """Which of ``x``'s fused parameters PEFT's ``target_parameters`` (suffixes) select."""
    return tuple(
        p
        for p in EXPERT_PARAMS
        if any(
            f"{x.hf_module}.{p}" == t or f"{x.hf_module}.{p}".endswith("." + t)
            for t in target_parameters
        )
    )


def experts_from_peft(
    modules: dict[str, dict[str, torch.Tensor]],
    target_parameters: list[str],
    layers: dict[int, ExpertsLayer],
    rank: int,
) -> dict[str, torch.Tensor]:
    """shardwork expert adapter tensors of PEFT's expert factors (popped from ``modules``)."""
    out: dict[str, torch.Tensor] = {}
    for x in layers.values():
        targeted = targeted_params(x, target_parameters)
        for param in targeted:
            name = x.file_module(param, targeted)
            if name not in modules:
                raise ValueError(f"the adapter has no factors of {x.hf_module}.{param} ({name})")
            f = modules.pop(name)
            e_count = x.num_experts
            in_size = x.hidden if param == "gate_up_proj" else x.ffn
            out_size = 2 * x.ffn if param == "gate_up_proj" else x.hidden
            want = {"A": (e_count * rank, in_size), "B": (out_size, rank * e_count)}
            for factor, shape in want.items():
                if tuple(f[factor].shape) != shape:
                    raise ValueError(
                        f"{name}.lora_{factor} ({param}) has shape {tuple(f[factor].shape)}, "
                        f"expected {shape} (r={rank}, {e_count} experts)"
                    )
            for e in range(e_count):
                b = f["B"][:, e::e_count]
                parts = (
                    {"gate": b[: x.ffn], "up": b[x.ffn :]} if param == "gate_up_proj" else {"": b}
                )
                for part, b_part in parts.items():
                    a_key, b_key = lora_key_names(x.base_key(param, e, part))
                    out[a_key] = f["A"][e * rank : (e + 1) * rank].clone()
                    out[b_key] = b_part.contiguous().clone()
    return out
