"""Benchmark the MoE expert GEMMs of shardwork.models.moe (CPU or GPU), side by side.

Strategies, same inputs, forward + backward of one SwiGLU expert layer
(``fc1 [L, 2F, H]`` -> swiglu -> ``fc2 [L, H, F]``) on tokens grouped by expert:
  - ``grouped_mm``: torch.nn.functional.grouped_mm (what MoEConfig.grouped_gemm="auto" picks
    for fp32/bf16 when strides allow);
  - ``batched``: padded bmm (the fallback);
  - ``loop``: one matmul per expert over its row block (Megatron's SequentialMLP style).
Token distributions: balanced, and skewed (Zipf-like: expert i gets ~1/(i+1) of the tokens).
Outputs are checked equal (rtol 1e-4) before timing. Writes
benchmarks/results/models_moe[_<device>].json and .md.

Usage: uv run python benchmarks/models_moe.py [--tokens 4096] [--hidden 512] [--ffn 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from shardwork.fused_kernels import swiglu
from shardwork.models.moe import grouped_linear

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _loop(x, w, counts):
    out, start = [], 0
    for i, c in enumerate(counts.tolist()):
        out.append(x[start : start + c] @ w[i].t())
        start += c
    return torch.cat(out)


def _layer(mode, x, w1, w2, counts):
    if mode == "loop":
        return _loop(swiglu(_loop(x, w1, counts), backend="torch"), w2, counts)
    h = swiglu(grouped_linear(x, w1, counts, mode=mode), backend="torch")
    return grouped_linear(h, w2, counts, mode=mode)


def _counts(tokens, experts, skew):
    if not skew:
        base = torch.full((experts,), tokens // experts)
    else:
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        base = (weights / weights.sum() * tokens).floor().long()
    base[0] += tokens - int(base.sum())
    return base


def _time(fn, rounds):
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    modes = ["grouped_mm", "batched", "loop"]
    rows = []
    for experts in args.experts:
        for skew in (False, True):
            gen = torch.Generator().manual_seed(0)
            counts = _counts(args.tokens, experts, skew)
            x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
            w1 = (torch.randn(experts, 2 * args.ffn, args.hidden, generator=gen) * 0.05).to(
                device, dtype
            )
            w2 = (torch.randn(experts, args.hidden, args.ffn, generator=gen) * 0.05).to(
                device, dtype
            )
            grad = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
            outs, times = {}, {}
            for mode in modes:
                xs, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))

                def step(mode=mode, xs=xs, a=a, b=b, counts=counts, grad=grad):
                    y = _layer(mode, xs, a, b, counts)
                    y.backward(grad)
                    return y

                outs[mode] = step().detach().float()
                times[mode] = _time(step, args.rounds)
            for mode in modes[1:]:
                torch.testing.assert_close(outs[mode], outs["grouped_mm"], rtol=1e-2, atol=1e-2)
            row = dict(
                experts=experts,
                distribution="skewed" if skew else "balanced",
                max_rows=int(counts.max()),
                **{f"{m}_ms": times[m] * 1e3 for m in modes},
                batched_over_grouped=times["batched"] / times["grouped_mm"],
                loop_over_grouped=times["loop"] / times["grouped_mm"],
            )
            rows.append(row)
            print(
                f"E={experts:3d} {row['distribution']:8s} grouped {row['grouped_mm_ms']:8.2f} ms  "
                f"batched {row['batched_ms']:8.2f} ms ({row['batched_over_grouped']:.2f}x)  "
                f"loop {row['loop_ms']:8.2f} ms ({row['loop_over_grouped']:.2f}x)"
            )
    machine = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        dtype=str(dtype),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        load_average=os.getloadavg(),
        tokens=args.tokens,
        hidden=args.hidden,
        ffn=args.ffn,
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "models_moe" if device == "cpu" else "models_moe_cuda"
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    lines = [
        "# MoE expert GEMMs (forward + backward), best of rounds",
        "",
        f"Machine: {machine}",
        "",
        "| experts | tokens/expert | max rows | grouped_mm ms | batched ms | loop ms | batched/grouped | loop/grouped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['experts']} | {r['distribution']} | {r['max_rows']} | {r['grouped_mm_ms']:.2f} | "
            f"{r['batched_ms']:.2f} | {r['loop_ms']:.2f} | {r['batched_over_grouped']:.2f} | "
            f"{r['loop_over_grouped']:.2f} |"
        )
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
