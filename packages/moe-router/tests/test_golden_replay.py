"""RouterReplay against Megatron-Core 0.19.2's router replay (committed fixtures).

Fixtures come from ``tools/moe_router_golden.py replay``: two Megatron routers
(``moe_enable_routing_replay=True``) record two micro-batches (``RouterReplayAction.RECORD``,
``RouterReplay.get_recorded_data()`` after each), their gating weights are perturbed, and each
micro-batch is replayed (``set_replay_data`` with its records, ``REPLAY_FORWARD``) with a
backward pass. Cases: sigmoid with groups, expert bias, scaling and the sequence aux loss;
pre-softmax with the aux loss; post-softmax with the aux loss recorded and replayed by Megatron
at TP 2 with sequence parallelism (each rank holds half of every sequence).

Checked here, for every layer and micro-batch: our records equal Megatron's (as sets per
token: Megatron keeps score order, our few-expert path ascending ids) and so do the maps; after
the perturbation our natural maps equal Megatron's and differ from the records; replaying
*Megatron's* records gives Megatron's replayed maps exactly and its probs, input and weight
gradients within rtol 1e-6 + 8 fp32 ulp of max|ref|. The TP-2 case is replayed here at world 1
from records merged over Megatron's two ranks (``merge_record_shards``), and at 2 ranks from
the merged records re-split (``shard_records``), with ``gather_records`` rebuilding the merged
records from our own 2-rank recording: a record does not depend on the layout that made it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwork.moe_router import (
    AuxLossScale,
    RouterConfig,
    RouterReplay,
    TopKRouter,
    gather_records,
    merge_record_shards,
    shard_records,
)
from shardwork.parallel_state.testing import assert_close_at_scale

pytestmark = pytest.mark.golden

FIXTURES = torch.load(
    Path(__file__).parent / "fixtures" / "megatron_router_replay.pt", weights_only=False
)
CASES = FIXTURES["cases"]


def close(actual, expected, what):
    assert_close_at_scale(actual, expected, rtol=1e-6, ulps=8, dtype=torch.float32, name=what)


def layouts(case) -> list[torch.Tensor]:
    """Each Megatron rank's sequence positions: TP ranks hold contiguous blocks."""
    seq, tp = case.get("S", 8), case.get("tp", 1)
    return [torch.arange(r * seq // tp, (r + 1) * seq // tp) for r in range(tp)]


def merged_megatron(case) -> dict:
    """Megatron's per-rank records, inputs and outputs in the global [S, B] token order."""
    ranks, positions = case["ranks"], layouts(case)
    as_records = [
        {layer: [rk["records"][mb][layer] for mb in range(len(rk["records"]))] for layer in (0, 1)}
        for rk in ranks
    ]

    def cat(get):  # rank outputs are consecutive blocks of the sequence
        return torch.cat([get(rk) for rk in ranks], dim=0)

    return {
        "records": merge_record_shards(as_records, positions),
        "cat": cat,
        "grad_weight": [sum(rk["grad_weight"][i] for rk in ranks) for i in (0, 1)],
    }


def build_layers(case, replay, token_group=None) -> list[TopKRouter]:
    config = RouterConfig(**case["config"])
    layers = []
    for i, inputs in enumerate(case["ranks"][0]["layers"]):
        router = TopKRouter(
            config,
            layer_index=i,
            replay=replay,
            tp_cp_group=token_group,
            loss_scale=AuxLossScale(0.5),
        )
        with torch.no_grad():
            router.weight.copy_(inputs["weight"])
            if inputs["expert_bias"] is not None:
                router.expert_bias.copy_(inputs["expert_bias"])
        layers.append(router)
    return layers


def run_ours(case, layers, replay, inputs, grads, records) -> dict:
    """Record on ``inputs``, perturb, natural maps, replay ``records`` with backward."""
    replay.record()
    recorded_maps = [[r(x)[1] for r, x in zip(layers, xs)] for xs in inputs]
    ours = replay.records()
    replay.stop()
    with torch.no_grad():
        for r, delta in zip(layers, case["ranks"][0]["weight_delta"]):
            r.weight.add_(delta)
    natural = [[r(x)[1] for r, x in zip(layers, xs)] for xs in inputs]
    replay.load(records)
    replay.replay()
    replayed = []
    for xs, gs in zip(inputs, grads):
        row = []
        for r, x, g in zip(layers, xs, gs):
            x = x.clone().requires_grad_(True)
            probs, rmap = r(x)
            (probs * g).sum().backward()
            row.append({"probs": probs.detach(), "routing_map": rmap, "grad_hidden": x.grad})
        replayed.append(row)
    return {
        "records": ours,
        "recorded_maps": recorded_maps,
        "natural_maps": natural,
        "replayed": replayed,
        "grad_weight": [r.weight.grad for r in layers],
    }


def as_sets(idx_TK: torch.Tensor) -> torch.Tensor:
    return idx_TK.sort(dim=1).values


def compare(ours: dict, ref: dict, records: dict, where: str) -> None:
    for layer in (0, 1):
        close(ours["grad_weight"][layer], ref["grad_weight"][layer], f"{where} grad_weight {layer}")
        for mb in range(2):
            at = f"{where} layer {layer} micro-batch {mb}"
            got, exp = ours["replayed"][mb][layer], ref["replayed"][mb][layer]
            assert torch.equal(as_sets(ours["records"][layer][mb]), as_sets(records[layer][mb])), (
                f"{at}: records"
            )
            assert torch.equal(ours["recorded_maps"][mb][layer], ref["recorded_maps"][mb][layer])
            assert torch.equal(ours["natural_maps"][mb][layer], ref["natural_maps"][mb][layer])
            assert torch.equal(got["routing_map"], exp["routing_map"]), f"{at}: replayed map"
            assert not torch.equal(got["routing_map"], ours["natural_maps"][mb][layer]), at
            close(got["probs"], exp["probs"], f"{at}: probs")
            close(got["grad_hidden"], exp["grad_hidden"], f"{at}: grad_hidden")


def megatron_as_world1(case) -> tuple[dict, list, list]:
    merged = merged_megatron(case)
    cat = merged["cat"]
    ranks = case["ranks"]

    def per_mb(key):
        return [[cat(lambda rk, mb=mb, i=i: rk[key][mb][i]) for i in (0, 1)] for mb in range(2)]

    ref = {
        "recorded_maps": per_mb("recorded_maps"),
        "natural_maps": per_mb("natural_maps"),
        "replayed": [
            [
                {
                    k: cat(lambda rk, mb=mb, i=i, k=k: rk["replayed"][mb][i][k])
                    for k in ("probs", "routing_map", "grad_hidden")
                }
                for i in (0, 1)
            ]
            for mb in range(2)
        ],
        "grad_weight": merged["grad_weight"],
    }
    inputs = [
        [cat(lambda rk, mb=mb, i=i: rk["replayed"][mb][i]["hidden"]) for i in (0, 1)]
        for mb in range(2)
    ]
    grads = [
        [cat(lambda rk, mb=mb, i=i: rk["replayed"][mb][i]["grad_probs"]) for i in (0, 1)]
        for mb in range(2)
    ]
    assert len(ranks) == len(layouts(case))
    return {**ref, "records": merged["records"]}, inputs, grads


@pytest.mark.parametrize("name", list(CASES))
def test_replay_matches_megatron_at_world_1(name):
    case = CASES[name]
    ref, inputs, grads = megatron_as_world1(case)
    replay = RouterReplay()
    layers = build_layers(case, replay)
    ours = run_ours(case, layers, replay, inputs, grads, ref["records"])
    compare(ours, ref, ref["records"], name)


def _sp2_rank(name: str) -> bool:
    ps = pytest.importorskip("shardwork.parallel_state")
    case = CASES[name]
    pg = ps.init_process_groups(ps.ParallelConfig(tp=2))
    rank = pg.rank("tp")
    positions = layouts(case)[rank]
    rk = case["ranks"][rank]
    merged = merged_megatron(case)["records"]
    local = shard_records(merged, sequence_positions=positions, seq_len=case.get("S", 8))
    replay = RouterReplay()
    layers = build_layers(case, replay, token_group=pg.tp_cp)
    inputs = [[rk["replayed"][mb][i]["hidden"] for i in (0, 1)] for mb in range(2)]
    grads = [[rk["replayed"][mb][i]["grad_probs"] for i in (0, 1)] for mb in range(2)]
    ours = run_ours(case, layers, replay, inputs, grads, local)
    compare(ours, rk, local, f"{name} rank {rank}")
    regathered = gather_records(ours["records"], sequence_positions=positions, group=pg.tp_cp)
    for layer in (0, 1):
        for got, exp in zip(regathered[layer], merged[layer]):
            assert torch.equal(as_sets(got), as_sets(exp)), "gather_records"
    return True


@pytest.mark.multirank
def test_replay_at_tp2_sequence_parallel_matches_megatron_ranks():
    testing = pytest.importorskip("shardwork.parallel_state.testing")
    assert testing.run_on_ranks(_sp2_rank, 2, args=("replay_postsoftmax_sp2",)) == [True, True]


def test_layout_conversions_round_trip_and_refuse_bad_layouts():
    gen = torch.Generator().manual_seed(0)
    seq, batch = 8, 3
    global_rec = {0: [torch.randint(0, 16, (seq * batch, 4), generator=gen)]}
    # load-balanced context parallelism at CP 2: rank r holds chunks r and 3 - r of 4
    chunks = torch.arange(seq).chunk(4)
    cp_layouts = [torch.cat((chunks[0], chunks[3])), torch.cat((chunks[1], chunks[2]))]
    shards = [shard_records(global_rec, sequence_positions=p, seq_len=seq) for p in cp_layouts]
    # rank 0 holds positions [0, 1, 6, 7]: its local row 2·batch is (position 6, batch 0)
    assert torch.equal(shards[0][0][0][batch * 2], global_rec[0][0][6 * batch])
    assert torch.equal(merge_record_shards(shards, cp_layouts)[0][0], global_rec[0][0])
    with pytest.raises(ValueError, match="exactly once"):
        merge_record_shards(shards, [cp_layouts[0], cp_layouts[0]])
    with pytest.raises(ValueError, match="not a multiple"):
        shard_records(global_rec, sequence_positions=cp_layouts[0], seq_len=5)
