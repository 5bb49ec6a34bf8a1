"""`RankLayout.build` at cluster sizes: time and memory against the world size.

Every rank of a job builds the whole layout (all 15 group kinds) before it creates its
process groups, so at 100k ranks this runs 100k times in parallel at start-up. The layout
is tp8 pp16 cp2 ep64 etp1 (dp and edp fill the rest), at world sizes from 1,024 to 100,352.
Beside it, in the same process, the per-rank Python enumeration it replaced (itertools
offsets, the first version of `layout._masked_groups`) builds the same groups, so the ratio
is measured, and the two results are compared for equality.

It then counts what `init_process_groups` asks of torch at those sizes, with
``torch.distributed`` replaced by a recorder (no processes): the ``new_group`` calls one rank
makes (ranks 0, W/2 and W-1) and the ranks in each call's creation barrier, against what
creating every group on every rank (the previous scheme, and Megatron-Core's default) costs:
one call per group of the layout, each with a world-wide barrier.

Prints a table and writes ``benchmarks/results/parallel_state_scale.json`` and ``.md``.
Usage: ``uv run python benchmarks/parallel_state_scale.py [--repeats 5]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
import tracemalloc
from pathlib import Path

import torch.distributed as dist
from machine import cpu_model, machine_record

from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.layout import DENSE_GROUPS, EXPERT_GROUPS, RankLayout

RESULTS = Path(__file__).resolve().parent / "results"
WORLDS = (1024, 4096, 16384, 100352)


def python_groups(sizes: dict[str, int], order: list[str], axes: tuple[str, ...]):
    """The replaced enumeration: every member's rank summed from strides in Python."""
    strides, stride = {}, 1
    for name in order:
        strides[name] = stride
        stride *= sizes[name]
    inside = [n for n in order if n in axes]
    outside = [n for n in order if n not in axes]

    def offsets(names):
        ranges = [range(sizes[n]) for n in reversed(names)]
        return [
            sum(i * strides[n] for i, n in zip(idx, reversed(names)))
            for idx in itertools.product(*ranges)
        ]

    return [[base + off for off in offsets(inside)] for base in offsets(outside)]


def python_layout(config: ParallelConfig, world: int) -> dict[str, list[list[int]]]:
    c = config.resolve(world)
    order = c.full_order
    dense = {"tp": c.tp, "cp": c.cp, "ep": 1, "dp": c.dp, "pp": c.pp}
    expert = {"tp": c.etp, "cp": 1, "ep": c.ep, "dp": c.edp, "pp": c.pp}
    groups = {n: python_groups(dense, order, a) for n, a in DENSE_GROUPS.items()}
    groups |= {n: python_groups(expert, order, a) for n, a in EXPERT_GROUPS.items()}
    return groups


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_mib(fn) -> float:
    tracemalloc.start()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del result
    return peak / 2**20


class RecordingDist:
    """Stands in for the ``torch.distributed`` calls `init_process_groups` makes on a live
    world of ``world`` ranks, as rank ``rank``; records every ``new_group``."""

    NAMES = ("is_initialized", "get_rank", "get_world_size", "get_backend", "new_group")

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.calls: list[tuple[int, bool]] = []  # (barrier ranks, local synchronisation)

    def new_group(self, ranks, *, timeout=None, backend=None, use_local_synchronization=False):
        barrier = len(ranks) if use_local_synchronization else self.world
        self.calls.append((barrier, use_local_synchronization))
        return object()

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        dist.is_initialized = lambda: True
        dist.get_rank = lambda group=None: self.rank
        dist.get_world_size = lambda group=None: self.world
        dist.get_backend = lambda group=None: "gloo"
        dist.new_group = self.new_group
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(dist, name, value)


def group_creation(config: ParallelConfig, world: int) -> dict:
    """Per-rank ``new_group`` calls and barrier ranks now, and for every group on every rank."""
    per_rank = []
    for rank in sorted({0, world // 2, world - 1}):
        with RecordingDist(rank, world) as recorder:
            init_process_groups(config)
        per_rank.append(
            {
                "rank": rank,
                "new_group_calls": len(recorder.calls),
                "barrier_ranks": sum(b for b, _ in recorder.calls),
            }
        )
    layout = RankLayout.build(config, world)
    every_group = sum(len(groups) for groups in layout.groups.values())
    return {
        "per_rank": per_rank,
        "every_group_on_every_rank": {
            "new_group_calls": every_group,
            "barrier_ranks": every_group * world,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "parallel_state_scale"))
    args = parser.parse_args()
    config = ParallelConfig(tp=8, pp=16, cp=2, ep=64, etp=1)
    rows = []
    for world in WORLDS:
        built = RankLayout.build(config, world)
        reference = python_layout(config, world)
        assert all(built.groups[name] == reference[name] for name in reference), world
        new_s = median_time(lambda w=world: RankLayout.build(config, w), args.repeats)
        old_s = median_time(lambda w=world: python_layout(config, w), args.repeats)
        rows.append(
            {
                "world": world,
                "build_s": new_s,
                "python_enumeration_s": old_s,
                "speedup": old_s / new_s,
                "build_peak_mib": peak_mib(lambda w=world: RankLayout.build(config, w)),
                "group_creation": group_creation(config, world),
            }
        )
    record = {
        "machine": machine_record(),
        "layout": "tp8 pp16 cp2 ep64 etp1",
        "repeats": args.repeats,
        "rows": rows,
    }
    lines = [
        f"# RankLayout.build at scale (tp8 pp16 cp2 ep64 etp1; median of {args.repeats}; "
        f"{cpu_model()}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)",
        "",
        "| world | build (s) | per-rank Python enumeration (s) | speed-up | peak memory (MiB) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['build_s']:.3f} | {r['python_enumeration_s']:.3f} | "
            f"{r['speedup']:.1f}x | {r['build_peak_mib']:.1f} |"
        )
    lines += [
        "",
        "Group creation by one rank (`init_process_groups`, torch.distributed recorded):",
        "",
        "| world | new_group calls per rank (now) | ranks in its barriers (now) | "
        "every group on every rank: calls | barrier ranks |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        g = r["group_creation"]
        calls = sorted({p["new_group_calls"] for p in g["per_rank"]})
        barriers = sorted({p["barrier_ranks"] for p in g["per_rank"]})
        old = g["every_group_on_every_rank"]
        lines.append(
            f"| {r['world']:,} | {'/'.join(map(str, calls))} | {'/'.join(map(str, barriers))} | "
            f"{old['new_group_calls']:,} | {old['barrier_ranks']:,} |"
        )
    text = "\n".join(lines)
    print(text)
    Path(args.out + ".json").write_text(json.dumps(record, indent=1))
    Path(args.out + ".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
