"""ParallelConfig validation: every bad combination is refused with a message naming it."""

import pytest

from shardwork.parallel_state import ParallelConfig

BAD_CONFIGS = [
    (dict(tp=0), 8, r"ParallelConfig\.tp=0 .*>= 1"),
    (dict(pp=-1), 8, r"ParallelConfig\.pp=-1"),
    (dict(cp=1.5), 8, r"ParallelConfig\.cp=1\.5"),
    (dict(ep=True), 8, r"ParallelConfig\.ep=True"),
    (dict(etp=0), 8, r"ParallelConfig\.etp=0"),
    (dict(dp=0), 8, r"ParallelConfig\.dp=0"),
    (dict(vpp=2), 8, r"ParallelConfig\.vpp=2 needs pipeline parallelism"),
    (dict(vpp=0, pp=2), 8, r"ParallelConfig\.vpp=0"),
    (dict(order="tp-cp-ep-dp-xx"), 8, r"unknown tokens \['xx'\]"),
    (dict(order="tp-tp-dp"), 8, r"repeated tokens \['tp'\]"),
    (dict(tp=3), 8, r"world_size=8 is not divisible by tp\*cp\*pp = 3\*1\*1 = 3"),
    (dict(tp=2, pp=2, cp=4), 8, r"tp\*cp\*pp = 2\*4\*2 = 16"),
    (dict(dp=4, tp=2), 4, r"ParallelConfig\.dp=4 does not match world_size=4: .* must be 2"),
    (dict(ep=3), 8, r"ParallelConfig\.ep=3 with etp=1 and pp=1 .*etp\*ep\*pp = 3 must divide"),
    (dict(ep=4, etp=4, pp=2), 8, r"etp\*ep\*pp = 32"),
    (dict(tp=2, order="cp-ep-dp-pp"), 8, r"omits 'tp' but its size is 2"),
    (dict(tp=4, etp=1, ep=2, order="tp-ep-pp"), 4, r"omits 'dp' but its size is 2"),
]


@pytest.mark.parametrize(("kwargs", "world", "message"), BAD_CONFIGS)
def test_bad_config_names_field_and_value(kwargs, world, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs).resolve(world)


def test_bad_world_size():
    with pytest.raises(ValueError, match=r"world_size=0"):
        ParallelConfig().resolve(0)


def test_resolve_derives_dp_edp_and_etp():
    config = ParallelConfig(tp=2, pp=2, ep=4, etp=1).resolve(16)
    assert (config.dp, config.etp, config.edp, config.world_size) == (4, 1, 2, 16)
    assert ParallelConfig(tp=4).resolve(8).etp == 4


def test_unresolved_sizes_are_refused():
    with pytest.raises(ValueError, match="only known after resolve"):
        _ = ParallelConfig().edp


def test_short_order_appends_unit_dimensions_like_megatron():
    config = ParallelConfig(tp=2, pp=2, order="tp-dp-pp")
    assert config.full_order == ["tp", "dp", "pp", "cp", "ep"]
    assert config.resolve(8).dp == 2
