"""``ParallelConfig``: the sizes of every parallel dimension, checked before any group exists.

- Dense ranks are laid out over (tp, cp, dp, pp); expert ranks over
  (etp, ep, edp, pp). Expert tensor parallelism (``etp``) is independent of
  dense ``tp`` and defaults to it.
- ``dp`` is derived from the world size unless given; ``edp`` always is.
- ``order`` names how ranks are laid out, fastest-varying first
  (``"tp-cp-ep-dp-pp"``: neighbouring ranks share a TP group), exactly as
  Megatron-Core's ``RankGenerator`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Sizes of the parallel dimensions; call :meth:`resolve` with the world size."""

    tp: int = 1
    """Tensor-parallel size (dense layers)."""
    pp: int = 1
    """Pipeline-parallel size (number of pipeline stages)."""
    vpp: int | None = None
    """Virtual pipeline chunks per stage (interleaved 1F1B); needs ``pp > 1``."""
    cp: int = 1
    """Context-parallel size (sequence split across ranks inside attention)."""
    ep: int = 1
    """Expert-parallel size (experts split across ranks)."""
    etp: int | None = None
    """Expert tensor-parallel size; ``None`` means equal to ``tp``."""
    dp: int | None = None
    """Data-parallel size; ``None`` derives it as ``world / (tp * cp * pp)``."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying dimension first, from tp, cp, ep, dp, pp; a token may be
    left out only when its size is 1 (it is then appended, as Megatron-Core does)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"ParallelConfig.{name}={value!r} is invalid: it must be an integer >= 1"
                )
        for name in ("etp", "dp"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(
                    f"ParallelConfig.{name}={value!r} is invalid: it must be None or an integer >= 1"
                )
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 1:
                raise ValueError(
                    f"ParallelConfig.vpp={self.vpp!r} is invalid: it must be None or an integer >= 1"
                )
            if self.vpp > 1 and self.pp == 1:
                raise ValueError(
                    f"ParallelConfig.vpp={self.vpp} needs pipeline parallelism: set pp > 1 or vpp=None"
                )
        tokens = self.order.split("-")
        unknown = [t for t in tokens if t not in ORDER_TOKENS]
        duplicated = sorted({t for t in tokens if tokens.count(t) > 1})
        if unknown or duplicated:
            raise ValueError(
                f"ParallelConfig.order={self.order!r} is invalid: it must list tokens from "
                f"{', '.join(ORDER_TOKENS)} at most once each, joined by '-' (e.g. 'tp-cp-ep-dp-pp')"
                + (f"; unknown tokens {unknown}" if unknown else "")
                + (f"; repeated tokens {duplicated}" if duplicated else "")
            )

    @property
    def full_order(self) -> list[str]:
        """``order`` with omitted tokens appended (they must have size 1, as in Megatron-Core)."""
        tokens = self.order.split("-")
        return tokens + [t for t in ORDER_TOKENS if t not in tokens]

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (``etp``, defaulting to ``tp``)."""
        return self.tp if self.etp is None else self.etp

    def resolve(self, world_size: int) -> ParallelConfig:
        """Return a copy with ``dp`` and ``etp`` filled in for ``world_size``, or raise ValueError."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid: it must be an integer >= 1")
        model_parallel = self.tp * self.cp * self.pp
        if world_size % model_parallel != 0:
            raise ValueError(
                f"world_size={world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*{self.pp}"
                f" = {model_parallel}: choose sizes whose product divides the world size"
            )
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"ParallelConfig.dp={self.dp} does not match world_size={world_size}: with "
                f"tp={self.tp}, cp={self.cp}, pp={self.pp} it must be {dp} (or None to derive it)"
            )
        etp = self.expert_tp
        expert_model_parallel = etp * self.ep * self.pp
        if world_size % expert_model_parallel != 0:
            raise ValueError(
                f"ParallelConfig.ep={self.ep} with etp={etp} and pp={self.pp} is invalid for "
                f"world_size={world_size}: etp*ep*pp = {expert_model_parallel} must divide the world size"
            )
        if self.ep > 1 and (self.tp * self.cp * dp) % (etp * self.ep) != 0:
            raise ValueError(
                f"ParallelConfig.ep={self.ep} with etp={etp} is invalid: etp*ep = {etp * self.ep} must "
                f"divide the ranks of one pipeline stage, tp*cp*dp = {self.tp * self.cp * dp}"
            )
        tokens = self.order.split("-")
        edp = (self.tp * self.cp * dp) // (etp * self.ep)
        sizes = {
            "tp": (self.tp, etp),
            "cp": (self.cp,),
            "ep": (self.ep,),
            "dp": (dp, edp),
            "pp": (self.pp,),
        }
        for name, values in sizes.items():
            if name not in tokens and any(v != 1 for v in values):
                raise ValueError(
                    f"ParallelConfig.order={self.order!r} omits {name!r} but its size is "
                    f"{max(values)}: every dimension larger than 1 (for dense or expert layers) "
                    "must appear in the order"
                )
        return replace(self, dp=dp, etp=etp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size; only defined on a resolved config."""
        if self.dp is None or self.etp is None:
            raise ValueError("ParallelConfig.edp is only known after resolve(world_size)")
        return (self.tp * self.cp * self.dp) // (self.etp * self.ep)

    @property
    def world_size(self) -> int:
        """Total ranks; only defined on a resolved config."""
        if self.dp is None:
            raise ValueError("ParallelConfig.world_size is only known after resolve(world_size)")
        return self.tp * self.cp * self.dp * self.pp
