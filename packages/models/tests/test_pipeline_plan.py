"""Schedule plans, layer splits and argument checks (single process, no communication)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from shardwork.models.pipeline import (
    Action,
    forward_backward_1f1b,
    forward_backward_interleaved_1f1b,
    forward_backward_no_pipelining,
    get_schedule,
    layer_split,
    layers_per_rank,
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
    ("kwargs", "match"),
    [
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
