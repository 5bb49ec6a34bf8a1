"""Benchmark shardwork's MoE layer against its peers, and its expert GEMM strategies (CPU or GPU).

``--part peers`` (issue 24): the whole MoE layer (router, dispatch, experts, combine, shared
expert) forward + backward on 2,048 tokens at hidden 512, shardwork's ``MoELayer`` against
Megatron-Core 0.19.2's ``MoELayer`` and transformers' sparse MoE blocks with grouped_mm experts,
for Mixtral-, Qwen3-MoE- and DeepSeek-V3-style routing (:mod:`moe_peers` builds them from one
weight set). Outputs and input gradients are compared before timing (a side that disagrees
is not timed); the sides then run interleaved, round by round, with gradients reset before each
run; ratio = peer time / shardwork time, the median over rounds (> 1: shardwork faster).
By default one thread and the process's CPU time (``time.process_time``): on a shared machine
other processes' load stretches wall time but not what the sides themselves cost
(``--clock wall`` times wall-clock instead). Megatron-Core is benchmark-only and installed
beside the project into the ``--peer-path`` folder (default ``$SHARDWORK_PEERS``)::

    pip download megatron-core==0.19.2 --no-deps --python-version 3.12 --only-binary=:all: -d W
    cp W/megatron_core-0.19.2-cp312-*.whl W/megatron_core-0.19.2-py3-none-any.whl
    uv pip install --no-deps --target "$SHARDWORK_PEERS" W/megatron_core-0.19.2-py3-none-any.whl einops

(its wheel is tagged for Python 3.12 only; its code runs on 3.11). A peer that cannot run is
recorded with the reason: a goal not met, never a pass. Writes
benchmarks/results/models_moe_peers.json and .md (with ``--threads N`` other than 1:
``models_moe_peers-Nthreads``; two threads are the whole 2-core machine, timed with
``--clock wall``; ``--suffix=-zen5`` appended: a Zen 5 machine's record beside the Zen 4 one).

``--part gemm``: strategies, same inputs, forward + backward of one SwiGLU expert layer
(``fc1 [L, 2F, H]`` -> swiglu -> ``fc2 [L, H, F]``) on tokens grouped by expert:
  - ``grouped_mm``: torch.nn.functional.grouped_mm (what MoEConfig.grouped_gemm="auto" picks
    for fp32/bf16 when strides allow);
  - ``batched``: padded bmm (the fallback);
  - ``loop``: one matmul per expert over its row block (Megatron's SequentialMLP style).
Token distributions: balanced, and skewed (Zipf-like: expert i gets ~1/(i+1) of the tokens).
Outputs are checked equal (rtol 1e-4) before timing. Writes
benchmarks/results/models_moe[_<device>].json and .md.

Usage: uv run python benchmarks/models_moe.py --part peers [--rounds 7]
       uv run python benchmarks/models_moe.py --part gemm [--tokens 4096] [--hidden 512] [--ffn 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from runtime_env import RUNTIME_ENV  # before torch: shardwork-train's environment, every side

# isort: split
import torch

from shardwork.fused_kernels import swiglu
from shardwork.models.moe import grouped_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_peers
from machine import machine_record

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


def gemm_main(args) -> None:
    """The expert GEMM strategies (``--part gemm``)."""
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


def build_sides(case: str) -> tuple[list[moe_peers.MoESide], dict[str, str]]:
    """shardwork's, transformers' and Megatron-Core's layers of ``case``; the sides that
    could not be built, with the reason."""
    model = moe_peers.hf_model(case)
    layer, config = moe_peers.shardwork_layer(model)
    sides = [moe_peers.shardwork_side(layer), moe_peers.hf_side(model)]
    skipped = {}
    why = moe_peers.load_megatron()
    if why is None:
        try:
            sides.append(moe_peers.megatron_side(layer, config))
        except Exception as err:  # a peer that cannot run is a result, not a crash
            why = f"{type(err).__name__}: {err}"
    if why is not None:
        skipped["megatron-core"] = why
    return sides, skipped


def check_sides(sides, x, dy, max_error: float) -> dict[str, dict]:
    """Output and input-gradient errors of every side against shardwork's; a side beyond
    ``max_error`` (of the tensor's own scale) is removed from ``sides``."""
    ref_y, ref_dx = sides[0].run(x, dy)
    checks = {}
    for side in list(sides[1:]):
        y, dx = side.run(x, dy)
        err = {"y": moe_peers.max_relative(y, ref_y), "dx": moe_peers.max_relative(dx, ref_dx)}
        checks[side.name] = err
        if max(err.values()) > max_error:
            sides.remove(side)
    return checks


def time_sides(sides, x, dy, rounds: int, clock) -> dict[str, list[float]]:
    """Seconds per forward + backward of each side, interleaved, gradients reset each run."""
    times = {side.name: [] for side in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            for p in side.params:
                p.grad = None
            start = clock()
            side.run(x, dy)
            times[side.name].append(clock() - start)
    return times


def peers_main(args) -> None:
    """The MoE layer against Megatron-Core and transformers (``--part peers``)."""
    if args.peer_path:
        sys.path.insert(0, args.peer_path)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for case in args.cases:
        sides, skipped = build_sides(case)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(args.tokens, moe_peers.HIDDEN, generator=gen)
        dy = torch.randn(args.tokens, moe_peers.HIDDEN, generator=gen)
        checks = check_sides(sides, x, dy, args.max_error)
        for side in sides:  # warm-up
            side.run(x, dy)
        times = time_sides(sides, x, dy, args.rounds, clock)
        base = times["shardwork"]
        row = {"case": case, "routing": moe_peers.describe(case), "checks": checks,
               "not_run": skipped, "ms": {}, "ratio": {}}  # fmt: skip
        for name, t in times.items():
            row["ms"][name] = statistics.median(t) * 1e3
            row["ratio"][name] = statistics.median(a / b for a, b in zip(t, base))
        rows.append(row)
        print(f"{case:12s} " + "  ".join(
            f"{n} {row['ms'][n]:8.1f} ms x{row['ratio'][n]:.3f}" for n in row["ms"]
        ) + (f"  not run: {skipped}" if skipped else ""))  # fmt: skip
    write_peers(args, rows)


def write_peers(args, rows) -> None:
    machine = machine_record() | {"threads": torch.get_num_threads(), "torch": torch.__version__}
    machine["env"] = RUNTIME_ENV
    result = {"tokens": args.tokens, "hidden": moe_peers.HIDDEN, "rounds": args.rounds,
              "clock": args.clock, "machine": machine, "rows": rows}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    # One table per thread count: the one-thread table is the issue-24 record; two threads is
    # the whole 2-core machine, as a training run uses it.
    threads = machine["threads"]
    stem = "models_moe_peers" + ("" if threads == 1 else f"-{threads}threads") + args.suffix
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    peers = ["transformers", "megatron-core"]
    clock = "CPU time of the process" if args.clock == "cpu" else "wall-clock time"
    lines = [
        "# MoE layer forward + backward: shardwork vs transformers and Megatron-Core",
        "",
        f"{args.tokens} tokens, hidden {moe_peers.HIDDEN}, float32, "
        f"{machine['threads']} thread(s), {clock}; median of {args.rounds} interleaved rounds. "
        "ratio = peer time / shardwork time (> 1: shardwork faster). Errors: max |peer - "
        "shardwork| / max |shardwork| of the output and the input gradient.",
        "",
        "| case | routing | shardwork ms | transformers ms | ratio | Megatron-Core ms | ratio "
        "| errors (y, dx) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for peer in peers:
            if peer in r["ms"]:
                cells += [f"{r['ms'][peer]:.1f}", f"{r['ratio'][peer]:.3f}"]
            else:
                why = r["not_run"].get(peer) or "outputs differ"
                cells += [f"not run: {why[:80]}", ""]
        errs = "; ".join(f"{n} {c['y']:.1e}, {c['dx']:.1e}" for n, c in r["checks"].items())
        lines.append(
            f"| {r['case']} | {r['routing']} | {r['ms']['shardwork']:.1f} | "
            + " | ".join(cells) + f" | {errs} |"
        )  # fmt: skip
    lines += ["", f"Machine: {json.dumps(machine)}", ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("peers", "gemm"), default="peers")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens (default 2048 for peers, 4096 for gemm)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=None)
    # --part peers
    ap.add_argument("--cases", nargs="+", default=list(moe_peers.CASES), choices=moe_peers.CASES)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--max-error", type=float, default=1e-5,
                    help="largest relative difference from shardwork a peer may have")  # fmt: skip
    ap.add_argument("--suffix", default="",
                    help="appended to the result files' name (another machine's record)")  # fmt: skip
    ap.add_argument("--peer-path", default=os.environ.get("SHARDWORK_PEERS"),
                    help="folder holding Megatron-Core installed beside the project")  # fmt: skip
    # --part gemm
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    args = ap.parse_args()
    if args.part == "peers":
        args.tokens, args.rounds = args.tokens or 2048, args.rounds or 7
        peers_main(args)
    else:
        args.tokens, args.rounds = args.tokens or 4096, args.rounds or 5
        gemm_main(args)


if __name__ == "__main__":
    main()
