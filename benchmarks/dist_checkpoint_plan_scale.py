"""Checkpoint planning on the first rank at 1,024-8,192 simulated ranks (issue 20).

`save` gathers each rank's summary (`plan.summarize`) on the first rank, which runs
`plan.build_rank_plans` once for all ranks and scatters each rank its assignment, and builds
DCP's metadata from every rank's write items (`PlannedSavePlanner.create_global_plan`) and the
``shardwork.json`` record (catalogue, bytes per rank, group ranks). This times those three on
one process for simulated worlds, and counts the bytes each rank receives for planning under
this scheme against the all-gather it replaced (every rank receiving every summary).

The state is a Llama-like 70B model (80 layers, hidden 8192, ffn 28672, 64 heads, 8 kv heads,
vocab 128256) at TP8 x PP8, with DP = W / 64 data-parallel replicas:

- ``model``: the weights; TP-split weights carry ``replica_id = dp``, the TP-replicated norms
  ``replica_id = dp * 8 + tp``, so plan dedup must pick one writer among W / 64 holders. The
  number of distinct shards stays fixed while ranks grow.
- ``model+optim``: plus ZeRO-1 optimizer state (fp32 main params, exp_avg, exp_avg_sq): each
  (tp, pp) rank's parameters concatenated and split evenly over its DP ranks, each rank's
  piece of a parameter a ``flattened_range`` (split by the package into up to 3 rectangles),
  so shards grow with W.

Each rank's summary is the real one, `summarize(collect_local(state))` of `ShardedTensor`
objects over ``meta`` tensors (no memory); a DP replica's model part is its dp = 0 peer's with
the replica ids changed (checked equal to the full summary). Write items (DCP ``WriteItem``, one per distinct
rectangle, as `save` makes them) are given to the rectangle's primary holder; which holder
writes does not change the metadata. Not timed: building the states and summaries (every
rank's own work). Timed on rank 0: plan, DCP metadata, ``shardwork.json`` text (median of
``--repeats``); measured: pickled bytes of the all-gathered summaries and of DCP's metadata,
``shardwork.json`` bytes, tracemalloc peak of the three steps. Fits log-log exponents of the
time against ranks and against shards.

Prints a table and writes ``benchmarks/results/dist_checkpoint_plan_scale.json`` and ``.md``.
Usage: ``uv run python benchmarks/dist_checkpoint_plan_scale.py [--worlds 1024 2048 4096 8192]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pickle
import statistics
import time
import tracemalloc
from pathlib import Path

import torch
from machine import machine_record
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.dist_checkpoint.plan import (
    COMMON_KEY,
    build_rank_plans,
    collect_local,
    summarize,
)
from shardwork.dist_checkpoint.planners import PlannedSavePlanner

RESULTS = Path(__file__).resolve().parent / "results"
WORLDS = (1024, 2048, 4096, 8192)
TP, PP = 8, 8
LLAMA_70B = {
    "layers": 80,
    "hidden": 8192,
    "ffn": 28672,
    "heads": 64,
    "kv_heads": 8,
    "vocab": 128256,
}
OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def stage_params(cfg: dict, stage: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(key, global shape, TP-split axis or None) of the parameters of pipeline ``stage``."""
    h, head_dim = cfg["hidden"], cfg["hidden"] // cfg["heads"]
    qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * head_dim
    per_stage = cfg["layers"] // PP
    params = []
    if stage == 0:
        params.append(("embedding.word_embeddings.weight", (cfg["vocab"], h), 0))
    for layer in range(stage * per_stage, (stage + 1) * per_stage):
        p = f"decoder.layers.{layer}"
        params += [
            (f"{p}.input_layernorm.weight", (h,), None),
            (f"{p}.self_attention.linear_qkv.weight", (qkv, h), 0),
            (f"{p}.self_attention.linear_proj.weight", (h, h), 1),
            (f"{p}.pre_mlp_layernorm.weight", (h,), None),
            (f"{p}.mlp.linear_fc1.weight", (2 * cfg["ffn"], h), 0),
            (f"{p}.mlp.linear_fc2.weight", (h, cfg["ffn"]), 1),
        ]
    if stage == PP - 1:
        params += [
            ("decoder.final_layernorm.weight", (h,), None),
            ("output_layer.weight", (cfg["vocab"], h), 0),
        ]
    return params


def _local(shape: tuple[int, ...], axis: int | None, tp: int) -> tuple[tuple, tuple]:
    """(local shape, global offset) of TP rank ``tp``'s piece."""
    if axis is None:
        return shape, (0,) * len(shape)
    local = tuple(s // TP if d == axis else s for d, s in enumerate(shape))
    offset = tuple(local[d] * tp if d == axis else 0 for d in range(len(shape)))
    return local, offset


def model_state(params, tp: int, dp: int) -> dict:
    """The weights of rank (tp, pp, dp), on meta tensors."""
    model = {}
    for key, shape, axis in params:
        local, offset = _local(shape, axis, tp)
        replica = dp if axis is not None else dp * TP + tp
        data = torch.empty(local, dtype=torch.bfloat16, device="meta")
        model[key] = ShardedTensor(key, data, shape, offset, replica_id=replica)
    return model


def optimizer_state(params, tp: int, dp: int, dp_size: int) -> dict:
    """ZeRO-1 state of rank (tp, pp, dp): its 1/dp_size of the (tp, pp) flat buffer."""
    sizes = [math.prod(_local(shape, axis, tp)[0]) for _, shape, axis in params]
    total = sum(sizes)
    lo, hi = total * dp // dp_size, total * (dp + 1) // dp_size
    optim: dict = {name: {} for name in OPTIMIZER_STATES}
    start = 0
    for (key, shape, axis), numel in zip(params, sizes):
        a, b = max(lo, start) - start, min(hi, start + numel) - start
        start += numel
        if a >= b:
            continue
        local, offset = _local(shape, axis, tp)
        flat = torch.empty(b - a, dtype=torch.float32, device="meta")
        for name in OPTIMIZER_STATES:
            optim[name][key] = ShardedTensor.from_flattened(
                f"optimizer.{name}.{key}",
                flat,
                local_shape=local,
                global_shape=shape,
                global_offset=offset,
                flattened_range=(a, b),
                replica_id=0 if axis is not None else tp,
            )
    return optim


def rank_state(params, tp: int, dp: int, dp_size: int, optimizer: bool) -> dict:
    """The sharded state dict of rank (tp, pp, dp), on meta tensors."""
    state: dict = {"model": model_state(params, tp, dp)}
    if optimizer:
        state["optimizer"] = optimizer_state(params, tp, dp, dp_size)
        state["iteration"] = 1000
    return state


def _with_replica(entries: list, replica_of) -> list:
    """Summary tensor entries with each replica id replaced by ``replica_of(key, old id)``."""
    return [(k, d, g, replica_of(k, r), p, b) for k, d, g, r, p, b in entries]


def summaries_for(world: int, optimizer: bool) -> list[dict]:
    """Every rank's summary; rank = tp + TP * (pp + PP * dp) (TP fastest).

    Every DP replica holds the same model rectangles as its dp = 0 peer, only the replica id
    differs: the model part is summarised once per (tp, pp) and copied with the replica ids
    `rank_state` would give (checked against the full summary on the first replica of each
    size); the optimizer part, different on every rank, is summarised per rank.
    """
    dp_size = world // (TP * PP)
    params = [stage_params(LLAMA_70B, pp) for pp in range(PP)]
    split = [{key: axis is not None for key, _, axis in stage} for stage in params]
    model = {}
    for pp in range(PP):
        for tp in range(TP):
            model[tp, pp] = summarize(collect_local(rank_state(params[pp], tp, 0, 1, False)))
    out = []
    for rank in range(world):
        tp, pp, dp = rank % TP, rank // TP % PP, rank // (TP * PP)
        tensors = _with_replica(
            model[tp, pp]["tensors"],
            lambda key, _, s=split[pp], tp=tp, dp=dp: dp if s[key] else dp * TP + tp,
        )
        summary = {"tensors": tensors, "objects": [], "plain": []}
        if optimizer:
            state = {"optimizer": optimizer_state(params[pp], tp, dp, dp_size), "iteration": 1000}
            extra = summarize(collect_local(state))
            summary["tensors"] = tensors + extra["tensors"]
            summary["plain"] = extra["plain"]
        if dp == min(1, dp_size - 1) and pp == 0 and tp == 1:
            full = summarize(collect_local(rank_state(params[pp], tp, dp, dp_size, optimizer)))
            assert full == summary, f"derived summary of rank {rank} differs from the full one"
        out.append(summary)
    return out


def save_plans(summaries: list[dict]) -> list[SavePlan]:
    """Each rank's DCP write items: the distinct rectangles it holds as primary."""
    plans = []
    for rank, summary in enumerate(summaries):
        items = []
        for key, dtype, gshape, replica_id, _, boxes in summary["tensors"]:
            if replica_id != 0:
                continue
            for offsets, sizes in boxes:
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(
                                offsets=torch.Size(offsets), sizes=torch.Size(sizes)
                            ),
                            properties=TensorProperties(dtype=getattr(torch, dtype)),
                            size=torch.Size(gshape),
                        ),
                    )
                )
        if rank == 0:
            items.append(WriteItem(index=MetadataIndex(COMMON_KEY), type=WriteItemType.BYTE_IO))
        plans.append(SavePlan(items))
    return plans


def rank0_steps(summaries: list[dict], plans: list[SavePlan]) -> dict:
    """The first rank's planning work; returns each step's CPU seconds and outputs.

    CPU time of this process (the steps are single-threaded Python): on a shared machine
    the wall time also counts the time other processes hold the cores; both are recorded.
    """
    clocks = [(time.process_time(), time.perf_counter())]
    plan, shares = build_rank_plans(summaries)
    clocks.append((time.process_time(), time.perf_counter()))
    _, metadata = PlannedSavePlanner([], {}).create_global_plan(plans)
    clocks.append((time.process_time(), time.perf_counter()))
    info = {
        "world_size": len(summaries),
        "group_ranks": list(range(len(summaries))),
        "keys": plan.catalogue,
        "plain_paths": plan.plain_paths,
        "bytes_per_rank": plan.bytes_per_rank,
    }
    text = json.dumps(info, indent=1, sort_keys=True)
    clocks.append((time.process_time(), time.perf_counter()))
    cpu = [b[0] - a[0] for a, b in itertools.pairwise(clocks)]
    return {
        "plan_s": cpu[0],
        "dcp_metadata_s": cpu[1],
        "info_json_s": cpu[2],
        "wall_s": clocks[-1][1] - clocks[0][1],
        "plan": plan,
        "shares": shares,
        "metadata": metadata,
        "info_text": text,
    }


def measure(world: int, optimizer: bool, repeats: int) -> dict:
    """One world size and scenario: times (median), bytes and peak memory on rank 0."""
    start = time.perf_counter()
    summaries = summaries_for(world, optimizer)
    plans = save_plans(summaries)
    build_s = time.perf_counter() - start
    runs = [rank0_steps(summaries, plans) for _ in range(repeats)]
    last = runs[-1]
    tracemalloc.start()
    rank0_steps(summaries, plans)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    pieces = sum(len(boxes) for s in summaries for *_, boxes in s["tensors"])
    shards = sum(c["num_chunks"] for c in last["plan"].catalogue.values())
    med = {
        k: statistics.median(r[k] for r in runs)
        for k in ("plan_s", "dcp_metadata_s", "info_json_s")
    }
    wall_s = statistics.median(r["wall_s"] for r in runs)
    received = planning_bytes(summaries, last["shares"])
    return {
        "world": world,
        "scenario": "model+optim" if optimizer else "model",
        "dp": world // (TP * PP),
        "keys": len(last["plan"].catalogue),
        "pieces_all_ranks": pieces,
        "shards": shards,
        "total_bytes": sum(last["plan"].bytes_per_rank),
        **med,
        "rank0_total_s": sum(med.values()),
        "rank0_wall_s": wall_s,
        "summaries_pickled_bytes": len(pickle.dumps(summaries)),
        **received,
        "dcp_metadata_pickled_bytes": len(pickle.dumps(last["metadata"])),
        "shardwork_json_bytes": len(last["info_text"].encode()),
        "peak_mib": peak / 2**20,
        "build_states_s": build_s,
    }


def planning_bytes(summaries: list[dict], shares: list) -> dict:
    """Pickled bytes each rank receives for planning, old scheme against new.

    Every collective pickles each rank's object on its own, so a rank's summary counts once
    per receiver. Old: the all-gather hands every rank every summary. New: the gather hands
    the first rank every summary; the scatter hands each other rank its `RankAssignment`
    (gloo's scatter pads each message to the largest, so the wire carries ``max`` per rank).
    """
    gathered = sum(len(pickle.dumps(s)) for s in summaries)
    assignments = [len(pickle.dumps(share)) for share in shares[1:]]
    world = len(summaries)
    return {
        "old_received_per_rank_bytes": gathered,
        "old_received_job_bytes": gathered * world,
        "new_rank0_received_bytes": gathered,
        "new_other_received_max_bytes": max(assignments),
        "new_other_received_mean_bytes": statistics.fmean(assignments),
        "new_received_job_bytes": gathered + sum(assignments),
    }


def exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fits(rows: list[dict]) -> dict:
    """Per scenario, log-log exponents of CPU time and metadata bytes against ranks, pieces
    and shards (None where the x values do not vary)."""
    out = {}
    for scenario in ("model", "model+optim"):
        sel = [r for r in rows if r["scenario"] == scenario]
        if len(sel) < 2:
            continue
        ranks = [r["world"] for r in sel]
        out[scenario] = {
            "time_vs_ranks": exponent(ranks, [r["rank0_total_s"] for r in sel]),
            "plan_time_vs_pieces": exponent(
                [r["pieces_all_ranks"] for r in sel], [r["plan_s"] for r in sel]
            ),
            "time_vs_shards": exponent(
                [r["shards"] for r in sel], [r["rank0_total_s"] for r in sel]
            )
            if len({r["shards"] for r in sel}) > 1
            else None,
            "metadata_bytes_vs_shards": exponent(
                [r["shards"] for r in sel], [r["dcp_metadata_pickled_bytes"] for r in sel]
            )
            if len({r["shards"] for r in sel}) > 1
            else None,
            "metadata_bytes_vs_ranks": exponent(
                ranks, [r["dcp_metadata_pickled_bytes"] for r in sel]
            ),
        }
    return out


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        f"# Checkpoint planning on rank 0 (70B Llama-like, TP8 x PP8 x DP; median of "
        f"{record['repeats']}; {m['cpu']}, load average {m['load_avg'][0]:.1f} on {m['cpus']} CPUs)",
        "",
        "Times are CPU seconds of the planning process (single-threaded Python); the wall "
        "column adds the time other processes held the shared cores.",
        "",
        "| scenario | ranks | DP | pieces (all ranks) | shards | plan (s) | DCP metadata (s) | "
        "shardwork.json (s) | rank-0 total (s) | wall (s) | all-gathered summaries (MiB) | "
        ".metadata (MiB) | shardwork.json (MiB) | peak (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bytes_lines = [
        "",
        "Bytes received for planning (pickled, each rank's object on its own as the "
        "collectives send it). Old: all-gather, every rank receives every summary. New: "
        "rank 0 gathers every summary, each other rank receives its assignment (scatter).",
        "",
        "| scenario | ranks | old, per rank (MiB) | old, whole job (GiB) | new, rank 0 (MiB) | "
        "new, other rank max (KiB) | new, other rank mean (KiB) | new, whole job (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for r in record["rows"]:
        lines.append(
            f"| {r['scenario']} | {r['world']:,} | {r['dp']} | {r['pieces_all_ranks']:,} | "
            f"{r['shards']:,} | {r['plan_s']:.3f} | {r['dcp_metadata_s']:.3f} | "
            f"{r['info_json_s']:.3f} | {r['rank0_total_s']:.3f} | {r['rank0_wall_s']:.3f} | "
            f"{r['summaries_pickled_bytes'] / mib:.2f} | "
            f"{r['dcp_metadata_pickled_bytes'] / mib:.2f} | "
            f"{r['shardwork_json_bytes'] / mib:.2f} | {r['peak_mib']:.1f} |"
        )
        bytes_lines.append(
            f"| {r['scenario']} | {r['world']:,} | {r['old_received_per_rank_bytes'] / mib:.2f} | "
            f"{r['old_received_job_bytes'] / 2**30:.1f} | "
            f"{r['new_rank0_received_bytes'] / mib:.2f} | "
            f"{r['new_other_received_max_bytes'] / 2**10:.1f} | "
            f"{r['new_other_received_mean_bytes'] / 2**10:.1f} | "
            f"{r['new_received_job_bytes'] / mib:.1f} |"
        )
    lines += bytes_lines
    lines += ["", "Log-log exponents (1 = linear, 2 = quadratic):", ""]
    for scenario, f in record["fits"].items():
        parts = [f"{k} {v:.2f}" for k, v in f.items() if v is not None]
        lines.append(f"- {scenario}: " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "dist_checkpoint_plan_scale"))
    args = parser.parse_args()
    bad = [w for w in args.worlds if w < TP * PP or w % (TP * PP)]
    if bad:
        parser.error(f"--worlds {bad}: each must be a positive multiple of TP*PP = {TP * PP}")
    rows = []
    for optimizer in (False, True):
        for world in args.worlds:
            rows.append(measure(world, optimizer, args.repeats))
            r = rows[-1]
            print(f"{r['scenario']} {world:,}: rank-0 {r['rank0_total_s']:.3f} s", flush=True)
    record = {
        "machine": machine_record(),
        "torch": torch.__version__,
        "model": LLAMA_70B,
        "tp": TP,
        "pp": PP,
        "repeats": args.repeats,
        "rows": rows,
        "fits": fits(rows),
    }
    text = markdown(record)
    print(text)
    Path(args.out + ".json").write_text(json.dumps(record, indent=1))
    Path(args.out + ".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
