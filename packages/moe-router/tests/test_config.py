"""RouterConfig validation: every bad value raises ValueError naming the option."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest
import torch

from shardwork.moe_router import RouterConfig, TopKRouter

BASE = {"num_experts": 8, "hidden_size": 16}

NEEDS_FUSED = pytest.mark.skipif(
    importlib.util.find_spec("shardwork.fused_kernels") is None,
    reason="fused_backend needs shardwork-fused-kernels (the [fused] extra)",
)


def _case_id(case) -> str:
    """The fragment a bad case must name (a ``pytest.param`` keeps it in ``values``)."""
    return case.values[1] if hasattr(case, "values") else case[1]


BAD = [
    ({"top_k": 9}, "top_k=9"),
    ({"top_k": 0}, "top_k=0"),
    ({"num_experts": 0}, "num_experts=0"),
    ({"hidden_size": -1}, "hidden_size=-1"),
    ({"num_groups": 3, "group_top_k": 1}, "num_groups=3"),
    ({"num_groups": 4, "group_top_k": 5, "top_k": 5}, "group_top_k=5"),
    ({"num_groups": 4}, "num_groups=4"),
    ({"num_groups": 4, "group_top_k": 4, "top_k": 2}, "group_top_k=4"),
    ({"group_score_top_n": 2}, "group_score_top_n=2"),
    ({"num_groups": 2, "group_top_k": 1, "group_score_top_n": 0}, "group_score_top_n=0"),
    ({"num_groups": 2, "group_top_k": 1, "group_score_top_n": 5}, "group_score_top_n=5"),
    ({"num_groups": 2, "group_top_k": 1, "group_score_top_n": True}, "group_score_top_n=True"),
    pytest.param(
        {"num_groups": 2, "group_top_k": 1, "group_score_top_n": 1, "fused_backend": "torch"},
        "group_score_top_n=1",
        marks=NEEDS_FUSED,
    ),
    ({"score_function": "relu"}, "score_function='relu'"),
    ({"enable_expert_bias": True}, "enable_expert_bias=True"),
    ({"pre_softmax": True, "score_function": "sigmoid"}, "pre_softmax=True"),
    ({"top_k": 1}, "pre_softmax=False"),
    ({"load_balancing_type": "balanced"}, "load_balancing_type='balanced'"),
    (
        {"load_balancing_type": ("aux_loss", "sinkhorn"), "aux_loss_coeff": (1.0, 1.0)},
        "load_balancing_type=",
    ),
    ({"load_balancing_type": ("aux_loss", "z_loss")}, "load_balancing_type="),
    (
        {"load_balancing_type": ("aux_loss", "seq_aux_loss"), "aux_loss_coeff": 0.1},
        "aux_loss_coeff=0.1",
    ),
    ({"load_balancing_type": ("aux_loss", "aux_loss"), "aux_loss_coeff": (0.1, 0.1)}, "repeats"),
    ({"aux_loss_coeff": -1.0}, "aux_loss_coeff=-1.0"),
    ({"load_balancing_type": "sinkhorn", "aux_loss_coeff": 0.1}, "aux_loss_coeff=0.1"),
    ({"capacity_factor": 0.0}, "capacity_factor=0.0"),
    ({"capacity_factor": 1.0, "load_balancing_type": "sinkhorn"}, "capacity_factor=1.0"),
    ({"pad_to_capacity": True}, "pad_to_capacity=True"),
    ({"token_drop_policy": "random"}, "token_drop_policy='random'"),
    ({"router_dtype": "bf16"}, "router_dtype='bf16'"),
    ({"z_loss_coeff": -0.1}, "z_loss_coeff=-0.1"),
    ({"input_jitter_eps": -0.1}, "input_jitter_eps=-0.1"),
    ({"expert_bias_update_rate": -1}, "expert_bias_update_rate=-1"),
    ({"fused_backend": "cuda"}, "fused_backend='cuda'"),
    ({"load_balancing_type": "quantile_balancing", "aux_loss_coeff": 0.1}, "aux_loss_coeff=0.1"),
    (
        {"load_balancing_type": "quantile_balancing", "num_groups": 2, "group_top_k": 1},
        "num_groups=2",
    ),
    (
        {
            "load_balancing_type": "quantile_balancing",
            "score_function": "sigmoid",
            "enable_expert_bias": True,
        },
        "enable_expert_bias=True",
    ),
    (
        {"load_balancing_type": "quantile_balancing", "capacity_factor": 1.0},
        "capacity_factor=1.0",
    ),
    ({"load_balancing_type": "quantile_balancing", "top_k": 8}, "top_k=8"),
    pytest.param(
        {"load_balancing_type": "quantile_balancing", "fused_backend": "torch"},
        "fused_backend='torch'",
        marks=NEEDS_FUSED,
    ),
    (
        {"load_balancing_type": "quantile_balancing", "quantile_balancing_ema": 1.5},
        "quantile_balancing_ema=1.5",
    ),
    ({"quantile_balancing_ema": 0.5}, "quantile_balancing_ema=0.5"),
    ({"load_balancing_type": ("aux_loss", "quantile_balancing")}, "load_balancing_type="),
]


@pytest.mark.parametrize("kwargs,fragment", BAD, ids=[_case_id(case) for case in BAD])
def test_bad_values_name_the_option(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        RouterConfig(**{**BASE, **kwargs})


BOOL_FIELDS = (
    "pre_softmax",
    "pad_to_capacity",
    "add_bias",
    "enable_expert_bias",
    "force_load_balancing",
    "calculate_per_token_loss",
    "check_finite",
)


def test_bool_fields_are_every_bool_field():
    """The list below covers every bool field (a new one is checked by its annotation)."""
    bools = {f.name for f in dataclasses.fields(RouterConfig) if f.type == "bool"}
    assert bools == set(BOOL_FIELDS)


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["False", "no", 0, 1, None])
def test_bool_fields_refuse_non_bools(name, value):
    # "False" is truthy: accepted, it would act as True and route silently wrong.
    with pytest.raises(TypeError, match=re.escape(f"RouterConfig.{name}={value!r}")):
        RouterConfig(**BASE, **{name: value})


def test_bool_fields_accept_bools():
    for name in BOOL_FIELDS:
        assert getattr(RouterConfig(**BASE, **{name: False}), name) is False
    on = RouterConfig(
        **BASE,
        score_function="sigmoid",
        enable_expert_bias=True,
        add_bias=True,
        force_load_balancing=True,
        calculate_per_token_loss=True,
        check_finite=True,
        capacity_factor=1.0,
        pad_to_capacity=True,
    )
    assert on.enable_expert_bias and on.pad_to_capacity and on.check_finite
    assert RouterConfig(**BASE, pre_softmax=True).pre_softmax is True


INF, NAN = float("inf"), float("nan")
NOT_FINITE = [
    ({"capacity_factor": INF}, "capacity_factor=inf"),
    ({"capacity_factor": NAN}, "capacity_factor=nan"),
    ({"aux_loss_coeff": INF}, "aux_loss_coeff=inf"),
    ({"aux_loss_coeff": NAN}, "aux_loss_coeff=nan"),
    (
        {"load_balancing_type": ("aux_loss", "seq_aux_loss"), "aux_loss_coeff": (0.1, INF)},
        "aux_loss_coeff=(0.1, inf)",
    ),
    ({"z_loss_coeff": INF}, "z_loss_coeff=inf"),
    ({"top_k_scaling_factor": INF}, "top_k_scaling_factor=inf"),
    ({"input_jitter_eps": NAN}, "input_jitter_eps=nan"),
    ({"expert_bias_update_rate": INF}, "expert_bias_update_rate=inf"),
    ({"init_std": INF}, "init_std=inf"),
]


@pytest.mark.parametrize("kwargs,fragment", NOT_FINITE, ids=[c[1] for c in NOT_FINITE])
def test_numbers_must_be_finite(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment) + ".*finite"):
        RouterConfig(**{**BASE, **kwargs})


def test_large_finite_numbers_still_accepted():
    big = RouterConfig(**BASE, capacity_factor=1e6, aux_loss_coeff=1e3, z_loss_coeff=1e3)
    assert big.capacity_factor == 1e6
    router = TopKRouter(big)
    # capacity far above T: nothing dropped, every token keeps its K experts
    assert router(torch.randn(5, 16))[1].sum() == 5 * 2


def test_good_configs_and_coefficients():
    c = RouterConfig(
        **BASE,
        load_balancing_type=["aux_loss", "global_aux_loss"],
        aux_loss_coeff=[0.1, 0.0],
    )
    assert c.load_balancing_type == ("aux_loss", "global_aux_loss")
    assert c.aux_loss_coeff_for("aux_loss") == 0.1
    assert c.aux_loss_coeff_for("global_aux_loss") == 0.0
    assert c.aux_loss_coeff_for("seq_aux_loss") == 0.0
    assert c.aux_loss_enabled
    assert not RouterConfig(**BASE, load_balancing_type="none").aux_loss_enabled
    assert RouterConfig(**BASE, top_k=1, load_balancing_type="sinkhorn").top_k == 1
    d = dataclasses.replace(c, top_k=4)
    assert d.top_k == 4 and d.aux_loss_coeff_for("aux_loss") == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        RouterConfig(8, 16)  # type: ignore[misc]  # keyword-only


@NEEDS_FUSED
def test_fused_backend_accepts_the_fused_group_score_rule():
    groups = {"num_groups": 2, "group_top_k": 1, "fused_backend": "torch"}
    # the fused router's own rule (top_k // group_top_k = 2) is accepted
    assert RouterConfig(**BASE, **groups, group_score_top_n=2).group_score_top_n == 2


def test_every_field_is_documented():
    import ast
    import inspect

    from shardwork.moe_router import config as config_module

    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RouterConfig")
    documented = set()
    for stmt, nxt in zip(cls.body, cls.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            documented.add(stmt.target.id)
    public = {f.name for f in dataclasses.fields(RouterConfig) if not f.name.startswith("_")}
    assert public <= documented, public - documented


def test_wrong_hidden_size_and_mask_shape_rejected():
    router = TopKRouter(RouterConfig(**BASE))
    with pytest.raises(ValueError, match="hidden_size = 16"):
        router(torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match="padding_mask"):
        router(torch.randn(4, 2, 16), padding_mask=torch.zeros(8, dtype=torch.bool))


def test_integer_hidden_rejected():
    router = TopKRouter(RouterConfig(**BASE))
    with pytest.raises(TypeError, match=r"hidden of dtype torch\.int64 is invalid"):
        router(torch.randint(0, 5, (6, 16)))
    assert router(torch.randn(6, 16, dtype=torch.float64).float())[0].dtype == torch.float32


def test_route_checks_logits_against_seq_len_batch_and_experts():
    router = TopKRouter(RouterConfig(**BASE, aux_loss_coeff=0.01))
    # E = 5 logits for an 8-expert router, in eval (formerly a [6, 5] result)
    with torch.no_grad(), pytest.raises(ValueError, match=r"logits_TE of shape \(6, 5\)"):
        router.eval().route(torch.randn(6, 5), seq_len=3, batch=2)
    # 4 * 2 = 8 != 6 tokens (formerly a RuntimeError inside the sequence aux loss)
    logits = torch.randn(6, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"expected .* = \(8, 8\) for seq_len=4, batch=2"):
        router.train().route(logits, seq_len=4, batch=2)
    with pytest.raises(ValueError, match=r"seq_len=3\.0"):
        router.route(logits, seq_len=3.0, batch=2)
    with pytest.raises(TypeError, match=r"logits_TE of dtype torch\.int64"):
        router.route(torch.zeros(6, 8, dtype=torch.long), seq_len=3, batch=2)
    with pytest.raises(ValueError, match=r"padding_mask of shape \(5,\)"):
        router.route(logits, seq_len=3, batch=2, padding_mask=torch.zeros(5, dtype=torch.bool))
    # the matching shape routes, in training (sequence aux loss) too
    probs, rmap = router.route(logits, seq_len=3, batch=2, padding_mask=torch.zeros(6).bool())
    assert probs.shape == (6, 8) and rmap.sum() == 6 * 2


def test_quantile_balancing_refuses_padding_and_uneven_token_counts():
    cfg = RouterConfig(**BASE, load_balancing_type="quantile_balancing")
    router = TopKRouter(cfg)
    with pytest.raises(ValueError, match="padding_mask is invalid"):
        router(torch.randn(4, 2, 16), padding_mask=torch.zeros(4, 2, dtype=torch.bool))
    # 3 tokens x top_k 2 = 6 assignments cannot split evenly over 8 experts
    with pytest.raises(ValueError, match="num_experts=8"):
        router(torch.randn(3, 1, 16))
    router.eval()  # no quantile in eval: any token count routes
    with torch.no_grad():
        assert router(torch.randn(3, 1, 16))[1].sum() == 6
