"""Benchmark the output layer + loss: fused linear cross entropy vs materialised logits.

Paths (float32, forward + backward of ``loss = Σ CE(hidden · weightᵀ, labels)``, both
gradients kept at the end):

- ``materialised``: ``F.cross_entropy(F.linear(hidden, weight), labels)`` with no reference
  kept to the logits (the baseline's best case: only ``log_softmax``'s output is saved);
- ``shardwork unfused``: ``F.linear`` + ``fused_kernels.cross_entropy(inplace_backward=True)``
  (the model's path with ``fused_linear_cross_entropy=False``);
- ``fused``: ``fused_kernels.linear_cross_entropy`` (``grad_in_forward=True``, the model's
  default for float32) and ``fused, recompute`` (``grad_in_forward=False``).

**Memory** (goal: fused ≤ 1/8 of materialised at hidden 2048, vocab 128256, 8192 tokens): each
measurement runs in a fresh subprocess; after the inputs exist (and are touched) it reads
``VmRSS``, resets the peak (``5`` into ``/proc/self/clear_refs``), runs forward + backward and
reads ``VmHWM``. Reported: peak minus the inputs' resident memory, i.e. what the output layer
and the loss add, gradients included. Every path runs at ``--memory-tokens`` (default 1024);
the fused path and the baseline also at ``--goal-tokens`` (default 8192; the baseline only when
``MemAvailable`` holds 1.1× its analytic need, else its analytic bytes stand in, labelled so).
The analytic byte counts (written here, per path: the tensors alive at the peak) are printed
beside, and give the 256k vocabulary.

**Speed** (goal: fused ≥ materialised): median of interleaved rounds, same inputs, ratio =
materialised time / fused time; at the head of the issue's dense benchmark model (1024 tokens,
hidden 512, vocab 8192) and at a larger vocabulary. **Cross entropy alone** (issue 24 part 2):
``fused_kernels.cross_entropy`` (torch backend) vs ``F.cross_entropy`` on materialised logits.

``OMP_WAIT_POLICY=PASSIVE`` is set before torch loads, as ``shardwork-train`` does, for every
path alike. Writes ``benchmarks/results/linear_cross_entropy.json`` and ``.md``;
``--memory-from results.json`` reruns only the timings.

    uv run python benchmarks/linear_cross_entropy.py [--memory-tokens 1024] [--goal-tokens 8192]
        [--rounds 5] [--threads 2]

About 10 minutes on the 2-core machine (the 8192-token GEMMs: ~13 TFLOP per path);
``--goal-tokens 2048`` for a quick run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what shardwork-train sets, for all paths

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import machine_record

import shardwork.fused_kernels as fk
from shardwork.fused_kernels import linear_cross_entropy_op

RESULTS = Path(__file__).resolve().parent / "results"
GiB = float(1 << 30)
HIDDEN, VOCAB = 2048, 128256
GOAL_MEMORY_RATIO = 1 / 8


def _materialised(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight), labels, reduction="sum")


def _unfused(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return fk.cross_entropy(logits, labels, reduction="sum", inplace_backward=True)


def _fused(hidden, weight, labels):
    return fk.linear_cross_entropy(hidden, weight, labels, reduction="sum")


def _fused_recompute(hidden, weight, labels):
    return fk.linear_cross_entropy(hidden, weight, labels, reduction="sum", grad_in_forward=False)


PATHS = {
    "materialised": (_materialised, "F.linear + F.cross_entropy (materialised logits)"),
    "unfused": (_unfused, "shardwork unfused: F.linear + fused_kernels.cross_entropy (in place)"),
    "fused": (_fused, "shardwork fused: linear_cross_entropy (grad in forward)"),
    "fused_recompute": (_fused_recompute, "shardwork fused: linear_cross_entropy (recompute)"),
}


def _inputs(tokens: int, hidden: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, labels


def analytic_bytes(path: str, tokens: int, hidden: int, vocab: int, elem: int = 4) -> float:
    """Peak bytes beyond the inputs, counted tensor by tensor (the gradients included)."""
    logits = tokens * vocab * elem
    grads = (vocab + tokens) * hidden * elem  # d weight and d hidden
    if path == "materialised":
        # Forward: logits and log_softmax's output; backward: the saved output, nll's gradient
        # (zeros) and log_softmax's input gradient, then that gradient with d weight.
        return max(3 * logits, logits + grads)
    if path == "unfused":
        return logits + grads  # the gradient overwrites the logits
    rows = min(tokens, max(1, linear_cross_entropy_op._CHUNK_ELEMENTS // vocab))
    chunk = rows * vocab * elem  # one chunk of logits (forward)
    if path == "fused":  # the torch backend's float32 softmax of the chunk beside it
        chunk += rows * vocab * 4
    if path == "fused_recompute":  # backward: every token × a slice of the vocabulary
        cols = max(1, linear_cross_entropy_op._CHUNK_ELEMENTS // tokens)
        chunk = max(chunk, tokens * min(cols, vocab) * elem)
    return grads + chunk + tokens * 24  # + per-token stats, labels and masks


# ---------------------------------------------------------------------------------------------
# memory: one measurement per subprocess
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_child(path: str, tokens: int, hidden: int, vocab: int, threads: int) -> dict:
    """In the subprocess: bytes the path adds at its peak, and its wall time."""
    torch.set_num_threads(threads)
    h, w, labels = _inputs(tokens, hidden, vocab)
    gc.collect()
    base = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    PATHS[path][0](h, w, labels).backward()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"extra_bytes": (peak - base) * 1024.0, "seconds": seconds}


def measure(path: str, tokens: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", path, str(tokens), str(args.hidden),
           str(args.vocab), str(args.threads)]  # fmt: skip
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["analytic_bytes"] = analytic_bytes(path, tokens, args.hidden, args.vocab)
    print(f"  {path:<16} T={tokens:<6} +{result['extra_bytes'] / GiB:6.2f} GiB "
          f"(analytic {result['analytic_bytes'] / GiB:6.2f}) {result['seconds']:6.1f} s",
          flush=True)  # fmt: skip
    return result


def _available_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024.0
    return 0.0


def memory_section(args) -> dict:
    measured: dict[str, dict[int, dict]] = {p: {} for p in PATHS}
    for tokens in args.memory_tokens:
        for path in PATHS:
            measured[path][tokens] = measure(path, tokens, args)
    goal = args.goal_tokens
    at_goal = {}
    for path in ("fused", "materialised"):
        need = analytic_bytes(path, goal, args.hidden, args.vocab)
        available = _available_bytes()
        if need * 1.1 < available:
            measured[path][goal] = measure(path, goal, args)
            at_goal[path] = {"bytes": measured[path][goal]["extra_bytes"], "how": "measured"}
        else:
            print(f"  {path}: {need / GiB:.1f} GiB analytic, {available / GiB:.1f} available: "
                  "analytic bytes stand in", flush=True)  # fmt: skip
            at_goal[path] = {"bytes": need, "how": "analytic (not enough free memory to run)"}
    ratio = at_goal["fused"]["bytes"] / at_goal["materialised"]["bytes"]
    analytic_256k = {
        p: analytic_bytes(p, goal, args.hidden, 256000, elem=4) for p in ("materialised", "fused")
    }
    return {
        "measured": {p: {str(t): r for t, r in pts.items()} for p, pts in measured.items()},
        "at_goal_tokens": at_goal,
        "goal_tokens": goal,
        "fused_over_materialised": ratio,
        "goal_ratio": GOAL_MEMORY_RATIO,
        "meets_goal": ratio <= GOAL_MEMORY_RATIO,
        "analytic_256k_vocab": analytic_256k,
        "analytic_256k_ratio": analytic_256k["fused"] / analytic_256k["materialised"],
    }


# ---------------------------------------------------------------------------------------------
# speed: interleaved rounds in this process
def _clock(run) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``run()``: CPU time counts this process's work
    only, so it moves less than wall time when other jobs share the cores."""
    w0, c0 = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - w0, time.process_time() - c0


def _timed(fn, inputs) -> tuple[float, float]:
    h, w, labels = inputs
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    return _clock(lambda: fn(h, w, labels).backward())


def _summary(samples: dict[str, list[tuple[float, float]]], baseline: str) -> dict:
    """Per side: median wall, median CPU and best wall seconds, and the baseline's over each."""
    stats = {
        side: {
            "median_wall_s": statistics.median(w for w, _ in xs),
            "median_cpu_s": statistics.median(c for _, c in xs),
            "best_wall_s": min(w for w, _ in xs),
        }
        for side, xs in samples.items()
    }
    keys = ("median_wall_s", "median_cpu_s", "best_wall_s")
    for st in stats.values():
        st["speedup"] = {k: stats[baseline][k] / st[k] for k in keys}
    return stats


def speed_point(tokens: int, hidden: int, vocab: int, rounds: int) -> dict:
    inputs = _inputs(tokens, hidden, vocab, seed=1)
    losses = {
        p: float(fn(*(t.detach() for t in inputs[:2]), inputs[2])) for p, (fn, _) in PATHS.items()
    }
    samples: dict[str, list[tuple[float, float]]] = {p: [] for p in PATHS}
    for fn, _ in PATHS.values():  # warm-up
        _timed(fn, inputs)
    for r in range(rounds):
        order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
        for p in order:
            samples[p].append(_timed(PATHS[p][0], inputs))
    return {
        "shape": {"tokens": tokens, "hidden": hidden, "vocab": vocab},
        "losses": losses,
        "samples_wall_cpu_s": samples,
        "stats": _summary(samples, "materialised"),
    }


def cross_entropy_point(tokens: int, vocab: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(tokens, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    sides = {
        "F.cross_entropy": lambda x: F.cross_entropy(x, labels, reduction="sum"),
        "shardwork cross_entropy": lambda x: fk.cross_entropy(x, labels, reduction="sum"),
        "shardwork cross_entropy, in place": lambda x: fk.cross_entropy(
            x, labels, reduction="sum", inplace_backward=True
        ),
    }
    samples: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
    for r in range(rounds + 1):
        for s in sides if r % 2 == 0 else reversed(sides):
            # logits as an intermediate (straight out of a layer), as the loss sees them
            x = logits.clone().requires_grad_(True) * 1.0
            timing = _clock(lambda s=s, x=x: sides[s](x).backward())
            if r:  # round 0 warms up
                samples[s].append(timing)
    return {
        "shape": {"tokens": tokens, "vocab": vocab},
        "samples_wall_cpu_s": samples,
        "stats": _summary(samples, "F.cross_entropy"),
    }


# ---------------------------------------------------------------------------------------------
def _speed_row(shape: str, label: str, st: dict) -> str:
    up = st["speedup"]
    return (
        f"| {shape} | {label} | {st['median_wall_s'] * 1e3:.1f} | "
        f"{st['median_cpu_s'] * 1e3:.1f} | {up['median_wall_s']:.2f} | "
        f"{up['median_cpu_s']:.2f} | {up['best_wall_s']:.2f} |"
    )


def _markdown(out: dict) -> str:
    mem, m = out["memory"], out["machine"]
    lines = [
        "# Output layer + loss: fused linear cross entropy vs materialised logits (float32, CPU)",
        "",
        f"Machine: {m}. `OMP_WAIT_POLICY=PASSIVE`, {out['threads']} threads.",
        "",
        *(
            [
                f"Memory section from an earlier run of this script (machine then: "
                f"{out['memory_from']}); timings from this run.",
                "",
            ]
            if "memory_from" in out
            else []
        ),
        f"## Peak memory beyond the inputs, hidden {out['hidden']}, vocab {out['vocab']}",
        "",
        "Peak resident memory (VmHWM, reset after the inputs exist) minus the inputs' resident "
        "memory, one fresh process per measurement; gradients included. Analytic: the bytes of "
        "the tensors alive at the peak, counted in the script.",
        "",
        "| path | tokens | GiB | analytic GiB | seconds |",
        "|---|---|---|---|---|",
    ]
    for path, points in mem["measured"].items():
        for tokens, r in points.items():
            lines.append(f"| {PATHS[path][1]} | {tokens} | {r['extra_bytes'] / GiB:.2f} | "
                         f"{r['analytic_bytes'] / GiB:.2f} | {r['seconds']:.1f} |")  # fmt: skip
    goal = mem["goal_tokens"]
    lines += ["", f"At {goal} tokens:", "", "| path | GiB | how |", "|---|---|---|"]
    for path, r in mem["at_goal_tokens"].items():
        lines.append(f"| {PATHS[path][1]} | {r['bytes'] / GiB:.2f} | {r['how']} |")
    lines += [
        "",
        f"**Fused / materialised at {goal} tokens: {mem['fused_over_materialised']:.3f} "
        f"(1/{1 / mem['fused_over_materialised']:.1f}); goal ≤ 1/8: "
        f"{'met' if mem['meets_goal'] else 'NOT met'}.** Vocabulary 256000, analytic: "
        f"materialised {mem['analytic_256k_vocab']['materialised'] / GiB:.1f} GiB, fused "
        f"{mem['analytic_256k_vocab']['fused'] / GiB:.2f} GiB "
        f"(1/{1 / mem['analytic_256k_ratio']:.1f}).",
        "",
        "## Speed, forward + backward (interleaved rounds)",
        "",
        "Ratios are materialised time / path time (> 1: the path is faster): of the median "
        "wall time, the median process CPU time (this process's work only, steadier when "
        "other jobs share the cores) and the best wall time.",
        "",
        "| tokens × hidden × vocab | path | median ms | CPU ms | ratio wall | ratio CPU | "
        "ratio best |",
        "|---|---|---|---|---|---|---|",
    ]
    for point in out["speed"]:
        s = point["shape"]
        shape = f"{s['tokens']}×{s['hidden']}×{s['vocab']}"
        lines += [_speed_row(shape, PATHS[p][1], point["stats"][p]) for p in PATHS]
    lines += [
        "",
        "## Cross entropy alone on materialised float32 logits, forward + backward",
        "",
        "Ratios: F.cross_entropy time / this implementation's.",
        "",
        "| tokens × vocab | implementation | median ms | CPU ms | ratio wall | ratio CPU | "
        "ratio best |",
        "|---|---|---|---|---|---|---|",
    ]
    for point in out["cross_entropy"]:
        s = point["shape"]
        shape = f"{s['tokens']}×{s['vocab']}"
        lines += [_speed_row(shape, side, st) for side, st in point["stats"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--memory-tokens", type=int, nargs="*", default=[1024])
    parser.add_argument("--goal-tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--memory-from",
        type=Path,
        help="reuse the memory section of this results JSON (rerun only the timings)",
    )
    args = parser.parse_args()
    if args.child:
        path, tokens, hidden, vocab, threads = args.child
        print(json.dumps(measure_child(path, int(tokens), int(hidden), int(vocab), int(threads))))
        return 0
    torch.set_num_threads(args.threads)
    out = {"machine": machine_record(), "threads": args.threads, "hidden": args.hidden,
           "vocab": args.vocab, "torch": torch.__version__}  # fmt: skip
    if args.memory_from is not None:
        out["memory"] = json.loads(args.memory_from.read_text())["memory"]
        out["memory_from"] = json.loads(args.memory_from.read_text())["machine"]
    else:
        print("memory (one subprocess each):", flush=True)
        out["memory"] = memory_section(args)
    print("speed:", flush=True)
    out["speed"] = [speed_point(1024, 512, 8192, args.rounds),
                    speed_point(1024, 1024, 32768, args.rounds)]  # fmt: skip
    out["cross_entropy"] = [cross_entropy_point(1024, 8192, 2 * args.rounds + 1),
                            cross_entropy_point(64, 131072, 2 * args.rounds + 1)]  # fmt: skip
    out["machine"]["load_avg_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "linear_cross_entropy.json").write_text(json.dumps(out, indent=1) + "\n")
    text = _markdown(out)
    (RESULTS / "linear_cross_entropy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
