"""Peak memory and time of masked attention (forward + backward) against sequence length, CPU.

The attention core alone, as ``Attention`` runs it: ``build_block_mask`` for the layout, then
``block_attention`` (packed documents, a context-parallel rank, a sliding window) or SDPA's
``is_causal`` (one document at cp 1), on random ``q [1, nq, s_local, d]`` and ``k, v
[1, nkv, s, d]`` (fp32, GQA), forward and backward with a random output gradient. The peer is
the path this replaced, in the same script: the same SDPA call with the explicit boolean
``[s_local, s]`` mask it used to build (same ``enable_gqa`` so only the mask differs).

Each (case, s) runs in a fresh process: the peak is the growth of the process's maximum resident
set (``ru_maxrss``) over its resident set just before the step (inputs already allocated, kernels
warmed at s=256), i.e. everything the step allocates, kernel buffers included; the time is that
one step's wall time. Linear memory shows as a flat bytes-per-token column; time should grow 4x
per doubling for one long document (causal attention is quadratic) and 2x for documents of a
fixed length. The old explicit-mask path runs up to 16k (at 32k its bool mask and the kernel's
float copy are ~5 GiB). Writes ``benchmarks/results/attention_memory.json`` and ``.md``.

Usage: ``uv run python benchmarks/attention_memory.py`` (about 3 minutes on 2 cores);
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


def _step(case: str, s: int, q, k, v, grad) -> None:
    """Forward and backward of one layout; masks are built inside, as every forward does."""
    cp, packed, window, explicit = CASES[case]
    cu = torch.arange(0, s + 1, min(DOC, s)) if packed else torch.tensor([0, s])
    mask = build_block_mask(q.shape[2], cp_size=cp, cu_seqlens=cu, window=window)
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
    start = time.perf_counter()
    _step(case, s, *inputs)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"case": case, "s": s, "peak_bytes": peak, "seconds": seconds}


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
        "| case | s | peak MiB | bytes / token | x peak vs s/2 | seconds | x time vs s/2 |",
        "|---|---|---|---|---|---|---|",
    ]
    previous = {}
    for row in rows:
        last = previous.get(row["case"])
        mem = f"{row['peak_bytes'] / last['peak_bytes']:.2f}" if last else ""
        tim = f"{row['seconds'] / last['seconds']:.2f}" if last else ""
        lines.append(
            f"| {row['case']} | {row['s']} | {row['peak_bytes'] / 2**20:.1f} | "
            f"{row['peak_bytes'] / row['s']:.0f} | {mem} | {row['seconds']:.3f} | {tim} |"
        )
        previous[row["case"]] = row
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
    ]
    (RESULTS / "attention_memory.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
