"""Progress display: a tqdm bar on a terminal, plain log lines elsewhere (CI, files).

Both show step, loss (and each MTP depth's loss as ``mtp<k>``), learning rate,
tokens/s and the time left; the plain lines also carry grad norm, MoE aux losses,
MFU and memory, one line per logging interval.
Only the logging rank creates one.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def format_count(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def _mtp_depths(values: dict[str, Any]) -> list[int]:
    """The MTP depths k with an ``mtp_loss_<k>`` entry, in order."""
    return sorted(int(key[9:]) for key in values if key.startswith("mtp_loss_"))


class Progress:
    """Shows training progress from ``start_step`` to ``total_steps``."""

    def __init__(
        self, *, total_steps: int, start_step: int, mode: str = "auto", stream=None
    ) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode = mode
        self.total = total_steps
        self.start_step = start_step
        self._t0 = time.perf_counter()
        self._bar = None
        if mode == "bar":
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                smoothing=0.1,
            )

    def update(self, step: int, values: dict[str, Any], *, log_line: bool) -> None:
        """``step`` steps are done; ``values`` holds the latest loss, lr, tokens_per_s, ..."""
        if self._bar is not None:
            self._bar.n = step
            postfix = {"loss": f"{values['loss']:.4f}"}
            postfix.update(
                {f"mtp{k}": f"{values[f'mtp_loss_{k}']:.4f}" for k in _mtp_depths(values)}
            )
            postfix["lr"] = f"{values['lr']:.2e}"
            if "tokens_per_s" in values:
                postfix["tok/s"] = format_count(values["tokens_per_s"])
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(0)
            return
        if self.mode == "lines" and log_line:
            self.write(self.line(step, values))

    def line(self, step: int, values: dict[str, Any]) -> str:
        elapsed = time.perf_counter() - self._t0
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        parts = [f"step {step}/{self.total}", f"loss {values['loss']:.4f}"]
        parts += [f"mtp{k} {values[f'mtp_loss_{k}']:.4f}" for k in _mtp_depths(values)]
        if "grad_norm" in values:
            parts.append(f"grad {values['grad_norm']:.3f}")
        parts.append(f"lr {values['lr']:.2e}")
        if "tokens_per_s" in values:
            parts.append(f"{format_count(values['tokens_per_s'])} tok/s")
        for key, label in (
            ("load_balancing_loss", "aux"),
            ("global_load_balancing_loss", "gaux"),
            ("z_loss", "z"),
            ("load_imbalance", "imbalance"),
        ):
            if key in values:
                parts.append(f"{label} {values[key]:.3g}")
        if values.get("mfu") is not None:
            parts.append(f"MFU {100 * values['mfu']:.1f}%")
        elif values.get("tflops_per_device") is not None:
            parts.append(f"{1000 * values['tflops_per_device']:.1f} GFLOP/s")
        if "memory_gib" in values:
            parts.append(f"mem {values['memory_gib']:.2f} GiB")
        parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def write(self, text: str) -> None:
        """Print a message without breaking the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.mode != "none":
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
