"""Record `build_global_plan`'s inputs and outputs so a rewrite can prove them unchanged.

Run from the repository root (development aid; the committed fixture was written by the
`build_global_plan` of commit 3aa580a, before it was split into named phases):

    uv run python tools/dist_checkpoint_plan_fixture.py \
        packages/dist-checkpoint/tests/fixtures/global_plan.json

Valid case: 8 ranks laid out tp2 x pp2 x dp2 (seed 7, random sizes): column- and row-split
weights with DP replicas, TP-replicated norms, ZeRO flat ranges of the row-split weight cut
at random points, a zero-element tensor, one object per (pp, tp) cell and plain values. For
it the fixture records every rank's summary and every rank's plan (catalogue, the rectangles,
objects and empty keys it writes, bytes per rank, plain paths). Invalid cases (overlapping
primaries, a gap, a dtype and a shape mismatch, a duplicate object primary, more errors than
the message lists) record the exact `ValueError` text.
"""

import itertools
import json
import random
import sys
from pathlib import Path

import torch

from shardwork.dist_checkpoint import ShardedObject, ShardedTensor
from shardwork.dist_checkpoint.plan import build_global_plan, collect_local, summarize

SEED = 7
TP, PP, DP = 2, 2, 2


def _flat_cuts(rng: random.Random, numel: int, parts: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, numel), parts - 1))
    bounds = [0, *cuts, numel]
    return list(itertools.pairwise(bounds))


def rank_state(rank: int, sizes: dict[str, int], cuts: dict) -> dict:
    """The state of rank ``rank`` (tp fastest, then pp, then dp)."""
    tp, pp, dp = rank % TP, rank // TP % PP, rank // (TP * PP)
    rows, cols, hidden = sizes["rows"], sizes["cols"], sizes["hidden"]
    col = torch.randn(rows, hidden)
    row = torch.randn(hidden, cols)
    state = {
        "model": {
            f"stage{pp}.col": ShardedTensor.from_rank_offsets(
                f"stage{pp}.col", col, (0, tp, TP), replica_id=dp
            ),
            f"stage{pp}.row": ShardedTensor.from_rank_offsets(
                f"stage{pp}.row", row, (1, tp, TP), replica_id=dp
            ),
            f"stage{pp}.norm": ShardedTensor.from_rank_offsets(
                f"stage{pp}.norm", torch.randn(hidden), replica_id=dp * TP + tp
            ),
            "empty": ShardedTensor("empty", torch.empty(0, 4), (0, 4), (0, 0), replica_id=rank),
        },
        "rng": ShardedObject("rng", {"seed": rank}, (PP, TP), (pp, tp), replica_id=dp),
        "iteration": 5,
        "args": {"lr": 0.1},
    }
    start, stop = cuts[(tp, pp)][dp]
    state["optimizer"] = ShardedTensor.from_flattened(
        f"optimizer.stage{pp}.row",
        torch.randn(stop - start),
        local_shape=(hidden, cols),
        global_shape=(hidden, cols * TP),
        global_offset=(0, cols * tp),
        flattened_range=(start, stop),
    )
    return state


def valid_summaries() -> list[dict]:
    rng = random.Random(SEED)
    sizes = {"rows": rng.randint(3, 9), "cols": rng.randint(3, 9), "hidden": rng.randint(4, 12)}
    numel = sizes["hidden"] * sizes["cols"]
    cuts = {(tp, pp): _flat_cuts(rng, numel, DP) for tp in range(TP) for pp in range(PP)}
    world = TP * PP * DP
    return [summarize(collect_local(rank_state(r, sizes, cuts))) for r in range(world)]


def plan_record(plan) -> dict:
    return {
        "catalogue": plan.catalogue,
        "mine_tensors": sorted([key, list(off)] for key, off in plan.mine_tensors),
        "mine_objects": sorted(plan.mine_objects),
        "mine_empty": sorted(plan.mine_empty),
        "bytes_per_rank": plan.bytes_per_rank,
        "plain_paths": plan.plain_paths,
    }


def invalid_cases(good: list[dict]) -> list[dict]:
    """Each case: a name and summaries made invalid by editing a copy of ``good``."""

    def edited(fn) -> list[dict]:
        copy = json.loads(json.dumps(good))
        fn(copy)
        return copy

    def set_tensor(s, rank, i, field, value):
        entry = list(s[rank]["tensors"][i])
        entry[field] = value
        s[rank]["tensors"][i] = entry

    def many(s):
        for r in range(len(s)):
            for i in range(len(s[r]["tensors"])):
                set_tensor(s, r, i, 1, "float16" if r % 2 else "float32")

    return [
        {"name": "overlap", "summaries": edited(lambda s: set_tensor(s, 4, 0, 3, 0))},
        {"name": "gap", "summaries": edited(lambda s: set_tensor(s, 0, 1, 3, 3))},
        {"name": "dtype", "summaries": edited(lambda s: set_tensor(s, 2, 2, 1, "float16"))},
        {"name": "shape", "summaries": edited(lambda s: set_tensor(s, 3, 0, 2, [99, 99]))},
        {
            "name": "object_twice",
            "summaries": edited(lambda s: s[4]["objects"].__setitem__(0, s[0]["objects"][0])),
        },
        {"name": "many", "summaries": edited(many)},
    ]


def as_input(summaries: list) -> list[dict]:
    """JSON lists back to the tuples `summarize` produces (boxes are dict keys)."""
    out = []
    for s in summaries:
        tensors = [
            (k, d, tuple(g), r, p, [(tuple(o), tuple(z)) for o, z in boxes])
            for k, d, g, r, p, boxes in s["tensors"]
        ]
        objects = [(k, tuple(g), tuple(o), r, p) for k, g, o, r, p in s["objects"]]
        out.append({"tensors": tensors, "objects": objects, "plain": list(s["plain"])})
    return out


def main(target: str) -> None:
    summaries = json.loads(json.dumps(valid_summaries()))
    plans = [plan_record(build_global_plan(as_input(summaries), r)) for r in range(len(summaries))]
    invalid = invalid_cases(summaries)
    for case in invalid:
        try:
            build_global_plan(as_input(case["summaries"]), 0)
        except ValueError as exc:
            case["error"] = str(exc)
        else:
            raise SystemExit(f"invalid case {case['name']!r} was accepted")
    record = {"seed": SEED, "summaries": summaries, "plans": plans, "invalid": invalid}
    Path(target).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target}: {len(plans)} plans, {len(invalid)} invalid cases")


if __name__ == "__main__":
    main(sys.argv[1])
