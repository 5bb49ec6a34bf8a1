"""Benchmark shardwork.dist_optimizer: ZeRO-1 memory per rank and overlapped vs serial steps.

(a) memory: optimizer-state + master-weight bytes per rank of ``DistributedOptimizer`` with
    ``torch.optim.AdamW`` on bf16 parameters, measured on real gloo ranks at DP = 1, 2, 4, 8
    after one step (what the optimizer actually allocated), against the ZeRO-1 formula
    ``12Ψ/DP`` (fp32 master + two fp32 moments). The same comparison from the layout alone
    (no processes) for a Llama-2-7B-shaped parameter list, where bucket padding is visible.
(b) speed on CPU, gloo, DP=4: an MLP whose parameters are large against its compute (small
    batch), so communication is a measurable part of a step. Four kinds of iteration, each on
    the same DDP buckets, interleaved in rounds (the order rotates per round):
    - comm-only: the step's collectives alone — every bucket's gradient reduce-scatter, then
      every bucket's parameter all-gather — with no forward, backward or optimizer work;
    - compute-only: forward, backward, the norm statistics and the local AdamW step on this
      rank's 1/DP shard, with no collective at all;
    - serial: a full step, reduce-scatter after backward, all-gather after the update;
    - overlapped: a full step with the reduce-scatter overlapped with backward and the
      all-gather with the next forward.
    An iteration's time is the slowest rank's; per round the median over iterations; per
    kind the median over rounds. Headline: overlapped/serial as the ratio of those medians,
    with the per-round ratios listed; hidden fraction = (serial - overlapped) / comm-only.
    4 ranks share 2 cores here (gloo's threads compete with compute), so there is no goal on CPU.
(c) the same four kinds on GPUs: one process per CUDA device (``torch.multiprocessing.spawn``,
    NCCL, FileStore rendezvous, at least 2 devices), bf16 parameters with fp32 gradient
    reduction, timed with CUDA events on the compute stream. Goal: hidden fraction >= 0.8.
    Without (enough) CUDA devices the JSON says why the part was not run (found at run time).

Prints tables and writes ``dist_optimizer.json`` and ``.md`` to ``--results-dir``
(default ``benchmarks/results``).
Usage: ``uv run python benchmarks/dist_optimizer.py [--device auto|cpu|cuda]``; a smoke run:
``--mem-width 16 --mem-layers 2 --width 64 --layers 2 --iters 2 --rounds 1 --results-dir /tmp/x``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch import nn

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
    ParamIndexMap,
)
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks, shutdown_pool

RESULTS = Path(__file__).resolve().parent / "results"


def mlp(width: int, layers: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods).to(dtype)


def _memory_rank(width: int, layers: int) -> dict:
    pg = init_process_groups(ParallelConfig())
    model = mlp(width, layers, torch.bfloat16)
    ddp = DistributedDataParallel(
        model, config=DDPConfig(use_distributed_optimizer=True), process_groups=pg
    )
    opt = DistributedOptimizer(ddp, lambda g: torch.optim.AdamW(g, lr=1e-3), process_groups=pg)
    ddp(torch.randn(4, width, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    master = sum(mp.master.numel() * mp.master.element_size() for mp in opt.pieces)
    state = sum(
        v.numel() * v.element_size()
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    padded = sum(b.layout.numel for b in ddp.buffers.values())
    return {"master_bytes": master, "state_bytes": state, "buffer_numel": padded}


def memory_measured(width: int, layers: int) -> list[dict]:
    psi = sum(p.numel() for p in mlp(width, layers, torch.bfloat16).parameters())
    rows = []
    for dp in (1, 2, 4, 8):
        per_rank = run_on_ranks(_memory_rank, dp, args=(width, layers), timeout=600)
        worst = max(r["master_bytes"] + r["state_bytes"] for r in per_rank)
        formula = 12 * psi / dp
        pad = (per_rank[0]["buffer_numel"] - psi) * 12 / dp
        rows.append(
            {
                "dp": dp,
                "psi": psi,
                "max_bytes_per_rank": worst,
                "formula_12psi_over_dp": formula,
                "padding_bytes_per_rank": pad,
                "excess_over_formula_pct": 100 * (worst - formula) / formula,
            }
        )
    return rows


def llama7b_shapes() -> list[tuple[int, ...]]:
    h, ffn, vocab, layers = 4096, 11008, 32000, 32
    shapes: list[tuple[int, ...]] = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h,), (3 * h, h), (h, h), (h,), (2 * ffn, h), (h, ffn)]
    return [*shapes, (h,), (vocab, h)]


def memory_layout() -> list[dict]:
    params = [torch.empty(s, device="meta", dtype=torch.bfloat16) for s in llama7b_shapes()]
    psi = sum(p.numel() for p in params)
    rows = []
    for dp in (1, 2, 4, 8, 64):
        pim = ParamIndexMap.build(
            params, dp_size=dp, pad_for_dp=True, grad_dtype=lambda i, p: torch.float32
        )
        shard = max(
            sum(pc.numel for pc in layout.shard_pieces(r))
            for layout in pim.buffers.values()
            for r in range(dp)
        )
        padded = sum(layout.numel for layout in pim.buffers.values())
        formula = 12 * psi / dp
        rows.append(
            {
                "dp": dp,
                "psi": psi,
                "bytes_per_rank_incl_padding": 12 * padded / dp,
                "bytes_per_rank_params_only": 12 * shard,
                "formula_12psi_over_dp": formula,
                "excess_over_formula_pct": 100 * (12 * padded / dp - formula) / formula,
                "num_buckets": sum(len(b.buckets) for b in pim.buffers.values()),
            }
        )
    return rows


KINDS = ("comm_only", "compute_only", "serial", "overlap")


@dataclass(frozen=True)
class SpeedCase:
    """Model and schedule of one speed measurement (b or c)."""

    width: int
    layers: int
    batch: int
    bucket: int
    iters: int
    rounds: int
    dtype: str  # "float32" | "bfloat16"

    @property
    def params(self) -> int:
        return self.layers * (self.width * self.width + self.width)


class Clock:
    """Per-iteration wall time: ``perf_counter`` on CPU, CUDA events on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive pairs of marks (start, end, start, end, ...)."""
        pairs = zip(self.marks[::2], self.marks[1::2])
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


def _build(case: SpeedCase, pg: Any, device: torch.device, overlap: bool):
    model = mlp(case.width, case.layers, getattr(torch, case.dtype)).to(device)
    cfg = DDPConfig(
        use_distributed_optimizer=True, bucket_size=case.bucket, overlap_grad_reduce=overlap
    )
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    opt = DistributedOptimizer(
        ddp,
        lambda g: torch.optim.AdamW(g, lr=1e-5),
        config=OptimizerConfig(overlap_param_gather=overlap),
        process_groups=pg,
    )
    return ddp, opt


def _iteration(kind: str, runs: dict, x: torch.Tensor) -> None:
    ddp, opt = runs["overlap" if kind == "overlap" else "serial"]
    if kind == "comm_only":  # the serial step's collectives, on the same buckets
        ddp.zero_grad_buffer()
        ddp.finish_grad_sync()
        ddp.start_param_sync(overlap=False)
        return
    opt.zero_grad()
    ddp(x).float().square().mean().backward()
    if kind == "compute_only":  # the step's local work without any collective
        opt.local_grad_stats().cpu()
        opt.step_local()
    else:
        opt.step()


def _speed_rank(case: SpeedCase, device_type: str, pg: Any = None) -> dict[str, list[list[float]]]:
    """On one rank: ``rounds`` x every kind, ``iters`` timed iterations each after one warm-up;
    returns ``{kind: [[seconds per iteration] per round]}``."""
    if pg is None:
        pg = init_process_groups(ParallelConfig())
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    runs = {"serial": _build(case, pg, device, False), "overlap": _build(case, pg, device, True)}
    gen = torch.Generator().manual_seed(pg.rank("dp"))
    x = torch.randn(case.batch, case.width, generator=gen).to(device, getattr(torch, case.dtype))
    out: dict[str, list[list[float]]] = {k: [] for k in KINDS}
    for r in range(case.rounds):
        for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
            clock = Clock(device)
            _iteration(kind, runs, x)  # warm-up (and, overlapped, gathers left pending)
            for _ in range(case.iters):
                clock.mark()
                _iteration(kind, runs, x)
                clock.mark()
            runs["overlap"][0].finish_param_sync()
            out[kind].append(clock.intervals())
    return out


def summarise(per_rank: list[dict[str, list[list[float]]]], case: SpeedCase, dp: int) -> dict:
    """Slowest rank per iteration, median per round, median over rounds, ratios."""
    rounds: dict[str, list[float]] = {}
    for kind in KINDS:
        rounds[kind] = [
            statistics.median(max(ts) for ts in zip(*(rank[kind][r] for rank in per_rank)))
            for r in range(case.rounds)
        ]
    median = {k: statistics.median(v) for k, v in rounds.items()}
    comm = median["comm_only"]
    return {
        "dp": dp,
        **asdict(case),
        "params": case.params,
        "round_medians_s": rounds,
        "median_s": median,
        "overlap_over_serial": median["overlap"] / median["serial"],
        "overlap_over_serial_per_round": [
            o / s for o, s in zip(rounds["overlap"], rounds["serial"])
        ],
        "hidden_fraction": (median["serial"] - median["overlap"]) / comm if comm > 0 else None,
        "serial_minus_compute_over_comm": (median["serial"] - median["compute_only"]) / comm
        if comm > 0
        else None,
    }


def speed_cpu(case: SpeedCase, dp: int = 4) -> dict:
    per_rank = run_on_ranks(_speed_rank, dp, args=(case, "cpu"), timeout=3600)
    return summarise(per_rank, case, dp)


def _spawned_rank(rank: int, world: int, store_path: str, device_type: str, case, out_dir: str):
    """One process of a spawned run: its own device, the rendezvous, the measurement."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    pg = init_process_groups(
        ParallelConfig(),
        backend="nccl" if device_type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
    )
    try:
        result = _speed_rank(case, device_type, pg)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_spawned(case: SpeedCase, device_type: str, world: int) -> list[dict]:
    """Spawn ``world`` processes (one per CUDA device for ``cuda``) and collect their times."""
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        torch_mp.spawn(
            _spawned_rank, args=(world, store, device_type, case, tmp), nprocs=world, join=True
        )
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def gpu_unavailable_reason() -> str | None:
    """Why part (c) cannot run here (None when it can), found at run time."""
    if not torch.cuda.is_available():
        return "not run: no CUDA device present (torch.cuda.is_available() is False)"
    n = torch.cuda.device_count()
    if n < 2:
        return f"not run: a data-parallel group needs >= 2 CUDA devices; found {n}"
    return None


def speed_gpu(case: SpeedCase) -> dict:
    world = torch.cuda.device_count()
    result = summarise(run_spawned(case, "cuda", world), case, world)
    version = torch.cuda.nccl.version()
    frac = result["hidden_fraction"]
    result.update(
        device=torch.cuda.get_device_name(0),
        nccl=".".join(map(str, version)) if isinstance(version, tuple) else str(version),
        goal_hidden_fraction=0.8,
        goal_met=None if frac is None else frac >= 0.8,
    )
    return result


def speed_table(t: dict) -> list[str]:
    m = t["median_s"]
    frac = t["hidden_fraction"]
    hidden = "n/a (comm-only not measurable)" if frac is None else f"{100 * frac:.0f} %"
    return [
        "| comm-only s | compute-only s | serial s | overlapped s | overlapped/serial | hidden |",
        "|---|---|---|---|---|---|",
        f"| {m['comm_only']:.4f} | {m['compute_only']:.4f} | {m['serial']:.4f} "
        f"| {m['overlap']:.4f} | {t['overlap_over_serial']:.3f} | {hidden} |",
        "",
        "overlapped/serial per round: "
        + ", ".join(f"{r:.3f}" for r in t["overlap_over_serial_per_round"])
        + " (headline: ratio of the medians over rounds).",
        f"(serial - compute-only) / comm-only = {t['serial_minus_compute_over_comm']:.2f}"
        if t["serial_minus_compute_over_comm"] is not None
        else "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: parts (a) and (b); cuda: part (c) only; auto: (a), (b) and (c) when possible",
    )
    ap.add_argument("--mem-width", type=int, default=500)
    ap.add_argument("--mem-layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu-width", type=int, default=4096)
    ap.add_argument("--gpu-layers", type=int, default=16)
    ap.add_argument("--gpu-batch", type=int, default=8192)
    ap.add_argument("--gpu-bucket", type=int, default=40_000_000)
    ap.add_argument("--gpu-iters", type=int, default=10)
    ap.add_argument("--gpu-rounds", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    gpu_reason = gpu_unavailable_reason()
    if args.device == "cuda" and gpu_reason is not None:
        raise SystemExit(f"--device cuda: {gpu_reason.removeprefix('not run: ')}")
    if args.device == "cpu" and gpu_reason is None:
        gpu_reason = "not run: --device cpu"
    cpu_case = SpeedCase(
        args.width, args.layers, args.batch, args.bucket, args.iters, args.rounds, "float32"
    )
    gpu_case = SpeedCase(
        args.gpu_width,
        args.gpu_layers,
        args.gpu_batch,
        args.gpu_bucket,
        args.gpu_iters,
        args.gpu_rounds,
        "bfloat16",
    )
    measured = layout = timing = None
    try:
        if args.device != "cuda":
            measured = memory_measured(args.mem_width, args.mem_layers)
            layout = memory_layout()
            timing = speed_cpu(cpu_case)
    finally:
        shutdown_pool()
    gpu = speed_gpu(gpu_case) if gpu_reason is None else {"run": False, "reason": gpu_reason}
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "torch": torch.__version__,
        "memory_measured_bf16_adamw": measured,
        "memory_layout_llama2_7b": layout,
        "speed_cpu_gloo": timing,
        "gpu": gpu,
    }
    lines = ["# dist_optimizer benchmark", ""]
    if measured is not None:
        lines += ["## (a) ZeRO-1 bytes per rank (bf16 params, AdamW), measured", ""]
        lines += [
            "| DP | Ψ | max bytes/rank | 12Ψ/DP | padding bytes/rank | excess % |",
            "|---|---|---|---|---|---|",
        ]
        for r in measured:
            lines.append(
                f"| {r['dp']} | {r['psi']:,} | {r['max_bytes_per_rank']:,} "
                f"| {r['formula_12psi_over_dp']:,.0f} | {r['padding_bytes_per_rank']:,.0f} "
                f"| {r['excess_over_formula_pct']:.4f} |"
            )
        lines += ["", "## (a') same from the layout, Llama-2-7B shapes (40 M-element buckets)", ""]
        lines += [
            "| DP | Ψ | bytes/rank incl. padding | 12Ψ/DP | excess % | buckets |",
            "|---|---|---|---|---|---|",
        ]
        for r in layout:
            lines.append(
                f"| {r['dp']} | {r['psi']:,} | {r['bytes_per_rank_incl_padding']:,.0f} "
                f"| {r['formula_12psi_over_dp']:,.0f} | {r['excess_over_formula_pct']:.5f} "
                f"| {r['num_buckets']} |"
            )
    if timing is not None:
        t = timing
        lines += [
            "",
            f"## (b) step time at DP={t['dp']}, CPU gloo, {t['params']:,}-param fp32 MLP, "
            f"batch {t['batch']}, bucket {t['bucket']:,}",
            "",
            *speed_table(t),
            "",
            "4 ranks share 2 cores here: a rank waiting in a collective frees a core for",
            "another's compute, and gloo's threads compete with compute, so the hidden fraction",
            "is an estimate on this machine (no goal on CPU).",
        ]
    lines += ["", "## (c) GPU (goal: >= 80 % of communication hidden)", ""]
    if gpu.get("run") is False:
        lines.append(gpu["reason"])
    else:
        lines += [
            f"{gpu['device']} x {gpu['dp']}, NCCL {gpu['nccl']}, {gpu['params']:,}-param bf16 "
            f"MLP, batch {gpu['batch']}, bucket {gpu['bucket']:,}; goal met: {gpu['goal_met']}",
            "",
            *speed_table(gpu),
        ]
    text = "\n".join(lines)
    print(text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "dist_optimizer.json").write_text(json.dumps(result, indent=2))
    (args.results_dir / "dist_optimizer.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
