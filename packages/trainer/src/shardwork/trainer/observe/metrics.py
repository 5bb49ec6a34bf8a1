"""Metrics sinks: a JSONL file always, TensorBoard events when tensorboard is installed.

- TensorBoard (optional extra ``shardwork-trainer[tensorboard]``): every numeric value
  becomes the scalar ``KIND/KEY`` at ``step`` (lists such as expert load are JSONL-only).
  Without the package the writer keeps JSONL only and sets :attr:`MetricsWriter.notice`,
  which the trainer prints once.
- One JSON object per line: ``{"kind": "train"|"valid"|"event", "step": int, ...}``.
  Lists (e.g. per-layer expert load) are kept as lists; tensors become floats.
- Only the ranks that are asked to write open files (rank 0 by default,
  every rank with ``per_rank``: ``metrics-rank{r}.jsonl``).
- The file is line-buffered and flushed per record, so a killed run keeps
  everything logged up to that point and ``shardwork-plot`` can read a live run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def metrics_path(run_dir: str | Path, *, rank: int | None = None) -> Path:
    name = "metrics.jsonl" if rank is None else f"metrics-rank{rank}.jsonl"
    return Path(run_dir) / name


class MetricsWriter:
    """Append metrics records to ``RUN_DIR/metrics.jsonl`` (and TensorBoard if available)."""

    def __init__(
        self, run_dir: str | Path, *, rank: int | None = None, tensorboard: bool = True
    ) -> None:
        self.path = metrics_path(run_dir, rank=rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._tb = None
        self.tensorboard_dir: Path | None = None
        self.notice: str | None = None
        """Set when TensorBoard was asked for but is not installed (the caller prints it once)."""
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.notice = (
                    "tensorboard is not installed: metrics go to metrics.jsonl only "
                    "(pip install 'shardwork-trainer[tensorboard]' for TensorBoard events, or "
                    "set logging.tensorboard=false to silence this)"
                )
            else:
                self.tensorboard_dir = Path(run_dir) / "tensorboard"
                self._tb = SummaryWriter(str(self.tensorboard_dir))

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        record = {"kind": kind, "step": int(step)}
        record.update({k: _plain(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key in ("kind", "step"):
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file (a torn last line of a live run is skipped)."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
