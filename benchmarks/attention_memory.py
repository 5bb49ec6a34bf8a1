"""Peak memory and time of masked attention (forward + backward) against sequence length, CPU.

The attention core alone, as ``Attention`` runs it: ``build_block_mask`` for the layout, then
``block_attention`` (packed documents, a context-parallel rank, a sliding window) or SDPA's
``is_causal`` (one document at cp 1), on random ``q [1, nq, s_local, d]`` and ``k, v
[1, nkv, s, d]`` (fp32, GQA), forward and backward with a random output gradient. The peer is
the path this replaced, in the same script: the same SDPA call with the explicit boolean
``[s_local, s]`` mask it used to build (same ``enable_gqa`` so only the mask differs).

Each (case, s) runs in a fresh process: the peak is the growth of the process's maximum resident
set (``ru_maxrss``) over its resident set just before the step (inputs already allocated, kernels
warmed at s=256), i.e. everything the step allocates, kernel buffers included; the time is the
fastest of up to 3 steps (as many as fit in 15 s). Linear memory shows as a flat bytes-per-token
column and a linear fit with small residuals. Work is counted exactly as the (query, key) scores
the kernels compute (:func:`score_pairs`): 4x per doubling for one long document (causal
attention is quadratic), 2x for documents of a fixed length; wall time follows it, within the
noise of a shared machine (the load average is recorded). The old explicit-mask path runs up to
16k (at 32k its bool mask and the kernel's float copy are ~5 GiB). Writes
``benchmarks/results/attention_memory.json`` and ``.md``.

Usage: ``uv run python benchmarks/attention_memory.py`` (5-15 minutes on 2 cores, mostly
the quadratic long-document points);
``--lengths 2048 4096`` for fewer points.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import machine_record

from shardwork.models import block_attention, build_block_mask

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
HEADS, KV_HEADS, HEAD_DIM, DOC, WINDOW = 4, 2, 16, 512, 512
LENGTHS = (2048, 4096, 8192, 16384, 32768)
REPEATS, TIME_BUDGET = 3, 15.0
OLD_PATH_MAX = 16384

# case name -> (cp, documents of DOC tokens (else one), window, explicit [s_local, s] mask)
CASES = {
    "1 document, cp=1 (is_causal)": (1, False, None, False),
    f"documents of {DOC}, cp=1": (1, True, None, False),
    f"documents of {DOC}, cp=1, old [s, s] mask": (1, True, None, True),
    "1 document, cp=2 rank 0": (2, False, None, False),
    "1 document, cp=2 rank 0, old [s/2, s] mask": (2, False, None, True),
    f"documents of {DOC}, cp=2 rank 0": (2, True, None, False),
    f"sliding window {WINDOW}, cp=1": (1, False, WINDOW, False),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _inputs(s: int, cp: int, gen: torch.Generator):
    local = s // cp
    q = torch.randn(1, HEADS, local, HEAD_DIM, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, s, HEAD_DIM, generator=gen, requires_grad=True) for _ in "kv")
    return q, k, v, torch.randn(1, HEADS, local, HEAD_DIM, generator=gen)


def _mask(case: str, s: int):
    cp, packed, window, _ = CASES[case]
    cu = torch.arange(0, s + 1, min(DOC, s)) if packed else torch.tensor([0, s])
    return build_block_mask(s // cp, cp_size=cp, cu_seqlens=cu, window=window)


def score_pairs(case: str, s: int) -> int:
    """(query, key) scores the kernels compute: a causal block ``L(L+1)/2``, a full or banded
    block rows x keys, an explicit mask all of ``s_local x s`` (the kernel skips nothing)."""
    mask = _mask(case, s)
    if mask is None:
        return s * (s + 1) // 2
    if CASES[case][3]:
        return mask.num_queries * mask.num_keys
    pairs = 0
    for seg in mask.segments:
        rows = seg.stop - seg.start
        for piece in seg.pieces(mask.window):
            keys = piece.stop - piece.start
            pairs += rows * (rows + 1) // 2 if piece.kind == "causal" else rows * keys
    return pairs


def _step(case: str, s: int, q, k, v, grad) -> None:
    """Forward and backward of one layout; masks are built inside, as every forward does."""
    explicit = CASES[case][3]
    mask = _mask(case, s)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif explicit:
        dense = mask.to_dense()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    else:
        out = block_attention(q, k, v, mask)
    out.backward(grad)


def measure_point(case: str, s: int) -> dict:
    """Run in a fresh process: peak bytes and seconds of one step of ``case`` at length ``s``."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    cp = CASES[case][0]
    _step(case, 256 * cp, *_inputs(256 * cp, cp, gen))  # load and warm the kernels
    inputs = _inputs(s, cp, gen)
    before = _rss_bytes()
    times, peak = [], None
    # The fastest of a few steps (up to TIME_BUDGET seconds in all) is the least disturbed by
    # other load on a shared machine. The peak is the first step's: later steps can only add
    # the allocator's leftovers of the earlier ones.
    while not times or (len(times) < REPEATS and sum(times) < TIME_BUDGET):
        for t in inputs[:3]:
            t.grad = None
        start = time.perf_counter()
        _step(case, s, *inputs)
        times.append(time.perf_counter() - start)
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    seconds = min(times)
    pairs = score_pairs(case, s)
    return {
        "case": case,
        "s": s,
        "peak_bytes": peak,
        "seconds": seconds,
        "steps_timed": len(times),
        "score_pairs": pairs,
    }


def _run_point(case: str, s: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--point", case, str(s)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(rows: list[dict]) -> list[str]:
    lines = [
        "| case | s | peak MiB | bytes / token | x peak vs s/2 | M score pairs | x pairs vs s/2 "
        "| seconds | x time vs s/2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    previous = {}
    for row in rows:
        last = previous.get(row["case"])
        ratios = [
            f"{row[key] / last[key]:.2f}" if last else ""
            for key in ("peak_bytes", "score_pairs", "seconds")
        ]
        lines.append(
            f"| {row['case']} | {row['s']} | {row['peak_bytes'] / 2**20:.1f} | "
            f"{row['peak_bytes'] / row['s']:.0f} | {ratios[0]} | {row['score_pairs'] / 1e6:.1f} | "
            f"{ratios[1]} | {row['seconds']:.3f} | {ratios[2]} |"
        )
        previous[row["case"]] = row
    return lines


def _fits(rows: list[dict]) -> list[str]:
    """Least-squares ``peak = a + b·s`` per case: a linear case leaves residuals of page and
    allocator noise (about a MiB), a quadratic one residuals of the order of its peak."""
    lines = [
        "| case | bytes / token (slope) | intercept MiB | worst residual MiB |",
        "|---|---|---|---|",
    ]
    for case in dict.fromkeys(row["case"] for row in rows):
        points = [(row["s"], row["peak_bytes"]) for row in rows if row["case"] == case]
        n = len(points)
        if n < 2:
            continue
        mean_s = sum(s for s, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        slope = sum((s - mean_s) * (p - mean_p) for s, p in points) / sum(
            (s - mean_s) ** 2 for s, _ in points
        )
        intercept = mean_p - slope * mean_s
        worst = max(abs(p - intercept - slope * s) for s, p in points)
        lines.append(f"| {case} | {slope:.0f} | {intercept / 2**20:.1f} | {worst / 2**20:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--point", nargs=2, metavar=("CASE", "S"), help=argparse.SUPPRESS)
    ap.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    args = ap.parse_args()
    if args.point:
        print(json.dumps(measure_point(args.point[0], int(args.point[1]))))
        return
    rows = []
    for case, (_, _, _, explicit) in CASES.items():
        for s in args.lengths:
            if explicit and s > OLD_PATH_MAX:
                continue
            rows.append(_run_point(case, s))
            print(json.dumps(rows[-1]), flush=True)
    machine = machine_record() | {"torch": torch.__version__, "threads": 2}
    shapes = {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "batch": 1}
    shapes |= {"document": DOC, "window": WINDOW, "dtype": "float32"}
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": machine, "shapes": shapes, "rows": rows}
    (RESULTS / "attention_memory.json").write_text(json.dumps(out, indent=2) + "\n")
    md = [
        "# Masked attention, forward + backward: peak memory and time vs sequence length (CPU)",
        "",
        f"Machine: {machine}",
        f"Shapes: {shapes}",
        "",
        *_table(rows),
        "",
        "Linear fit of the peak against s (per case):",
        "",
        *_fits(rows),
    ]
    (RESULTS / "attention_memory.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
