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


#: How the messages of :func:`read_metrics` describe a metrics log.
RECORD_FORM = (
    'a metrics log holds one JSON object per line, e.g. {"kind": "train", "step": 10, '
    '"loss": 2.5, ...}, as shardwork-train writes it'
)


#: What :func:`_plain` writes for a non-finite float: a record may hold these for a number.
NON_FINITE = ("nan", "inf", "-inf")


def _is_number(value: Any, *, non_finite: bool) -> bool:
    """A JSON number (not a bool); with ``non_finite``, also NaN/inf and their strings."""
    if isinstance(value, str):
        return non_finite and value in NON_FINITE
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return non_finite or math.isfinite(value)


def _record(path: Path, number: int, text: str) -> dict[str, Any]:
    """Line ``number`` of ``path`` as a record, or ValueError naming the line and what a
    record holds (an object, a numeric ``step``, and a numeric ``loss`` when it has one)."""
    where = f"{path}, line {number}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg}); {RECORD_FORM}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object; {RECORD_FORM}")
    if not _is_number(record.get("step"), non_finite=False):
        raise ValueError(f"{where}: step={record.get('step')!r} is not a number; {RECORD_FORM}")
    if "loss" in record and not _is_number(record["loss"], non_finite=True):
        raise ValueError(f"{where}: loss={record['loss']!r} is not a number; {RECORD_FORM}")
    return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, checked (:func:`_record`), so that a file that is
    not a metrics log is refused naming the line instead of read as an empty run.

    Only a torn last line is skipped: one without its newline that is not complete JSON,
    which a live run (or a killed one) leaves while a record is being written (the writer
    ends every record with a newline).
    ValueError names the file and line for any other bad line, and the file if it is not
    UTF-8 text or cannot be read.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline (or is empty)
    records = []
    for number, raw in enumerate([*lines, torn], start=1):
        try:
            text = raw.decode("utf-8")  # the writer writes ASCII: even a torn line decodes
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{path}, line {number}: not UTF-8 text (byte {raw[exc.start]:#04x} at "
                f"column {exc.start + 1}); {RECORD_FORM}"
            ) from None
        if number > len(lines) and _torn(text):
            break
        if text.strip():
            records.append(_record(path, number, text))
    return records


def _torn(text: str) -> bool:
    """Whether a last line without its newline is a record cut short (not complete JSON)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return True
    return False
