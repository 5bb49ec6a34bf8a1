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

import sys
from pathlib import Path

from shardwork.trainer.observe.metrics import metrics_path, read_metrics


def _series(records, kind: str, key: str):
    xs, ys = [], []
    for r in records:
        if r.get("kind") == kind and isinstance(r.get(key), int | float):
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the plots of ``run_dir``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = metrics_path(run_dir)
    if not path.is_file():
        raise ValueError(f"RUN_DIR={str(run_dir)!r} has no metrics.jsonl: is it a shardwork run?")
    records = read_metrics(path)
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    baseline = next((r for r in records if r.get("kind") == "event" and "bigram_nats" in r), None)

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "train", "loss"), label="train loss")
    xs, ys = _series(records, "valid", "loss")
    if xs:
        ax.plot(xs, ys, "o-", label="validation loss")
    mtp_keys = sorted(
        {k for r in records if r.get("kind") == "train" for k in r if k.startswith("mtp_loss_")},
        key=lambda k: int(k[9:]),
    )
    for key in mtp_keys:
        ax.plot(*_series(records, "train", key), ls=":", label=f"train MTP depth {key[9:]}")
        xs, ys = _series(records, "valid", key)
        if xs:
            ax.plot(xs, ys, "s:", label=f"validation MTP depth {key[9:]}")
    if baseline is not None:
        ax.axhline(baseline["bigram_nats"], color="grey", ls="--", label="bigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(*_series(records, "train", "lr"), label="learning rate")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    xs, ys = _series(records, "train", "batch_size")
    if xs and len(set(ys)) > 1:
        twin = ax.twinx()
        twin.step(xs, ys, color="C1", where="post", label="global batch size")
        twin.set_ylabel("global batch size")
    ax.grid(alpha=0.3)
    save(fig, "lr.png")

    for key, name, label in (
        ("grad_norm", "grad_norm.png", "gradient norm"),
        ("tokens_per_s", "throughput.png", "tokens / s"),
    ):
        xs, ys = _series(records, "train", key)
        if xs:
            fig, ax = plt.subplots(figsize=(7, 3.5))
            ax.plot(xs, ys)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            save(fig, name)

    aux_keys = sorted(
        {
            k
            for r in records
            if r.get("kind") == "train"
            for k in r
            if k.endswith("_loss") and k != "loss"
        }
    )
    if aux_keys:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key in aux_keys:
            ax.plot(*_series(records, "train", key), label=key)
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, "aux_losses.png")

    loads = [
        r for r in records if r.get("kind") == "train" and isinstance(r.get("expert_load"), list)
    ]
    if loads:
        last = loads[-1]
        fig, ax = plt.subplots(figsize=(7, 4))
        image = ax.imshow(last["expert_load"], aspect="auto", cmap="viridis")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_title(f"tokens per expert (fraction), step {last['step']}")
        fig.colorbar(image, ax=ax)
        save(fig, "expert_load.png")
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: shardwork-plot RUN_DIR   (writes RUN_DIR/plots/*.png)", file=sys.stderr)
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
