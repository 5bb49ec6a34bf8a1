"""Which shardwork linears have a Hugging Face PEFT counterpart, and under which HF module names.

PEFT puts one LoRA adapter on each ``nn.Linear`` of the transformers model. shardwork fuses
some of them: ``linear_qkv`` holds q/k/v (HF ``q_proj``/``k_proj``/``v_proj``) and ``fc1``
holds gate/up (``gate_proj``/``up_proj``). :func:`peft_linears` lists every adaptable linear
of a config as a :class:`PeftLinear`: its shardwork module name, its parts, and the HF module
of each part, found through the family's key rules (so each part's rows are the HF weight's
rows: the bridge's import copies them one to one).

Covered: attention ``linear_qkv`` / ``linear_proj``, MLA projections, dense and shared-expert
``fc1`` / ``fc2``, of families whose Hugging Face weights use the ``dense`` or ``experts``
layout; routed experts (:func:`is_routed_experts`) go through PEFT's ``target_parameters``
(:mod:`~shardwork.models.hf.peft_experts`). Families of the ``converted`` layout (Nemotron-H,
Qwen3-Next) are refused: their fused HF tensors are not one-to-one with shardwork's keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardwork.models.config import GPTConfig
from shardwork.models.gpt_model import GPTModel
from shardwork.models.hf.keys import to_hf_key
from shardwork.models.hf.registry import adapter_for_config

__all__ = [
    "PEFT_LINEAR_NAMES",
    "PeftLinear",
    "check_peft_family",
    "is_routed_experts",
    "peft_linears",
    "weight_shapes",
]

#: Leaf names of the shardwork linears that map to PEFT adapters on HF ``nn.Linear`` s.
PEFT_LINEAR_NAMES = (
    "linear_qkv",
    "linear_proj",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
    "fc1",
    "fc2",
)
# P.weight or P.weight.<part>; a digit part is a grouped expert's index
_WEIGHT_KEY = re.compile(r"(decoder\.layers\.\d+\..+)\.weight(?:\.([A-Za-z_]\w*))?")
_EXPERTS_MODULE = re.compile(r"decoder\.layers\.\d+\.(?:.+\.)?experts\.linear_fc[12]")


@dataclass(frozen=True)
class PeftLinear:
    """One shardwork linear (``prefix``) and the HF modules of its parts.

    ``parts`` are the fused block's part names in checkpoint order (``("q", "k", "v")``,
    ``("gate", "up")``) or ``("",)`` for an unfused linear; ``hf_modules[i]`` is the HF module
    of ``parts[i]`` (``model.layers.0.self_attn.q_proj``), ``out_sizes[i]`` its output rows,
    ``in_size`` the shared input width.
    """

    prefix: str
    parts: tuple[str, ...]
    hf_modules: tuple[str, ...]
    out_sizes: tuple[int, ...]
    in_size: int

    @property
    def leaf(self) -> str:
        """The shardwork module's own name (``linear_qkv``)."""
        return self.prefix.rsplit(".", 1)[-1]

    def base_key(self, part: str) -> str:
        """Checkpoint key of ``part``'s base weight (``P.weight`` or ``P.weight.q``)."""
        return f"{self.prefix}.weight" + (f".{part}" if part else "")


def check_peft_family(config: GPTConfig) -> None:
    """ValueError unless ``config``'s HF family stores its linears one to one with shardwork."""
    adapter = adapter_for_config(config)
    if adapter.weight_layout == "converted":
        raise ValueError(
            f"PEFT adapters of model_type={adapter.model_type!r} are not supported: its Hugging "
            "Face checkpoint fuses several shardwork weights into one tensor (the 'converted' "
            "weight layout), so a shardwork adapter is no PEFT adapter of one HF module; "
            "supported: families with the 'dense' or 'experts' weight layout"
        )


def is_routed_experts(prefix: str) -> bool:
    """Whether shardwork module ``prefix`` is a grouped-experts linear (one weight per expert)."""
    return _EXPERTS_MODULE.fullmatch(prefix) is not None


def weight_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Global shape of every checkpoint key of ``config``'s model (built on the meta device)."""
    check_peft_family(config)
    # Keys and global shapes only, no memory; they do not depend on the layout, so a config
    # trained with sequence parallelism (which needs tp > 1) is built here without it.
    model = GPTModel(config.replace(sequence_parallel=False), None, device="meta")
    return {key: tuple(st.global_shape) for key, st in model.sharded_state_dict().items()}


def peft_linears(
    config: GPTConfig, shapes: dict[str, tuple[int, ...]] | None = None
) -> dict[str, PeftLinear]:
    """Every adaptable linear of ``config``'s model (world size 1 shapes), by shardwork prefix.

    ``shapes``: :func:`weight_shapes` of ``config`` when the caller has it already.
    """
    shapes = weight_shapes(config) if shapes is None else shapes
    rules = adapter_for_config(config).key_rules()
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for key, shape in shapes.items():
        match = _WEIGHT_KEY.fullmatch(key)
        if match is None or len(shape) != 2:
            continue
        prefix, part = match[1], match[2] or ""
        if prefix.rsplit(".", 1)[-1] in PEFT_LINEAR_NAMES:
            found.setdefault(prefix, {})[part] = shape
    out = {}
    for prefix, parts in found.items():
        names = tuple(parts)
        hf = tuple(
            to_hf_key(f"{prefix}.weight" + (f".{p}" if p else ""), rules).removesuffix(".weight")
            for p in names
        )
        out[prefix] = PeftLinear(
            prefix=prefix,
            parts=names,
            hf_modules=hf,
            out_sizes=tuple(parts[p][0] for p in names),
            in_size=parts[names[0]][1],
        )
    return out
