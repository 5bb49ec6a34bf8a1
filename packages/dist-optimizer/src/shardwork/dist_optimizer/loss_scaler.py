"""Loss scaling for fp16 training: a constant scale and a dynamic one with hysteresis.

- The trainer multiplies the loss by ``scaler.scale`` before backward; the optimizer divides
  the gradients by it, checks them for inf/nan (agreed over every rank) and calls
  :meth:`DynamicLossScaler.update`, which backs off on overflow and grows after
  ``growth_interval`` clean steps.
- ``hysteresis`` overflows in a row are tolerated before the scale is reduced (as in
  Megatron-LM), so a single spike does not halve the scale.
- The scaler is an object owned by the optimizer (no global state); its state is saved with
  the optimizer.
- ``can_back_off`` tells a caller whether an overflow is still the scaler's business (the scale
  can drop) or a real failure (a constant scale, or a dynamic one at ``min_scale``): a trainer
  must not count a dynamic scaler's first overflows as divergence.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConstantLossScaler", "DynamicLossScaler"]


class ConstantLossScaler:
    """A fixed loss scale (1.0 means none)."""

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"ConstantLossScaler.scale={scale}; valid: > 0")
        self.scale = float(scale)

    @property
    def can_back_off(self) -> bool:
        """Always False: a constant scale never drops, so an overflow is a real failure."""
        return False

    def update(self, found_nonfinite: bool) -> None:
        """Nothing changes for a constant scale."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after a run of clean steps."""

    def __init__(
        self,
        *,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        checks = {
            "initial_scale": (initial_scale > 0, "> 0"),
            "min_scale": (0 < min_scale <= initial_scale, "in (0, initial_scale]"),
            "growth_factor": (growth_factor > 1, "> 1"),
            "backoff_factor": (0 < backoff_factor < 1, "in (0, 1)"),
            "growth_interval": (growth_interval >= 1, ">= 1"),
            "hysteresis": (hysteresis >= 1, ">= 1"),
        }
        for name, (ok, valid) in checks.items():
            if not ok:
                raise ValueError(f"DynamicLossScaler.{name}={locals()[name]}; valid: {valid}")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def can_back_off(self) -> bool:
        """True while an overflow can still lower the scale (it is above ``min_scale``)."""
        return self.scale > self.min_scale

    def update(self, found_nonfinite: bool) -> None:
        """Adjust the scale after a step; ``found_nonfinite`` must agree on every rank."""
        if found_nonfinite:
            # Hysteresis: the scale drops from the hysteresis-th overflow since the last growth on.
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                # As Megatron-LM's DynamicGradScaler: the hysteresis budget refills only when the
                # scale grows.
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
