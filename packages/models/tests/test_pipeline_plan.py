"""Schedule plans, layer splits and argument checks (single process, no communication)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from shardwork.models.pipeline import (
    Action,
    chunk_layer_counts,
    forward_backward_1f1b,
    forward_backward_interleaved_1f1b,
    forward_backward_no_pipelining,
    get_schedule,
    layer_split,
    layers_per_rank,
    peak_in_flight,
    plan_ticks,
    schedule_orders,
    stage_layers,
)
from shardwork.models.pipeline.p2p import check_activation

GRID = [
    (p, v, m)
    for p, v in itertools.product((1, 2, 3, 4, 8), (1, 2, 3))
    if not (v > 1 and p == 1)
    for m in ((p, 2 * p, 3 * p) if v > 1 else (1, 2, p, 2 * p + 1))
]


def _makespan(plans):
    return max(t.index for plan in plans for t in plan) + 1


@pytest.mark.parametrize(("pp", "vpp", "microbatches"), GRID)
def test_every_plan_runs_and_messages_pair_up(pp, vpp, microbatches):
    orders = schedule_orders(pp, microbatches, vpp=vpp)
    plans = plan_ticks(orders, vpp=vpp)
    for r, plan in enumerate(plans):
        done = [t.action for t in plan if t.action is not None]
        assert done == orders[r]
        expected = {(k, c, m) for k in "FB" for c in range(vpp) for m in range(microbatches)}
        assert {(a.kind, a.chunk, a.microbatch) for a in done} == expected
    sends = {(t.index, m) for plan in plans for t in plan for m in t.sends}
    recvs = {(t.index, m) for plan in plans for t in plan for m in t.recvs}
    assert sends == recvs  # both ends exchange each message in the same tick
    # one activation and one gradient per virtual-stage boundary and microbatch
    assert len(sends) == 2 * (pp * vpp - 1) * microbatches


@pytest.mark.parametrize(("pp", "vpp", "microbatches"), [g for g in GRID if g[0] > 1])
def test_bubble_matches_the_analytical_formula(pp, vpp, microbatches):
    """With forward = backward = one tick per chunk, a step takes 2·(m·vpp + pp − 1) ticks:
    the bubble is 2(pp − 1) chunk-ticks, i.e. (pp − 1)/vpp of a stage's forward+backward."""
    plans = plan_ticks(schedule_orders(pp, microbatches, vpp=vpp), vpp=vpp)
    assert _makespan(plans) == 2 * (microbatches * vpp + pp - 1)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight(pp):
    m = 3 * pp
    for r, order in enumerate(schedule_orders(pp, m)):
        in_flight = list(itertools.accumulate(1 if a.kind == "F" else -1 for a in order))
        assert max(in_flight) == min(pp - r, m)


@pytest.mark.parametrize(("pp", "vpp", "microbatches"), GRID)
def test_peak_in_flight_equals_the_walk_of_the_schedule_order(pp, vpp, microbatches):
    """The closed walk against each rank's actual order, with random bytes per chunk (integers:
    exact sums), zero-byte chunks included (Llama 3's empty first and last virtual stages)."""
    gen = torch.Generator().manual_seed(pp * 100 + vpp * 10 + microbatches)
    chunk_bytes = [int(b) for b in torch.randint(0, 1000, (vpp,), generator=gen)]
    chunk_bytes[0] = 0 if pp % 2 else chunk_bytes[0]
    for r, order in enumerate(schedule_orders(pp, microbatches, vpp=vpp)):
        held = peak = 0
        for a in order:
            held += chunk_bytes[a.chunk] if a.kind == "F" else -chunk_bytes[a.chunk]
            peak = max(peak, held)
        assert peak_in_flight(pp, r, microbatches, chunk_bytes) == peak


def test_interleaved_keeps_fewer_in_flight_than_gpipe():
    pp, vpp, m = 4, 2, 8
    for r, order in enumerate(schedule_orders(pp, m, vpp=vpp)):
        in_flight = max(itertools.accumulate(1 if a.kind == "F" else -1 for a in order))
        assert in_flight == 2 * (pp - r - 1) + (vpp - 1) * pp + 1 < m * vpp


def test_no_pipelining_order_and_forward_only():
    assert schedule_orders(1, 2) == [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]
    ]
    orders = schedule_orders(2, 4, vpp=2, forward_only=True)
    assert all(a.kind == "F" for o in orders for a in o)
    assert _makespan(plan_ticks(orders, vpp=2)) == 4 * 2 + 1


def test_a_cyclic_order_is_rejected_before_running():
    orders = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)],
    ]
    with pytest.raises(RuntimeError, match="cannot run"):
        plan_ticks(orders)


def test_layer_split_even_uneven_and_virtual():
    assert layer_split(8, 2) == [[range(0, 4)], [range(4, 8)]]
    # virtual stage order: rank0 chunk0, rank1 chunk0, rank0 chunk1, rank1 chunk1
    assert layer_split(8, 2, vpp=2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert layers_per_rank(10, 4, first_stage_layers=1, last_stage_layers=3) == [1, 3, 3, 3]
    split = layer_split(12, 3, vpp=2, first_stage_layers=2, last_stage_layers=2)
    assert [len(r) for chunks in split for r in chunks] == [1, 1, 4, 4, 1, 1]
    assert sorted(i for chunks in split for r in chunks for i in r) == list(range(12))
    assert stage_layers(
        12, 3, 1, vpp=2, vp_chunk=1, first_stage_layers=2, last_stage_layers=2
    ) == range(7, 11)
    assert layer_split(4, 2, first_stage_layers=0) == [[range(0, 0)], [range(0, 4)]]


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "first", "last"),
    [(126, 16, 8, 0, 0), (126, 16, 4, 1, 1), (70, 12, 2, 2, 2), (11, 2, 3, 1, None),
     (9, 2, 2, None, 0), (4, 2, 2, 0, 0), (8, 2, 1, 3, None), (10, 3, 2, 0, 2)],
)  # fmt: skip
def test_virtual_stage_split_gives_the_ends_their_count(layers, pp, vpp, first, last):
    """Per virtual stage: the set ends hold their count, every other virtual stage the same
    share, and the layers run in virtual-stage order (chunk c of rank r = stage c·pp + r)."""
    ends = dict(first_virtual_stage_layers=first, last_virtual_stage_layers=last)
    stages = pp * vpp
    fixed = [x for x in (first, last) if x is not None]
    share = (layers - sum(fixed)) // (stages - len(fixed))
    expected = [share] * stages
    if first is not None:
        expected[0] = first
    if last is not None:
        expected[-1] = last
    counts = chunk_layer_counts(layers, pp, vpp=vpp, **ends)
    assert [counts[s % pp][s // pp] for s in range(stages)] == expected
    split = layer_split(layers, pp, vpp=vpp, **ends)
    in_order = [split[s % pp][s // pp] for s in range(stages)]
    assert [i for r in in_order for i in r] == list(range(layers))
    assert layers_per_rank(layers, pp, vpp=vpp, **ends) == [sum(c) for c in counts]
    assert stage_layers(layers, pp, pp - 1, vpp=vpp, vp_chunk=vpp - 1, **ends) == in_order[-1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {
                "num_layers": 8,
                "pp_size": 2,
                "first_stage_layers": 3,
                "first_virtual_stage_layers": 1,
            },
            "exclude each other",
        ),
        (
            {"num_layers": 8, "pp_size": 2, "vpp": 2, "first_virtual_stage_layers": 1},
            "first_virtual_stage_layers=1 and last_virtual_stage_layers=None: the 7 remaining",
        ),
        ({"num_layers": 8, "pp_size": 1, "last_virtual_stage_layers": 0}, "needs pp_size > 1"),
        ({"num_layers": 8, "pp_size": 2, "first_virtual_stage_layers": -1}, "integer >= 0"),
        (
            {
                "num_layers": 4,
                "pp_size": 2,
                "first_virtual_stage_layers": 3,
                "last_virtual_stage_layers": 3,
            },
            "do not fit num_layers=4",
        ),
        ({"num_layers": 7, "pp_size": 2}, "num_layers=7"),
        (
            {"num_layers": 8, "pp_size": 2, "vpp": 2, "first_stage_layers": 3},
            "first_stage_layers=3",
        ),
        ({"num_layers": 8, "pp_size": 2, "first_stage_layers": 9}, "do not fit"),
        ({"num_layers": 8, "pp_size": 1, "last_stage_layers": 2}, "needs pp_size > 1"),
        ({"num_layers": 0, "pp_size": 1}, "num_layers=0"),
    ],
)
def test_layer_split_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layers_per_rank(**kwargs)


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match=r"num_microbatches=3 .* multiple of pp_size=2"):
        schedule_orders(2, 3, vpp=2)
    with pytest.raises(ValueError, match="vpp=2 needs pp_size > 1"):
        get_schedule(1, 2)
    assert get_schedule(1) is forward_backward_no_pipelining
    assert get_schedule(4) is forward_backward_1f1b
    assert get_schedule(4, 2) is forward_backward_interleaved_1f1b
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="pp_group=None"):
        forward_backward_1f1b(
            forward_step_func=None,
            data_iterator=iter([]),
            model=model,
            num_microbatches=1,
            pp_group=None,
        )
    with pytest.raises(ValueError, match="list of 2 iterators"):
        forward_backward_interleaved_1f1b(
            forward_step_func=None,
            data_iterator=iter([]),
            model=[model, model],
            num_microbatches=2,
            pp_group=None,
        )
    with pytest.raises(ValueError, match="num_microbatches=0"):
        forward_backward_no_pipelining(
            forward_step_func=None, data_iterator=iter([]), model=model, num_microbatches=0
        )


def test_loss_fn_contract_is_checked():
    model = nn.Linear(2, 2)

    def step(it, chunk):
        return chunk(next(it)), lambda out: out.sum()  # not (sum, tokens, logs)

    with pytest.raises(ValueError, match=r"must return \(loss_sum, num_tokens, logs\)"):
        forward_backward_no_pipelining(
            forward_step_func=step,
            data_iterator=iter([torch.randn(3, 2)]),
            model=model,
            num_microbatches=1,
        )


def test_activation_checks():
    x = torch.zeros(4, 2, 8)
    check_activation(x, (4, 2, 8), torch.float32, chunk=0, microbatch=0)
    check_activation(x, None, torch.float64, chunk=0, microbatch=0)  # dtype travels in the header
    with pytest.raises(ValueError, match=r"tensor_shape=\(4, 2, 6\)"):
        check_activation(x, (4, 2, 6), torch.float32, chunk=1, microbatch=3)
    with pytest.raises(ValueError, match="must be a tensor"):
        check_activation((x,), None, torch.float32, chunk=0, microbatch=0)
