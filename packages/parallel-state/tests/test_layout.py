"""RankLayout: invariants for many sizes, and exact agreement with Megatron-Core's RankGenerator."""

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwork.parallel_state import GROUP_NAMES, ParallelConfig, RankLayout

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "megatron_rank_groups.json"
CASES = json.loads(FIXTURE.read_text())["cases"]


def _layout_of(case):
    c = case["config"]
    config = ParallelConfig(
        tp=c["tp"], pp=c["pp"], cp=c["cp"], ep=c["ep"], etp=c["etp"], order=c["order"]
    )
    return RankLayout.build(config, c["world"])


def test_fixture_covers_the_promised_variety():
    configs = [case["config"] for case in CASES]
    assert len(configs) >= 20
    assert any(c["etp"] != c["tp"] for c in configs)
    assert any(c["cp"] > 1 for c in configs)
    assert len({c["order"] for c in configs}) >= 5


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c["config"].items())
)
def test_groups_equal_megatron_core(case):
    layout = _layout_of(case)
    for name, groups in case["groups"].items():
        assert layout.groups[name] == groups, name


@st.composite
def layouts(draw):
    tp, cp, pp, dp = (draw(st.sampled_from([1, 2, 3, 4])) for _ in range(4))
    world = tp * cp * pp * dp
    per_stage = tp * cp * dp
    divisors = [d for d in range(1, per_stage + 1) if per_stage % d == 0]
    etp = draw(st.sampled_from(divisors))
    ep = draw(st.sampled_from([d for d in divisors if per_stage % (etp * d) == 0]))
    order = draw(st.permutations(["tp", "cp", "ep", "dp"]))
    config = ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order="-".join([*order, "pp"]))
    return RankLayout.build(config, world)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_rank_in_exactly_one_group_per_dimension(layout):
    layout.check()
    config = layout.config
    expected = {
        "tp": config.tp,
        "cp": config.cp,
        "dp": config.dp,
        "pp": config.pp,
        "dp_cp": config.dp * config.cp,
        "tp_cp": config.tp * config.cp,
        "tp_dp": config.tp * config.dp,
        "tp_dp_cp": config.tp * config.dp * config.cp,
        "mp": config.tp * config.pp,
        "ep": config.ep,
        "etp": config.etp,
        "edp": config.edp,
        "etp_ep": config.etp * config.ep,
        "expert_mp": config.etp * config.ep * config.pp,
        "embedding": min(config.pp, 2),  # first and last stage, one rank when pp == 1
    }
    assert set(expected) == set(GROUP_NAMES)  # a new group needs its formula here
    assert config.edp == config.tp * config.cp * config.dp // (config.etp * config.ep)
    for name, size in expected.items():
        assert {len(group) for group in layout.groups[name]} == {size}, name
    # One embedding group per pp group, holding its first and last stage.
    assert len(layout.groups["embedding"]) == len(layout.groups["pp"])
    for rank in range(layout.world_size):
        # Dense and expert layers of a rank live on the same pipeline stage.
        assert layout.group_of("pp", rank) == sorted(layout.group_of("pp", rank))
        assert layout.coordinate("pp", rank) == layout.coordinate("expert_mp", rank) // (
            layout.config.etp * layout.config.ep
        )
    # Each rank's dense and expert coordinates address it uniquely.
    dense_ids = {
        tuple(layout.coordinate(n, r) for n in ("tp", "cp", "dp", "pp"))
        for r in range(layout.world_size)
    }
    expert_ids = {
        tuple(layout.coordinate(n, r) for n in ("etp", "ep", "edp", "pp"))
        for r in range(layout.world_size)
    }
    assert len(dense_ids) == len(expert_ids) == layout.world_size


def test_known_layout_exactly():
    layout = RankLayout.build(ParallelConfig(tp=2, pp=2, ep=2, etp=1), 8)
    assert layout.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert set(layout.groups) == set(GROUP_NAMES)


def test_thousands_of_ranks_without_processes():
    layout = RankLayout.build(ParallelConfig(tp=8, pp=16, cp=2, ep=64, etp=1), 4096)
    layout.check()
    assert layout.config.dp == 16 and layout.config.edp == 4


def test_order_that_splits_pipeline_stages_is_refused():
    # With ep ahead of tp the expert grid would put pp stages on other ranks than the dense grid.
    with pytest.raises(ValueError, match="pipeline stages on different ranks"):
        RankLayout.build(ParallelConfig(tp=2, pp=2, ep=2, etp=1, order="tp-pp-ep-dp-cp"), 8)
