"""Benchmark shardwork.dist_optimizer's FSDP against ZeRO-1: bytes per rank and step time.

(a) memory: bytes per rank of each buffer, with its dtype, measured on real gloo ranks at
    DP = 1, 2, 4, 8 after one AdamW step on the same MLP (``--layers`` blocks of one
    ``width × width`` linear each), against the formulas:
    - ZeRO-1 (bf16 parameters, ``DistributedOptimizer``): parameters 2Ψ (bf16, replicated),
      gradients 4Ψ (fp32 ``main_grad``, replicated), masters 4Ψ/DP, AdamW moments 8Ψ/DP;
    - FSDP (``FullyShardedDataParallel`` with bf16 compute, fp32 reduction;
      ``FSDPOptimizer``): parameters 4Ψ/DP (fp32 shards, which *are* the masters), gradients
      4Ψ/DP (fp32 shards), masters 0, moments 8Ψ/DP.
    Measured = bytes of the distinct storages behind the tensors (FSDP pads each parameter's
    rows to a multiple of DP, ZeRO-1 each bucket to a multiple of lcm(DP, 64)); padding =
    measured - formula. Transient FSDP buffers, measured too: the gathered bf16 parameters
    of the largest unit (all of them between forward and backward in the ZeRO-2-like mode),
    and the unsharded fp32 gradients held while micro-batches accumulate without a
    reduce-scatter (read from torch's FSDP state: ``FSDPParam.unsharded_accumulated_grad``),
    which ``reduce_per_micro_batch`` avoids.
(b) step time on CPU, gloo, DP = 2 and 4: FSDP (full and ZeRO-2-like) against ZeRO-1 (both
    with overlapped reduction; fp32 MLP) interleaved in rounds, slowest rank per iteration,
    median per round, median over rounds; the headline is FSDP / ZeRO-1. Ranks share 2 cores
    with gloo's threads: a ratio on this machine, no goal.
(c) the overlap of FSDP's all-gather/reduce-scatter with compute needs CUDA streams: the JSON
    says why it was not run when no GPU is present (found at run time).

Writes ``dist_optimizer_fsdp.json`` and ``.md`` to ``--results-dir`` (default
``benchmarks/results``). Usage: ``uv run python benchmarks/dist_optimizer_fsdp.py``; smoke:
``--mem-width 16 --width 32 --iters 1 --rounds 1 --results-dir /tmp/x``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    FSDPConfig,
    FSDPOptimizer,
    FullyShardedDataParallel,
)
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks, shutdown_pool

RESULTS = Path(__file__).resolve().parent / "results"
BUFFERS = ("params", "grads", "masters", "state")


class Net(nn.Module):
    def __init__(self, width: int, layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(width, width, dtype=dtype) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _storage_bytes(tensors) -> tuple[int, set[str]]:
    """Bytes of the distinct storages behind ``tensors`` (and their dtypes)."""
    seen: dict[int, int] = {}
    dtypes = set()
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        dtypes.add(str(t.dtype).removeprefix("torch."))
    return sum(seen.values()), dtypes


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _state_tensors(opt):
    return [
        v
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]


def _zero1_rank(width: int, layers: int) -> dict:
    pg = init_process_groups(ParallelConfig())
    net = Net(width, layers, torch.bfloat16)
    ddp = DistributedDataParallel(
        net, config=DDPConfig(use_distributed_optimizer=True), process_groups=pg
    )
    opt = DistributedOptimizer(ddp, lambda g: torch.optim.AdamW(g, lr=1e-3), process_groups=pg)
    ddp(torch.randn(4, width, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    buffers = list(ddp.buffers.values())
    return {
        "params": _storage_bytes(b.param_data for b in buffers),
        "grads": _storage_bytes(b.grad_data for b in buffers),
        "masters": _storage_bytes(mp.master for mp in opt.pieces if not mp.master_is_view),
        "state": _storage_bytes(_state_tensors(opt)),
    }


def _accumulated_grad_bytes(module: nn.Module) -> int:
    """Unsharded gradients FSDP holds between micro-batches (torch's FSDP state, read-only)."""
    total = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in fully_shard.state(m)._fsdp_param_groups:
                for fp in group.fsdp_params:
                    g = fp.unsharded_accumulated_grad
                    total += 0 if g is None else g.numel() * g.element_size()
    return total


def _fsdp_rank(width: int, layers: int, reshard: bool, per_micro: bool) -> dict:
    pg = init_process_groups(ParallelConfig())
    net = Net(width, layers, torch.float32)
    config = FSDPConfig(
        reshard_after_forward=reshard,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        reduce_per_micro_batch=per_micro,
    )
    model = FullyShardedDataParallel(net, blocks=list(net.blocks), config=config, process_groups=pg)
    opt = FSDPOptimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-3), process_groups=pg)
    x = torch.randn(4, width)
    units: list[int] = []
    for block in net.blocks:  # FSDP's own pre-forward hook (registered first) has gathered it
        block.register_forward_pre_hook(
            lambda m, _: units.append(sum(p.numel() * p.element_size() for p in m.parameters()))
        )
    with model.no_sync():  # micro-batch 1 of 2
        out = model(x)
        # between forward and backward: the parameters still gathered
        gathered = sum(
            p.numel() * p.element_size() for p in net.parameters() if not isinstance(p, DTensor)
        )
        out.float().square().mean().backward()
    held = _accumulated_grad_bytes(net)
    model(x).float().square().mean().backward()
    opt.step()
    return {
        "params": _storage_bytes(_local(p) for p in model.params),
        "grads": _storage_bytes(_local(p.grad) for p in model.params),
        "masters": _storage_bytes(rm.master for rm in opt.pieces if not rm.master_is_view),
        "state": _storage_bytes(_state_tensors(opt)),
        "gathered_between_fwd_bwd": gathered,
        "largest_unit_bf16": max(units),
        "accumulated_unsharded_grads": held,
    }


FORMULAS = {
    "zero1": {"params": (2, False), "grads": (4, False), "masters": (4, True), "state": (8, True)},
    "fsdp": {"params": (4, True), "grads": (4, True), "masters": (0, True), "state": (8, True)},
}
"""Bytes per parameter of each buffer and whether it is divided by DP."""


def memory(width: int, layers: int) -> list[dict]:
    psi = layers * (width * width + width)
    rows = []
    for dp in (1, 2, 4, 8):
        runs = {
            "zero1": run_on_ranks(_zero1_rank, dp, args=(width, layers), timeout=900),
            "fsdp": run_on_ranks(_fsdp_rank, dp, args=(width, layers, True, False), timeout=900),
            "fsdp-zero2": run_on_ranks(
                _fsdp_rank, dp, args=(width, layers, False, False), timeout=900
            ),
            "fsdp-per-micro": run_on_ranks(
                _fsdp_rank, dp, args=(width, layers, True, True), timeout=900
            ),
        }
        for kind, per_rank in runs.items():
            row = {"dp": dp, "kind": kind, "psi": psi}
            formula = FORMULAS["zero1" if kind == "zero1" else "fsdp"]
            for name in BUFFERS:
                worst = max(r[name][0] for r in per_rank)
                per_param, divided = formula[name]
                expect = per_param * psi / (dp if divided else 1)
                row[name] = {
                    "bytes": worst,
                    "dtypes": sorted(set().union(*(set(r[name][1]) for r in per_rank))),
                    "formula": expect,
                    "padding": worst - expect,
                }
            row["total_bytes"] = sum(row[n]["bytes"] for n in BUFFERS)
            for extra in (
                "gathered_between_fwd_bwd",
                "largest_unit_bf16",
                "accumulated_unsharded_grads",
            ):
                if extra in per_rank[0]:
                    row[extra] = max(r[extra] for r in per_rank)
            rows.append(row)
    return rows


def _speed_rank(width: int, layers: int, batch: int, iters: int, rounds: int) -> dict:
    pg = init_process_groups(ParallelConfig())
    gen = torch.Generator().manual_seed(pg.rank("dp"))
    x = torch.randn(batch, width, generator=gen)
    runs = {}
    net = Net(width, layers, torch.float32)
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=1_000_000, average_gradients=False)
    ddp = DistributedDataParallel(net, config=cfg, process_groups=pg)
    runs["zero1"] = (
        ddp,
        DistributedOptimizer(ddp, lambda g: torch.optim.AdamW(g, lr=1e-5), process_groups=pg),
    )
    for kind, reshard in (("fsdp", True), ("fsdp-zero2", False)):
        net = Net(width, layers, torch.float32)
        model = FullyShardedDataParallel(
            net,
            blocks=list(net.blocks),
            config=FSDPConfig(reshard_after_forward=reshard),
            process_groups=pg,
        )
        runs[kind] = (
            model,
            FSDPOptimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-5), process_groups=pg),
        )
    kinds = list(runs)
    out: dict[str, list[list[float]]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            model, opt = runs[kind]
            times = []
            for i in range(iters + 1):  # the first is a warm-up
                start = time.perf_counter()
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                opt.finish_param_sync()
                if i:
                    times.append(time.perf_counter() - start)
            out[kind].append(times)
    return out


def speed(width: int, layers: int, batch: int, iters: int, rounds: int) -> list[dict]:
    rows = []
    for dp in (2, 4):
        per_rank = run_on_ranks(
            _speed_rank, dp, args=(width, layers, batch, iters, rounds), timeout=3600
        )
        medians = {}
        for kind in per_rank[0]:
            by_round = [
                statistics.median(max(ts) for ts in zip(*(rank[kind][r] for rank in per_rank)))
                for r in range(rounds)
            ]
            medians[kind] = statistics.median(by_round)
        rows.append(
            {
                "dp": dp,
                "params": layers * (width * width + width),
                "batch": batch,
                "median_s": medians,
                "fsdp_over_zero1": medians["fsdp"] / medians["zero1"],
                "zero2_over_zero1": medians["fsdp-zero2"] / medians["zero1"],
            }
        )
    return rows


def gpu_reason() -> str:
    if not torch.cuda.is_available():
        return "not run: no CUDA device present (torch.cuda.is_available() is False)"
    return "not run: the GPU overlap measurement of FSDP is not written yet (this benchmark is CPU-only)"


def _memory_lines(rows: list[dict]) -> list[str]:
    lines = [
        "| DP | kind | params B (dtype) | grads B (dtype) | masters B | optimizer state B | total B | formula total B | padding B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cell = {n: f"{r[n]['bytes']:,} ({'/'.join(r[n]['dtypes']) or '-'})" for n in BUFFERS}
        formula = sum(r[n]["formula"] for n in BUFFERS)
        lines.append(
            f"| {r['dp']} | {r['kind']} | {cell['params']} | {cell['grads']} | {cell['masters']} "
            f"| {cell['state']} | {r['total_bytes']:,} | {formula:,.0f} | {r['total_bytes'] - formula:,.0f} |"
        )
    lines += [
        "",
        "| DP | kind | gathered between forward and backward B | largest unit gathered (bf16) B | unsharded grads held under no_sync B |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] != "zero1":
            lines.append(
                f"| {r['dp']} | {r['kind']} | {r['gathered_between_fwd_bwd']:,} "
                f"| {r['largest_unit_bf16']:,} | {r['accumulated_unsharded_grads']:,} |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mem-width", type=int, default=500)
    ap.add_argument("--mem-layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    try:
        mem = memory(args.mem_width, args.mem_layers)
        timing = speed(args.width, args.layers, args.batch, args.iters, args.rounds)
    finally:
        shutdown_pool()
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "torch": torch.__version__,
        "memory": mem,
        "speed_cpu_gloo": timing,
        "gpu": {"run": False, "reason": gpu_reason()},
    }
    psi = mem[0]["psi"]
    lines = [
        "# dist_optimizer FSDP benchmark",
        "",
        f"## (a) bytes per rank after one AdamW step, Ψ = {psi:,} ({args.mem_layers} linears of {args.mem_width}²+{args.mem_width})",
        "",
        "ZeRO-1: bf16 parameters, fp32 gradients and masters. FSDP: fp32 shards (the masters), bf16",
        "compute, fp32 reduction. Formula per rank: ZeRO-1 2Ψ + 4Ψ + 12Ψ/DP; FSDP 16Ψ/DP.",
        "",
        *_memory_lines(mem),
        "",
        f"## (b) step time, CPU gloo, fp32 MLP of {timing[0]['params']:,} parameters, batch {args.batch}",
        "",
        "| DP | ZeRO-1 s | FSDP s | FSDP ZeRO-2-like s | FSDP / ZeRO-1 | ZeRO-2-like / ZeRO-1 |",
        "|---|---|---|---|---|---|",
    ]
    for t in timing:
        m = t["median_s"]
        lines.append(
            f"| {t['dp']} | {m['zero1']:.4f} | {m['fsdp']:.4f} | {m['fsdp-zero2']:.4f} "
            f"| {t['fsdp_over_zero1']:.3f} | {t['zero2_over_zero1']:.3f} |"
        )
    lines += ["", "Ranks share 2 cores with gloo's threads: a ratio on this machine, no goal.", ""]
    lines += ["## (c) GPU overlap", "", result["gpu"]["reason"]]
    text = "\n".join(lines)
    print(text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "dist_optimizer_fsdp.json").write_text(json.dumps(result, indent=2))
    (args.results_dir / "dist_optimizer_fsdp.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
