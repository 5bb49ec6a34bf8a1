"""Benchmark shardwork.fused_kernels: every op on every backend that can run here, vs torch eager.

For each op it times forward and forward+backward (median of repeats; CUDA events on a GPU,
perf_counter on a CPU), computes the bytes the op must move at minimum (inputs read once,
outputs written once) and reports achieved bandwidth as a share of this device's measured
copy bandwidth (``dst.copy_(src)`` of a large buffer), plus the speedup over the torch
reference backend (torch eager) measured in the same run on the same inputs.

- GPU (``--size llm``, default there): a sweep of LLM shapes — tokens 8k / 32k / 64k × hidden
  4096 / 8192 (SwiGLU intermediate 14336 / 28672, 128-wide heads, vocab 128256 for cross
  entropy and 256 experts top-8 for routing; cross entropy and permutation capped at 16k
  tokens). Backends: torch, triton, and te where Transformer Engine offers the op. Each
  non-torch row says whether it meets the goal (>= 85 % of copy bandwidth and >= 1.5x torch
  eager, forward + backward). Cross entropy also reports the peak memory beyond the logits
  (goal: no extra logits-sized buffer besides the gradient).
- CPU (``--size small``, default there): modest shapes, torch backend only (Triton runs on a
  CPU only under its interpreter, which is a correctness tool, not a performance path); the
  results say so and mark the GPU row "not yet measured".

Writes benchmarks/results/kernels-<device>.json and .md.

    uv run python benchmarks/kernels.py [--size small|llm] [--ops rms_norm swiglu ...] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import shardwork.fused_kernels as fk
from shardwork.fused_kernels import te_support

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_PCT_OF_COPY = 85.0  # issue 4: memory-bound kernels at >= 85 % of the copy bandwidth
GOAL_SPEEDUP = 1.5  # ... and >= 1.5x torch eager (forward + backward)


def _llm_point(tokens: int, hidden: int) -> dict:
    """LLM shapes at one (tokens, hidden) point: Llama-3 8B (4096) / 70B (8192) MLP widths,
    128-wide heads, a 128k vocabulary, DeepSeek-V3-style routing (256 experts, top-8).
    Cross entropy and permutation are capped at 16k tokens (their buffers are vocab- or
    top-k-times larger than the hidden states)."""
    return dict(tokens=tokens, hidden=hidden, inter={4096: 14336, 8192: 28672}[hidden],
                heads=hidden // 128, head_dim=128, ce_tokens=min(tokens, 16384), vocab=128256,
                router_tokens=tokens, experts=256, topk=8, perm_hidden=hidden,
                perm_tokens=min(tokens, 16384))  # fmt: skip


SIZES = {
    # The sweep on a GPU: tokens 8k-64k x hidden 4096-8192.
    "llm": [_llm_point(t, h) for h in (4096, 8192) for t in (8192, 32768, 65536)],
    # One modest point on a CPU (torch backend only).
    "small": [dict(tokens=2048, hidden=1024, inter=1408, heads=8, head_dim=128, ce_tokens=512,
                   vocab=32000, router_tokens=4096, experts=64, topk=8, perm_hidden=512,
                   perm_tokens=2048)],
}  # fmt: skip


def _timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        fn()  # warm-up (compiles Triton kernels)
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return run


def copy_bandwidth(device: torch.device, timer) -> float:
    """Bytes/s of ``dst.copy_(src)`` (read + write) on a buffer far larger than any cache."""
    n = (1 << 30 if device.type == "cuda" else 1 << 26) // 2
    src = torch.randn(n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / timer(lambda: dst.copy_(src))


def _cases(s: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """op -> (build inputs, call(inputs, backend) -> output(s) to backprop, fwd bytes, bwd bytes)."""
    e = torch.tensor([], dtype=dtype).element_size()
    t, h, inter = s["tokens"], s["hidden"], s["inter"]

    def rand(*shape, requires_grad=True, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt).requires_grad_(requires_grad)

    def rotary_inputs():
        cos, sin = fk.rotary_cos_sin(
            torch.arange(t, device=device), fk.rotary_inv_freq(s["head_dim"]).to(device)
        )
        return rand(t, s["heads"], s["head_dim"]), cos, sin

    def route_inputs():
        r = fk.router_topk(
            torch.randn(s["perm_tokens"], s["experts"], device=device),
            topk=s["topk"],
            backend="torch",
        )
        return rand(s["perm_tokens"], s["perm_hidden"]), r.routing_map, r.probs.requires_grad_(True)

    def permute_round_trip(inp, b):
        tokens, routing_map, probs = inp
        permuted, pp, idx = fk.permute_tokens(tokens, routing_map, probs=probs, backend=b)
        return fk.unpermute_tokens(permuted, idx, probs=pp, restore_shape=tokens.shape, backend=b)

    th, ti, rows = t * h, t * inter, t * s["heads"] * s["head_dim"]
    pk = s["perm_tokens"] * s["topk"] * s["perm_hidden"]
    perm = (2 * pk + pk + s["perm_tokens"] * s["perm_hidden"]) * e  # same bytes fwd and bwd
    ce = s["ce_tokens"] * s["vocab"]
    re = s["router_tokens"] * s["experts"]
    return {
        "rms_norm": (lambda: (rand(t, h), rand(h, dt=torch.float32)),
                     lambda inp, b: fk.rms_norm(*inp, backend=b), 2 * th * e, 3 * th * e),
        "layer_norm": (lambda: (rand(t, h), rand(h, dt=torch.float32), rand(h, dt=torch.float32)),
                       lambda inp, b: fk.layer_norm(*inp, backend=b), 2 * th * e, 3 * th * e),
        "swiglu": (lambda: (rand(t, 2 * inter),), lambda inp, b: fk.swiglu(inp[0], backend=b),
                   3 * ti * e, 5 * ti * e),
        "rotary": (rotary_inputs, lambda inp, b: fk.apply_rotary(*inp, backend=b), 2 * rows * e, 2 * rows * e),
        "cross_entropy": (lambda: (rand(s["ce_tokens"], s["vocab"]),
                                   torch.randint(0, s["vocab"], (s["ce_tokens"],), device=device)),
                          lambda inp, b: fk.cross_entropy(*inp, backend=b), ce * e, 2 * ce * e),
        "router_topk": (lambda: (rand(s["router_tokens"], s["experts"]),),
                        lambda inp, b: fk.router_topk(inp[0], topk=s["topk"], score_function="sigmoid",
                                                      num_groups=8, group_topk=4, backend=b).probs,
                        re * (2 * e + 1 + 4), re * (3 * e + 1)),
        "permute+unpermute": (route_inputs, permute_round_trip, perm, perm),
    }  # fmt: skip


_OP_NAME = {"permute+unpermute": "permute"}


def _backends(op: str, device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["torch"]
    out = ["torch"]
    if fk.backend.triton_available():
        out.append("triton")
    if te_support.unavailable_reason(_OP_NAME.get(op, op)) is None:
        out.append("te")
    return out


def _measure(op, b, call, inputs, timer, fwd_bytes, bwd_bytes, copy_bw, device) -> dict:
    out = call(inputs, b)
    grad = torch.randn_like(out)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def fwd():
        with torch.no_grad():
            return call(inputs, b)

    def fwd_bwd():
        return torch.autograd.grad(call(inputs, b), leaves, grad)

    t_fwd, t_all = timer(fwd), timer(fwd_bwd)
    row = {"op": op, "backend": b, "fwd_ms": t_fwd * 1e3, "fwd_bwd_ms": t_all * 1e3}
    row["fwd_pct_of_copy"] = 100 * fwd_bytes / t_fwd / copy_bw
    row["fwd_bwd_pct_of_copy"] = 100 * (fwd_bytes + bwd_bytes) / t_all / copy_bw
    if op == "cross_entropy" and device.type == "cuda":
        del out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        logits_bytes = inputs[0].numel() * inputs[0].element_size()
        row["peak_extra_over_logits"] = (torch.cuda.max_memory_allocated() - before) / logits_bytes
    return row


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    size = args.size or ("llm" if device.type == "cuda" else "small")
    points = SIZES[size]
    dtype = torch.bfloat16
    timer = _timer(device, args.repeats)
    copy_bw = copy_bandwidth(device, timer)
    rows = []
    for s in points:
        shape = f"T={s['tokens']} H={s['hidden']}"
        cases = _cases(s, device, dtype)
        for op in args.ops or list(cases):
            build, call, fwd_bytes, bwd_bytes = cases[op]
            inputs = build()
            base = {}
            for b in _backends(op, device):
                row = _measure(op, b, call, inputs, timer, fwd_bytes, bwd_bytes, copy_bw, device)
                row["shape"] = shape
                if b == "torch":
                    base = row
                row["speedup_vs_torch_fwd"] = base["fwd_ms"] / row["fwd_ms"]
                row["speedup_vs_torch_fwd_bwd"] = base["fwd_bwd_ms"] / row["fwd_bwd_ms"]
                if b != "torch":
                    row["meets_goal"] = bool(
                        row["fwd_bwd_pct_of_copy"] >= GOAL_PCT_OF_COPY
                        and row["speedup_vs_torch_fwd_bwd"] >= GOAL_SPEEDUP
                    )
                rows.append(row)
                print(_fmt(row), flush=True)
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    return {
        "device": name,
        "device_type": device.type,
        "size": size,
        "shapes": points,
        "goal": {"pct_of_copy": GOAL_PCT_OF_COPY, "speedup_vs_torch": GOAL_SPEEDUP},
        "dtype": str(dtype),
        "torch": torch.__version__,
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "note": (
            "GPU run: CUDA-event medians"
            if device.type == "cuda"
            else "CPU run: torch backend only (Triton runs on CPU only under its interpreter, a "
            "correctness tool); GPU rows: not yet measured"
        ),
        "rows": rows,
    }


def _fmt(r: dict) -> str:
    return (
        f"{r['shape']:<16} {r['op']:<18} {r['backend']:<7} fwd {r['fwd_ms']:9.3f} ms {r['fwd_pct_of_copy']:6.1f}% copy "
        f"x{r['speedup_vs_torch_fwd']:.2f} | fwd+bwd {r['fwd_bwd_ms']:9.3f} ms "
        f"{r['fwd_bwd_pct_of_copy']:6.1f}% copy x{r['speedup_vs_torch_fwd_bwd']:.2f}"
    )


def _markdown(res: dict) -> str:
    lines = [
        f"# benchmarks/kernels.py — {res['device']} ({res['device_type']}, size {res['size']}, {res['dtype']})",
        "",
        f"torch {res['torch']}, {res['threads']} threads; copy bandwidth {res['copy_bandwidth_GBps']:.1f} GB/s; "
        f"1-min load average at the end {res['load_average_1min']:.1f} (a shared machine inflates CPU times).",
        f"{res['note']}.",
        "",
        "| shape | op | backend | fwd ms | fwd % copy BW | fwd speedup vs torch | fwd+bwd ms | fwd+bwd % copy BW | fwd+bwd speedup | goal met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        goal = {True: "yes", False: "no"}.get(r.get("meets_goal"), "-")
        lines.append(
            f"| {r['shape']} | {r['op']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_pct_of_copy']:.1f} | "
            f"{r['speedup_vs_torch_fwd']:.2f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_pct_of_copy']:.1f} | "
            f"{r['speedup_vs_torch_fwd_bwd']:.2f} | {goal} |"
        )
    if res["device_type"] != "cuda":
        lines += ["", "| GPU (H100/H200), torch / triton / te | not yet measured |", "|---|---|"]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default=None)
    p.add_argument("--ops", nargs="*", default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run on CPU even if CUDA is present")
    p.add_argument("--tag", default=None, help="result file suffix (default: device type)")
    args = p.parse_args()
    res = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"kernels-{args.tag or res['device_type']}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(_markdown(res))
    print(f"\n{res['note']}\nwrote {RESULTS / stem}.json and .md")


if __name__ == "__main__":
    main()
