"""``MoEConfig.router`` (issue 18): the router's config is moe-router's ``RouterConfig``, held
as given; ``GPTConfig`` refuses a router of another hidden size, and ``GPTConfig.replace``
carries a changed hidden size (and an init std the router shared) into an inherited router."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwork.models import GPTConfig, GPTModel, preset
from shardwork.models.families.twins import tiny_moe
from shardwork.models.moe import MoEConfig, MoELayer
from shardwork.moe_router import RouterConfig


def test_replace_carries_hidden_size_into_the_inherited_router():
    cfg = preset("tiny-mixtral-8x7b")
    narrow = cfg.replace(hidden_size=32)
    assert narrow.moe.router.hidden_size == 32
    # nothing else of the router or the MoE part moves
    assert dataclasses.replace(narrow.moe.router, hidden_size=64) == cfg.moe.router
    assert narrow.moe.replace(router=cfg.moe.router) == cfg.moe
    layer = next(m for m in GPTModel(narrow, device="meta").modules() if isinstance(m, MoELayer))
    assert tuple(layer.router.weight.shape) == (8, 32)


def test_replace_carries_init_std_only_where_the_router_shared_it():
    cfg = preset("tiny-mixtral-8x7b")
    assert cfg.init_method_std == 0.05 and cfg.moe.router.init_std == 0.05
    assert cfg.replace(init_method_std=0.1).moe.router.init_std == 0.1
    own = cfg.replace(
        moe=cfg.moe.replace(router=dataclasses.replace(cfg.moe.router, init_std=0.01))
    )
    assert own.replace(init_method_std=0.1).moe.router.init_std == 0.01
    # an unchanged init std leaves the router's own as it is
    assert own.replace(init_method_std=0.05, num_layers=3).moe.router.init_std == 0.01


def test_replace_with_a_moe_takes_it_as_given():
    cfg = preset("tiny-mixtral-8x7b")
    with pytest.raises(ValueError) as err:
        cfg.replace(hidden_size=32, moe=cfg.moe)
    assert str(err.value) == (
        "GPTConfig.moe.router.hidden_size=64 differs from GPTConfig.hidden_size=32: the router "
        "reads the model's hidden states; valid: 32"
    )
    given = cfg.moe.replace(router=dataclasses.replace(cfg.moe.router, init_std=0.3))
    assert cfg.replace(init_method_std=0.1, moe=given).moe.router.init_std == 0.3


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_size": 0}, r"^GPTConfig\.hidden_size=0 is invalid"),
        ({"hidden_size": "64"}, r"^GPTConfig\.hidden_size='64' is invalid"),
        ({"init_method_std": -1.0}, r"^GPTConfig\.init_method_std=-1\.0 must be > 0"),
    ],
)
def test_replace_with_a_bad_value_names_the_models_field(change, match):
    with pytest.raises(ValueError, match=match):
        preset("tiny-mixtral-8x7b").replace(**change)


def test_router_of_another_hidden_size_is_refused_on_construction():
    fields = vars(preset("tiny-qwen3-30b-a3b"))
    moe = fields["moe"].replace(router=dataclasses.replace(fields["moe"].router, hidden_size=48))
    with pytest.raises(ValueError, match=r"GPTConfig\.moe\.router\.hidden_size=48 differs .*64"):
        GPTConfig(**(fields | {"moe": moe}))


def test_router_must_be_a_router_config():
    with pytest.raises(ValueError, match=r"MoEConfig\.router=\{'num_experts': 8\} is invalid"):
        MoEConfig(router={"num_experts": 8}, ffn_hidden_size=8)


def test_tiny_moe_router_overrides():
    m = tiny_moe(router=dict(top_k=4, pre_softmax=True), layer_freq=2)
    assert m.router == RouterConfig(
        num_experts=8, hidden_size=64, top_k=4, pre_softmax=True, init_std=0.05
    )
    assert (m.ffn_hidden_size, m.layer_freq) == (32, 2)


def test_router_weight_follows_router_init_std():
    """The gating weight is drawn at ``moe.router.init_std``, every other weight at the model's
    ``init_method_std``: a router std of 0.2 in a 0.05 model gives the router weight of a 0.2
    model and the other weights of the 0.05 model, bit for bit."""
    cfg = preset("tiny-mixtral-8x7b", params_dtype=torch.float64, num_layers=1)
    router = dataclasses.replace(cfg.moe.router, init_std=0.2)
    mixed = dict(GPTModel(cfg.replace(moe=cfg.moe.replace(router=router))).named_parameters())
    model_std = dict(GPTModel(cfg).named_parameters())
    router_std = dict(GPTModel(cfg.replace(init_method_std=0.2)).named_parameters())
    gating = [k for k in mixed if k.endswith("mlp.router.weight")]
    assert gating and mixed.keys() == model_std.keys()
    for key, value in mixed.items():
        expected = router_std[key] if key in gating else model_std[key]
        assert torch.equal(value, expected), key
    assert not torch.equal(mixed[gating[0]], model_std[gating[0]])
