"""The planner's ranked table (text) and its plot (a self-contained SVG, no dependency).

The table lists the best variant of each parallel layout, fastest first: step time, predicted
MFU, memory per GPU, and the reasons for its time (the shares of the step spent in the bubble
and in each exposed communication). Refused layouts follow, grouped by parallel layout, each
with the memory that did not fit.
"""

from __future__ import annotations

from html import escape

from shardwork.trainer.plan.planner import Plan, PlanRow

__all__ = ["render_svg", "render_table"]

GIB = 2**30
PARTS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp")
COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3")


def format_seconds(seconds: float) -> str:
    """A step time in the unit that keeps it readable: ``4.21 s``, ``12.5 ms``, ``1.72 us``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def format_bytes(size: float) -> str:
    """Memory per GPU in GiB, or in MiB / KiB below one GiB (a small model's rows)."""
    if size >= GIB:
        return f"{size / GIB:.1f} GiB"
    if size >= 2**20:
        return f"{size / 2**20:.3g} MiB"
    return f"{size / 2**10:.3g} KiB"


def _reasons(row: PlanRow) -> str:
    t = row.time
    shares = [(name, getattr(t, name) / t.total) for name in PARTS[1:]]
    big = [f"{name} {share:.0%}" for name, share in shares if share >= 0.01]
    return ", ".join(big) if big else "compute-bound"


def _refused_layouts(plan: Plan) -> list[PlanRow]:
    """One refused row per parallel layout that has no fitting variant at all."""
    fitting = {r.layout.parallel_key for r in plan.rows}
    seen, out = set(), []
    for row in sorted(plan.refused, key=lambda r: r.memory):
        key = row.layout.parallel_key
        if key in fitting or key in seen:
            continue
        seen.add(key)
        out.append(row)
    return out


def render_table(plan: Plan, *, top: int = 10, refused: int = 5) -> str:
    """The ranked table (``top`` rows) and the ``refused`` leanest refused layouts."""
    c = plan.cluster
    ranked = plan.ranked()
    # The layout column fits its longest entry (uneven splits add e.g. "[3+..+2]").
    w = max([40] + [len(row.layout.describe()) for row in ranked[:top]])
    lines = [
        f"{c.num_gpus} x {c.gpu.name} ({c.gpus_per_node} per node), global batch "
        f"{plan.global_batch} x {plan.seq_length} tokens, efficiency {plan.efficiency:g}",
        f"{'#':>3}  {'layout':<{w}} {'step':>9} {'MFU':>6} {'memory':>9}  time beyond compute",
    ]
    for i, row in enumerate(ranked[:top], start=1):
        lines.append(
            f"{i:>3}  {row.layout.describe():<{w}} {format_seconds(row.time.total):>9} "
            f"{row.mfu:>6.1%} {format_bytes(row.memory):>9}  {_reasons(row)}"
        )
    if not ranked:
        lines.append("  (no layout fits)")
    else:
        flags = [
            *ranked[0].layout.train_flags(moe=plan.model.moe is not None),
            *("--schedule.global_batch_size", str(plan.global_batch)),
            *("--data.seq_length", str(plan.seq_length)),
        ]
        lines.append(
            f"#1 with shardwork-train on {c.num_gpus} ranks (with your model and data "
            f"settings): {' '.join(flags)}"
        )
    rejected = _refused_layouts(plan)
    lines.append(f"{len(ranked)} parallel layouts fit; {len(rejected)} do not fit at all")
    for row in rejected[:refused]:
        lines.append(f"  refused {row.layout.describe()}: {row.refused}")
    return "\n".join(lines)


def render_svg(plan: Plan, *, top: int = 10) -> str:
    """Horizontal stacked bars of the ``top`` layouts' step time, split into its parts."""
    rows = plan.ranked()[:top]
    width, left, bar, gap = 900, 300, 22, 8
    height = 60 + len(rows) * (bar + gap) + 40
    longest = max((r.time.total for r in rows), default=1.0)
    scale = (width - left - 20) / longest
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="20" font-size="14">Predicted step time, {plan.cluster.num_gpus} x '
        f"{escape(plan.cluster.gpu.name)} (seconds)</text>",
    ]
    for i, row in enumerate(rows):
        y = 40 + i * (bar + gap)
        label = f"{i + 1}. {row.layout.describe()}"
        out.append(f'<text x="10" y="{y + 15}">{escape(label)}</text>')
        x = float(left)
        for name, colour in zip(PARTS, COLOURS):
            w = getattr(row.time, name) * scale
            if w > 0:
                out.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{colour}">'
                    f"<title>{name} {getattr(row.time, name):.3f} s</title></rect>"
                )
                x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + 15}">{row.time.total:.2f}</text>')
    y = height - 20
    for j, (name, colour) in enumerate(zip(PARTS, COLOURS)):
        out.append(
            f'<rect x="{10 + j * 100}" y="{y - 10}" width="12" height="12" fill="{colour}"/>'
        )
        out.append(f'<text x="{26 + j * 100}" y="{y}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
