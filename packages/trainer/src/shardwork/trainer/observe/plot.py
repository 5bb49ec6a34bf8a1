"""``shardwork-plot RUN_DIR``: PNG plots of a run's ``metrics.jsonl``.

Writes into ``RUN_DIR/plots/``: ``loss.png`` (train and validation loss, each
MTP depth's loss ``mtp_loss_<k>`` when present, and the bigram baseline when the
run recorded it), ``lr.png`` (learning rate and
batch size), ``grad_norm.png``, ``throughput.png`` (tokens/s), ``aux_losses.png``
(MoE aux / z losses per type, when present) and ``expert_load.png`` (a layer × expert
heatmap of the last logged expert load, when present). Uses matplotlib's
non-interactive Agg backend, so it works on headless machines.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from matplotlib.figure import Figure

from shardwork.trainer.observe.metrics import RECORD_FORM, metrics_path, read_metrics

# Figures are built with matplotlib's object API (no pyplot): nothing global to select or
# close, and ``Figure.savefig`` renders a .png with Agg whatever the default backend is.


def _series(records, kind: str, key: str):
    """``(steps, values)`` of ``key`` in the ``kind`` records, as the run's last timeline: a
    run resumed from a checkpoint older than its last logged step logs those steps again (the
    model went back to the checkpoint), and its new records replace the old ones from there."""
    xs, ys = [], []
    for r in records:
        if r.get("kind") == kind and isinstance(r.get(key), int | float):
            while xs and xs[-1] >= r["step"]:
                xs.pop()
                ys.pop()
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def _train_keys(records, keep) -> list[str]:
    """Sorted keys of the train records that ``keep`` accepts."""
    return sorted({k for r in records if r.get("kind") == "train" for k in r if keep(k)})


def _loss_figure(records) -> Figure:
    """Train and validation loss, each MTP depth's loss, and the bigram baseline."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(*_series(records, "train", "loss"), label="train loss")
    xs, ys = _series(records, "valid", "loss")
    if xs:
        ax.plot(xs, ys, "o-", label="validation loss")
    mtp_keys = sorted(
        _train_keys(records, lambda k: k.startswith("mtp_loss_")), key=lambda k: int(k[9:])
    )
    for key in mtp_keys:
        ax.plot(*_series(records, "train", key), ls=":", label=f"train MTP depth {key[9:]}")
        xs, ys = _series(records, "valid", key)
        if xs:
            ax.plot(xs, ys, "s:", label=f"validation MTP depth {key[9:]}")
    baseline = next((r for r in records if r.get("kind") == "event" and "bigram_nats" in r), None)
    if baseline is not None:
        ax.axhline(baseline["bigram_nats"], color="grey", ls="--", label="bigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _lr_figure(records) -> Figure:
    """Learning rate, with the global batch size on a second axis when it changes."""
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    ax.plot(*_series(records, "train", "lr"), label="learning rate")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    xs, ys = _series(records, "train", "batch_size")
    if xs and len(set(ys)) > 1:
        twin = ax.twinx()
        twin.step(xs, ys, color="C1", where="post", label="global batch size")
        twin.set_ylabel("global batch size")
    ax.grid(alpha=0.3)
    return fig


def _scalar_figure(records, key: str, label: str) -> Figure | None:
    """One train metric over steps (None when the run never logged it)."""
    xs, ys = _series(records, "train", key)
    if not xs:
        return None
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    ax.plot(xs, ys)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    return fig


def _aux_figure(records) -> Figure | None:
    """MoE aux / z losses per type (None without any)."""
    aux_keys = _train_keys(records, lambda k: k.endswith("_loss") and k != "loss")
    if not aux_keys:
        return None
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    for key in aux_keys:
        ax.plot(*_series(records, "train", key), label=key)
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _expert_load_figure(records) -> Figure | None:
    """Layer × expert heatmap of the last logged expert load (None without any)."""
    loads = [
        r for r in records if r.get("kind") == "train" and isinstance(r.get("expert_load"), list)
    ]
    if not loads:
        return None
    last = loads[-1]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    image = ax.imshow(last["expert_load"], aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"tokens per expert (fraction), step {last['step']}")
    fig.colorbar(image, ax=ax)
    return fig


def _figures(records) -> dict[str, Figure | None]:
    """Every chart by file name (None for a metric the run never logged)."""
    return {
        "loss.png": _loss_figure(records),
        "lr.png": _lr_figure(records),
        "grad_norm.png": _scalar_figure(records, "grad_norm", "gradient norm"),
        "throughput.png": _scalar_figure(records, "tokens_per_s", "tokens / s"),
        "aux_losses.png": _aux_figure(records),
        "expert_load.png": _expert_load_figure(records),
    }


def _set_aside_hint(run_dir: Path) -> str:
    """The end of the "no metrics.jsonl" message: the logs of earlier runs that a fresh run set
    aside there (``metrics.N.jsonl``, observe/earlier_run.py) are not this directory's current
    run, so they are named rather than plotted."""
    earlier = sorted(p.name for p in run_dir.glob("metrics.*.jsonl") if p.is_file())
    if not earlier:
        return ": is it a shardwork run?"
    return (
        f"; it holds earlier runs' logs, set aside by a later run ({', '.join(earlier)}), and "
        "that run logged no step yet; rename one to metrics.jsonl to plot that run"
    )


def _read_run(run_dir: Path, *, empty_ok: bool) -> list[dict]:
    """The records of ``run_dir``'s metrics log, or ValueError when there is no log, it is not
    one (:func:`read_metrics` names the line), or it holds no train loss to plot (unless
    ``empty_ok``: then no records)."""
    path = metrics_path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR={str(run_dir)!r} is not a directory")
    if not path.is_file():
        raise ValueError(f"RUN_DIR={str(run_dir)!r} has no metrics.jsonl{_set_aside_hint(run_dir)}")
    records = read_metrics(path)
    if not any(r.get("kind") == "train" and "loss" in r for r in records):
        if empty_ok:
            return []
        raise ValueError(
            f"{path} holds no train record with a loss ({len(records)} records in all), so "
            "there is "
            f"nothing to plot; {RECORD_FORM}"
        )
    return records


def _save(figures: dict[str, Figure | None], out: Path) -> list[Path]:
    """Write the figures into ``out``, made here if missing; on a failure, remove what this
    call wrote (and ``out`` if it made it) and raise ValueError naming the path."""
    made = not out.exists()
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, fig in figures.items():
            if fig is not None:
                fig.tight_layout()
                fig.savefig(out / name, dpi=110)
                written.append(out / name)
    except OSError as exc:
        for path in written:
            path.unlink(missing_ok=True)
        if made and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        where = exc.filename or out
        raise ValueError(f"cannot write the plots to {where}: {exc.strerror or exc}") from None
    return written


def plot_run(run_dir: str | Path, *, empty_ok: bool = False) -> list[Path]:
    """Write the plots of ``run_dir`` into ``run_dir/plots``; returns the files written.

    Everything is checked, and the figures built, before the folder is made: a bad log or a
    ``plots`` that is not a folder raises ValueError and leaves nothing behind. ``empty_ok``:
    a log without a train loss gives no plots instead (the trainer's case when a resumed run
    had no step left to train).
    """
    run_dir = Path(run_dir)
    out = run_dir / "plots"
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{out} is a file, not a folder: shardwork-plot writes its PNGs into "
            "RUN_DIR/plots/; move or remove that file"
        )
    records = _read_run(run_dir, empty_ok=empty_ok)
    return _save(_figures(records), out) if records else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: shardwork-plot RUN_DIR   (writes RUN_DIR/plots/*.png)"
    if argv in (["-h"], ["--help"]):
        print(usage)  # asked for: not an error
        return 0
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    try:
        files = plot_run(argv[0])
    except ValueError as exc:
        print(f"shardwork-plot: {exc}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
