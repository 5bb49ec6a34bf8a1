"""oneDNN's float32 linear with a strided weight operand: raw, through shardwork, and on MKL.

oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``) reads its weight operand fast when it
is dense in row- or column-major order. ``shardwork.fused_kernels.cpu_gemm`` copies any other
operand dense first (a column slice ``W[:, :k]``, the transposed view of a column-sliced input
that a weight gradient multiplies by, every other row). This times one ``[M, K]·[N, K]ᵀ``
product per stride pattern:

- oneDNN on the strided operand as it is (one call: it can take seconds);
- ``cpu_gemm.onednn_mm_nt`` (the dense copy, then oneDNN), best of ``--repeats``;
- ``torch.mm`` (MKL), best of ``--repeats``;

and an fc2-shaped weight gradient of a column-sliced input (``dyᵀ·x``, the wide weight whose
gradient ``cpu_gemm.weight_grad_mm`` runs on oneDNN).

    uv run python benchmarks/cpu_gemm_strides.py --threads 1

Writes benchmarks/results/cpu_gemm_strides.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime_env import RUNTIME_ENV  # before torch: shardwork-train's environment

# isort: split
import torch

from shardwork.fused_kernels import cpu_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_gemm import best_seconds, onednn_product
from machine import machine_record

RESULTS = Path(__file__).resolve().parent / "results"


def cases(n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(a, b)`` per stride pattern of ``b``, every product ``[n, n]·[n, n]ᵀ``; the last is a
    weight gradient ``dyᵀ·x`` of a column-sliced ``x`` with an ``[n, 3n]`` weight."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    x = torch.randn(n, 4 * n, generator=gen)[:, n:]  # a column slice: rows 4n apart
    dy = torch.randn(n, n, generator=gen)
    return {
        "dense (reference)": (a, torch.randn(n, n, generator=gen)),
        "column slice W[:, :k]": (a, torch.randn(n, 2 * n, generator=gen)[:, :n]),
        "transposed column slice": (a, torch.randn(n, 2 * n, generator=gen)[:, :n].t()),
        "every other row W[::2]": (a, torch.randn(2 * n, n, generator=gen)[::2]),
        "weight grad dyᵀ·x, x a column slice": (dy.t(), x.t()),
    }


def measure(a: torch.Tensor, b: torch.Tensor, repeats: int) -> dict:
    """Milliseconds of ``a·bᵀ`` raw on oneDNN, through shardwork and on MKL; shardwork's error."""
    ref = a.double() @ b.double().t()
    got = cpu_gemm.onednn_mm_nt(a, b)
    return {
        # One call as it is: on a strided operand it takes seconds.
        "raw_onednn_ms": 1e3 * best_seconds(lambda: onednn_product(a, b), 1, warm_up=False),
        "shardwork_ms": 1e3 * best_seconds(lambda: cpu_gemm.onednn_mm_nt(a, b), repeats),
        "mkl_ms": 1e3 * best_seconds(lambda: torch.mm(a, b.t()), repeats),
        "shardwork_rel_error": ((got.double() - ref).abs().max() / ref.abs().max()).item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, (a, b) in cases(args.size).items():
        row = {"operand": name, "b_stride": list(b.stride()), **measure(a, b, args.repeats)}
        rows.append(row)
        print(f"{name:38s} raw {row['raw_onednn_ms']:9.1f} ms  shardwork "
              f"{row['shardwork_ms']:6.2f} ms  MKL {row['mkl_ms']:6.2f} ms")  # fmt: skip
    result = {"benchmark": "cpu_gemm_strides", "torch": torch.__version__, "size": args.size,
              "threads": args.threads, "machine": machine_record(), "env": RUNTIME_ENV,
              "rows": rows}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_gemm_strides.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "cpu_gemm_strides.md").write_text(markdown(result))


def markdown(result: dict) -> str:
    n = result["size"]
    lines = [
        "# oneDNN's float32 linear with a strided weight operand",
        "",
        f"`[{n}, {n}]·[{n}, {n}]ᵀ`, {result['threads']} thread(s), torch {result['torch']}. "
        "raw: oneDNN on the operand as it is (one call); shardwork: `cpu_gemm.onednn_mm_nt`, "
        "which copies a non-dense operand dense first (best of repeats); MKL: `torch.mm`. "
        "Error: shardwork's result against float64, relative to the largest entry.",
        "",
        "| operand b | strides | raw oneDNN ms | shardwork ms | MKL ms | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['operand']} | {tuple(r['b_stride'])} | {r['raw_onednn_ms']:.1f} | "
            f"{r['shardwork_ms']:.2f} | {r['mkl_ms']:.2f} | {r['shardwork_rel_error']:.1e} |"
        )
    lines += ["", f"Machine: {json.dumps(result['machine'])}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
