"""``MTPConfig``: multi-token prediction options (``GPTConfig.mtp``), validated on construction.

Its own module so that ``GPTConfig`` (which holds one) and :mod:`shardwork.models.mtp` (which
builds the prediction depths from one) both depend on it, and not on each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardwork.models.field_types import check_field_types

__all__ = ["MTPConfig"]


@dataclass(frozen=True, kw_only=True)
class MTPConfig:
    """Multi-token prediction options (``GPTConfig.mtp``)."""

    num_layers: int = 1
    """Prediction depths D (DeepSeek-V3: 1)."""
    loss_coeff: float = 0.1
    """Weight λ of the MTP loss (averaged over depths) in the objective."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if (
            isinstance(self.num_layers, bool)
            or not isinstance(self.num_layers, int)
            or self.num_layers < 1
        ):
            raise ValueError(f"MTPConfig.num_layers={self.num_layers!r} must be an integer >= 1")
        if not self.loss_coeff >= 0:
            raise ValueError(f"MTPConfig.loss_coeff={self.loss_coeff!r} must be >= 0")

    def validate(self, config: Any) -> None:
        """Nothing to check against the enclosing GPTConfig."""

    def check_layout(self, parallel: Any) -> None:
        if parallel.cp > 1:
            raise ValueError(
                f"GPTConfig.mtp with cp={parallel.cp} is not supported: rolled MTP targets would "
                "cross context-parallel chunk boundaries; use cp=1"
            )

    def replace(self, **changes: Any) -> MTPConfig:
        return dataclasses.replace(self, **changes)
