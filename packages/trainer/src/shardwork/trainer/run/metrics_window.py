"""The metrics window: what a logged ``train`` line reports about the steps since the last one.

Every step adds its loss (finite ones only: a skipped NaN step must not poison the mean), its
per-depth MTP losses and its tokens. On a logging step the window's losses are averaged, its
tokens turned into a throughput over the wall time since the previous logging step, and the
window starts again; between logging steps the values are the step's own (progress bar).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from shardwork.trainer.observe.throughput import memory_gib
from shardwork.trainer.run.step import StepOutput
from shardwork.trainer.run.step_plan import StepPlan


def mtp_values(losses: list[float] | None) -> dict[str, float]:
    """``{"mtp_loss_1": ..., "mtp_loss_2": ...}``: one metric per MTP depth (none without MTP)."""
    return {} if losses is None else {f"mtp_loss_{k}": v for k, v in enumerate(losses, start=1)}


class MetricsWindow:
    """Accumulates steps between logging steps and builds each step's metric values.

    ``flops_per_token`` and ``world_size`` turn tokens per second into TFLOP/s per device;
    ``peak_tflops`` (None when unknown) into MFU. ``loss_scaler`` (fp16) adds ``loss_scale``.
    ``clock`` is the wall clock (seconds) the throughput is measured with.
    """

    def __init__(
        self,
        *,
        flops_per_token: float,
        world_size: int,
        peak_tflops: float | None,
        device,
        loss_scaler=None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.device = device
        self.loss_scaler = loss_scaler
        self.clock = clock
        self.losses: list[float] = []
        self.mtp: list[list[float]] = []
        self.tokens = 0
        self.t0 = clock()

    def add(self, out: StepOutput, tokens: int) -> None:
        """Count a finished step: its losses (when finite) and its ``tokens``."""
        if math.isfinite(out.loss):
            self.losses.append(out.loss)
            if out.mtp is not None:
                self.mtp.append(out.mtp)
        self.tokens += tokens

    def values(self, plan: StepPlan, out: StepOutput, *, log_now: bool) -> dict[str, float]:
        """The step's metric values; on a logging step the window's means and throughput,
        after which the window is empty again."""
        values = {"loss": out.loss, **mtp_values(out.mtp), "lr": plan.lr}
        if not log_now:
            return values
        if self.losses:
            values["loss"] = sum(self.losses) / len(self.losses)
        if self.mtp:
            values.update(mtp_values([sum(d) / len(d) for d in zip(*self.mtp)]))
        elapsed = self.clock() - self.t0
        tps = self.tokens / max(elapsed, 1e-9)  # the floor guards a clock that did not advance
        self.losses, self.mtp, self.tokens, self.t0 = [], [], 0, self.clock()
        gbs = plan.global_batch_size
        values.update(
            grad_norm=out.grad_norm if out.grad_norm is not None else float("nan"),
            weight_decay=plan.weight_decay,
            batch_size=gbs,
            tokens_per_s=tps,
            memory_gib=memory_gib(self.device),
            consumed_samples=plan.consumed + gbs,
        )
        if self.loss_scaler is not None:
            values["loss_scale"] = self.loss_scaler.scale
        if out.moe:
            values.update(out.moe)
        achieved = tps * self.flops_per_token / self.world_size / 1e12
        values["tflops_per_device"] = achieved
        if self.peak_tflops is not None:
            values["mfu"] = achieved / self.peak_tflops
        return values
