"""``LoRAConfig``: which linears get low-rank adapters, and their rank, scale and dropout.

A LoRA adapter adds ``scaling * B (A x)`` to a frozen linear ``W x``: ``A`` is ``[r, in]``,
``B`` is ``[out, r]`` and ``scaling`` is ``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA,
which keeps the update's scale steady as the rank grows).

Modules are chosen the way PEFT's ``target_modules`` chooses them, on shardwork's module
names (``decoder.layers.3.self_attention.linear_qkv``): a list entry matches a module whose
name equals it or ends with ``"." + entry``; a single string is a regular expression that must
match the whole name.

Adapter tensors are named after the base weight they adapt, so checkpoints and exports can
find one from the other (:func:`lora_key_names`): base ``P.weight`` (``P.weight.q`` for a
fused block's part) has ``P.lora_A.weight`` and ``P.lora_B.weight`` (``P.lora_B.weight.q``):
``B`` carries the base weight's output layout, ``A`` its input layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shardwork.models.field_types import check_field_types

__all__ = ["LoRAConfig", "lora_key_names"]


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the linears matched by ``target_modules``."""

    rank: int = 8
    """Inner width ``r`` of the adapter."""
    alpha: float = 16.0
    """Numerator of the scale (``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only); the base path never sees it."""
    use_rslora: bool = False
    """Rank-stabilised scale ``alpha / sqrt(r)`` instead of ``alpha / r``."""
    target_modules: tuple[str, ...] | str = field(
        default=("linear_qkv", "linear_proj", "fc1", "fc2")
    )
    """Module-name suffixes (tuple) or one full-name regular expression (str)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(
                f"LoRAConfig.rank={self.rank!r} is invalid: it must be an integer >= 1"
            )
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float):
            raise ValueError(f"LoRAConfig.alpha={self.alpha!r} is invalid: it must be a number")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"LoRAConfig.dropout={self.dropout!r} is invalid: it must be in [0, 1)"
            )
        targets = self.target_modules
        if isinstance(targets, list):
            object.__setattr__(self, "target_modules", tuple(targets))
            targets = self.target_modules
        if isinstance(targets, str):
            try:
                re.compile(targets)
            except re.error as err:
                raise ValueError(
                    f"LoRAConfig.target_modules={targets!r} is not a valid regular expression: "
                    f"{err}"
                ) from None
        elif not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"LoRAConfig.target_modules={targets!r} is invalid: give a non-empty list of "
                "module-name suffixes (e.g. ['linear_qkv', 'fc2']) or one regular expression"
            )

    @property
    def scaling(self) -> float:
        """The factor on ``B A x``."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def matches(self, module_name: str) -> bool:
        """Whether the module called ``module_name`` gets an adapter."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_name) is not None
        return any(module_name == t or module_name.endswith("." + t) for t in self.target_modules)


def lora_key_names(base_key: str) -> tuple[str, str]:
    """``(A key, B key)`` of the adapter on checkpoint key ``base_key`` (``P.weight[.part]``).

    ``A`` drops the part suffix (one ``A`` serves all parts of a fused block); ``B`` keeps it.
    Grouped experts' keys (``P.weight.<expert>[.part]``) keep the expert index on both: every
    expert has its own adapter.
    """
    prefix, sep, part = base_key.partition(".weight")
    if not sep or (part and not part.startswith(".")):
        raise ValueError(f"{base_key!r} is not a weight key (expected 'P.weight' or 'P.weight.X')")
    first = part[1:].split(".", 1)[0]
    expert = f".{first}" if first.isdigit() else ""
    return f"{prefix}.lora_A.weight{expert}", f"{prefix}.lora_B.weight{part}"
