"""Float32 CPU products: torch's MKL against oneDNN, as a linear layer needs them.

For each shape ``x [M, K]``, ``W [N, K]`` of the issue-24 models (the dense step's QKV, MLP and
head, the Mixtral-style expert) it times the three products of a linear layer with both
libraries in one process, interleaved, best of ``--repeats``:

- forward ``x·Wᵀ``: ``torch.mm(x, W.t())`` against ``torch.ops.mkldnn._linear_pointwise``;
- input gradient ``dY·W``: ``torch.mm`` against oneDNN on ``Wᵀ``;
- weight gradient ``dYᵀ·x``: ``torch.mm`` against oneDNN on the transposed views.

``shardwork.fused_kernels.cpu_gemm`` runs the first two on oneDNN off Intel CPUs, and the third
on AMD CPUs from family 26 (Zen 5), before it only where the weight is at least twice as wide as
tall (``weight_grad_on_onednn``; the table's last column says which library it takes per row);
these tables are the measurement behind that choice. Also prints the CPU vendor and family and
what ``onednn_preferred`` answers here.

    uv run python benchmarks/cpu_gemm.py --threads 1 2
    uv run python benchmarks/cpu_gemm.py --suffix=-zen5   # another machine's record

Writes benchmarks/results/cpu_gemm<suffix>.json and .md (no suffix: the 2-core AMD EPYC of
family 25, Zen 4; ``-zen5``: family 26).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from shardwork.fused_kernels import cpu_gemm, onednn_preferred

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_record

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "qkv (h512, GQA 8/4)": (1024, 512, 1024),
    "mlp fc1 (2x1408)": (1024, 512, 2816),
    "mlp fc2": (1024, 1408, 512),
    "attention out (h512)": (1024, 512, 512),
    "head (vocab 8192)": (1024, 512, 8192),
    "expert fc1 (2x1792, 512 rows)": (512, 512, 3584),
    "expert fc2": (512, 1792, 512),
    "expert fc1 (2x192, 256 rows)": (256, 512, 384),
    "expert fc2 (ffn 192)": (256, 192, 512),
}  # fmt: skip


def onednn_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a·bᵀ`` on oneDNN's linear, with the operands exactly as given."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def best_seconds(fn, repeats: int, *, warm_up: bool = True) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (after one untimed call with ``warm_up``)."""
    if warm_up:
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def linear_products(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, tuple]:
    """A linear's three products for ``x [M, K]``, ``w [N, K]``, ``dy [M, N]``: per product,
    ``(MKL call, oneDNN call)``."""
    return {
        "forward x·Wᵀ": (lambda: torch.mm(x, w.t()), lambda: onednn_product(x, w)),
        "input grad dY·W": (lambda: torch.mm(dy, w), lambda: onednn_product(dy, w.t())),
        "weight grad dYᵀ·x": (lambda: torch.mm(dy.t(), x), lambda: onednn_product(dy.t(), x.t())),
    }


def measure(m: int, k: int, n: int, repeats: int) -> dict:
    """GFLOP/s of each product with each library (interleaved, best of ``repeats``)."""
    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen) for s in ((m, k), (n, k), (m, n)))
    products = linear_products(x, w, dy)
    flops = 2 * m * k * n
    # The library shardwork takes for each product here (forward and input gradient: oneDNN
    # wherever it is preferred; the weight gradient dW [n, k] by its shape).
    on_dnn = {"forward x·Wᵀ": True, "input grad dY·W": True,
              "weight grad dYᵀ·x": cpu_gemm.weight_grad_on_onednn(m, n, k)}  # fmt: skip
    out = {}
    for name, (mkl, dnn) in products.items():
        t_mkl, t_dnn = float("inf"), float("inf")
        for _ in range(3):  # interleave the libraries so drift in the machine hits both
            t_mkl = min(t_mkl, best_seconds(mkl, repeats))
            t_dnn = min(t_dnn, best_seconds(dnn, repeats))
        out[name] = {"mkl_gflops": flops / t_mkl / 1e9, "onednn_gflops": flops / t_dnn / 1e9,
                     "speedup": t_mkl / t_dnn,
                     "shardwork_takes": "oneDNN" if on_dnn[name] else "MKL"}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--suffix", default="", help="appended to the result files' name")
    args = ap.parse_args()
    x = torch.empty(1, 1)
    result = {
        "benchmark": "cpu_gemm", "torch": torch.__version__, "machine": machine_record(),
        "vendor": cpu_gemm.cpu_vendor(), "cpu_family": cpu_gemm.cpu_family(),
        "onednn_preferred": onednn_preferred("auto", x, x),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": [],
    }  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for label, (m, k, n) in SHAPES.items():
            for product, r in measure(m, k, n, args.repeats).items():
                result["rows"].append({"threads": threads, "shape": label, "mkn": [m, k, n],
                                       "product": product, **r})  # fmt: skip
                print(f"{threads}t {label:30s} {product:18s} MKL {r['mkl_gflops']:6.1f} "
                      f"oneDNN {r['onednn_gflops']:6.1f} GFLOP/s  x{r['speedup']:.3f}")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"cpu_gemm{args.suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"cpu_gemm{args.suffix}.md").write_text(markdown(result))


def markdown(result: dict) -> str:
    lines = [
        "# Float32 CPU products: MKL (torch.mm) against oneDNN",
        "",
        f"CPU vendor {result['vendor']!r}, family {result.get('cpu_family')}, "
        f"torch CPU capability {result['cpu_capability']}, "
        f"torch {result['torch']}; `onednn_preferred` here: {result['onednn_preferred']}. "
        "Best of interleaved repeats; speedup = MKL time / oneDNN time (> 1: oneDNN faster). "
        "Last column: the library shardwork's float32 CPU linears and experts take for that "
        "product where oneDNN is preferred (a group's product below 256 rows or inner width "
        "stays on MKL).",
        "",
        "| threads | shape | M, K, N | product | MKL GFLOP/s | oneDNN GFLOP/s | speedup "
        "| shardwork takes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        m, k, n = r["mkn"]
        lines.append(
            f"| {r['threads']} | {r['shape']} | {m}, {k}, {n} | {r['product']} | "
            f"{r['mkl_gflops']:.1f} | {r['onednn_gflops']:.1f} | {r['speedup']:.3f} | "
            f"{r['shardwork_takes']} |"
        )
    lines += ["", f"Machine: {json.dumps(result['machine'])}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
