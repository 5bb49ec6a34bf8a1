"""Bad input: clear ValueErrors before any collective, or correct behaviour — never a hang."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwork.dist_optimizer import (
    AdamW,
    ChainedOptimizer,
    ConstantLossScaler,
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    LayerWiseDistributedOptimizer,
    Muon,
    OptimizerConfig,
    build_optimizer,
)
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

ZERO = DDPConfig(use_distributed_optimizer=True, bucket_size=None, pad_multiple=1)


def sgd(groups):
    return torch.optim.SGD(groups, lr=0.1)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def test_optimizer_and_ddp_kind_must_agree():
    with pytest.raises(ValueError, match="use_distributed_optimizer=False"):
        DistributedOptimizer(DistributedDataParallel(mlp()), sgd)
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        LayerWiseDistributedOptimizer(DistributedDataParallel(mlp(), config=ZERO), sgd)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        DistributedOptimizer(mlp(), sgd)
    single = ProcessGroups.single()
    chain = build_optimizer(DistributedDataParallel(mlp()), sgd, process_groups=single)
    assert [type(p) for p in chain.parts] == [LayerWiseDistributedOptimizer] * 2
    assert chain.parts[1].optimizer is None  # no expert parameters: an empty part
    chain = build_optimizer(DistributedDataParallel(mlp(), config=ZERO), sgd, process_groups=single)
    assert [type(p) for p in chain.parts] == [DistributedOptimizer] * 2


def test_duplicates_are_rejected_and_tied_weights_count_once():
    ddp = DistributedDataParallel(mlp(), config=ZERO)
    with pytest.raises(ValueError, match="appears twice"):
        DistributedOptimizer([ddp, ddp], sgd)
    opt = DistributedOptimizer(ddp, sgd)
    with pytest.raises(ValueError, match="appears twice"):
        ChainedOptimizer([opt, opt])
    with pytest.raises(ValueError, match="bucket_size"):
        DDPConfig(bucket_size=0)
    with pytest.raises(ValueError, match="clip_grad"):
        OptimizerConfig(clip_grad=-1.0)

    # a weight shared by two modules is one parameter: one buffer slot, one update
    def tied():
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
        m[2].weight = m[0].weight
        return m

    model, ref = tied(), tied()
    ddp = DistributedDataParallel(model, config=ZERO)
    assert sum(b.layout.numel for b in ddp.buffers.values()) == 16
    opt = DistributedOptimizer(ddp, lambda g: torch.optim.AdamW(g, lr=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for _ in range(2):
        opt.zero_grad()
        ddp(x).square().sum().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).square().sum().backward()
        ref_opt.step()
    torch.testing.assert_close(model[0].weight, ref[0].weight)


def test_frozen_parameters_are_not_updated():
    model, ref = mlp(), mlp()
    model[0].weight.requires_grad_(False)
    ref[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    ddp = DistributedDataParallel(model, config=ZERO)
    opt = DistributedOptimizer(ddp, lambda g: torch.optim.AdamW(g, lr=0.1))
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(3, 4)
    for _ in range(2):
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).sum().backward()
        ref_opt.step()
    assert torch.equal(model[0].weight, frozen)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def _mismatched_groups():
    pg = init_process_groups(ParallelConfig())
    errors = []
    ddp = DistributedDataParallel(mlp(), config=ZERO, dp_group=None)  # not distributed
    try:
        DistributedOptimizer(ddp, sgd, process_groups=pg)
    except ValueError as e:
        errors.append(str(e))
    only_rank0 = dist.new_group([0])
    try:
        DistributedDataParallel(mlp(), dp_group=only_rank0)
    except ValueError as e:
        errors.append(str(e))
    return errors


@pytest.mark.multirank
def test_mismatched_and_foreign_groups_raise_before_any_collective():
    errors = run_on_ranks(_mismatched_groups, 2, timeout=60)
    assert "mismatched groups" in errors[0][0] and "mismatched groups" in errors[1][0]
    assert len(errors[0]) == 1  # rank 0 is a member of [0]
    assert "not a member" in errors[1][1]


def _rank_without_params(layerwise: bool):
    """pp=2: stage 0 has an MLP, stage 1 a model with no trainable parameters at all."""
    pg = init_process_groups(ParallelConfig(pp=2))
    stage = pg.rank("pp")
    model = mlp() if stage == 0 else nn.Sequential(nn.Tanh())
    cfg = DDPConfig(use_distributed_optimizer=not layerwise, bucket_size=None, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    kind = LayerWiseDistributedOptimizer if layerwise else DistributedOptimizer
    factory = (lambda g: Muon(g, lr=0.05)) if layerwise else sgd
    opt = kind(ddp, factory, config=OptimizerConfig(clip_grad=0.5), process_groups=pg)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    norms = []
    for _ in range(2):
        opt.zero_grad()
        out = ddp(x)
        if stage == 0:
            out.square().sum().backward()
        result = opt.step()
        norms.append(result.grad_norm)
    return stage, norms


@pytest.mark.multirank
@pytest.mark.parametrize("layerwise", [False, True])
def test_rank_without_parameters_joins_the_norm(layerwise):
    (s0, n0), (s1, n1) = run_on_ranks(_rank_without_params, 2, args=(layerwise,), timeout=60)
    assert (s0, s1) == (0, 1)
    assert n0 == n1 and all(n > 0 for n in n0)
    ref = mlp()
    opt = (
        Muon(ref.parameters(), lr=0.05) if layerwise else torch.optim.SGD(ref.parameters(), lr=0.1)
    )
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    want = []
    for _ in range(2):
        opt.zero_grad()
        ref(x).square().sum().backward()
        want.append(float(nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        opt.step()
    assert n0 == pytest.approx(want, rel=1e-5)


def tied_mlp() -> nn.Module:
    """Linear -> tanh -> the same Linear again (one parameter used twice per forward)."""
    torch.manual_seed(3)
    layer = nn.Linear(4, 4)
    return nn.Sequential(layer, nn.Tanh(), layer, nn.Tanh(), nn.Linear(4, 2))


def micro_batches(rank: int) -> torch.Tensor:
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(20 + rank))


def _second_backward_without_no_sync(overlap: bool):
    pg = init_process_groups(ParallelConfig())
    rank = pg.rank("dp")
    model = tied_mlp()
    cfg = DDPConfig(
        use_distributed_optimizer=True, bucket_size=10, overlap_grad_reduce=overlap, pad_multiple=1
    )
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    opt = DistributedOptimizer(ddp, sgd, process_groups=pg)
    x = micro_batches(rank)
    errors = []
    opt.zero_grad()
    ddp(x[0]).square().sum().backward()
    if not overlap:
        ddp.finish_grad_sync()  # without overlap the buckets are launched here
    before = [p.main_grad.clone() for p in model.parameters()]
    try:
        ddp(x[1]).square().sum().backward()
    except RuntimeError as e:
        errors.append(str(e))
    untouched = all(torch.equal(b, p.main_grad) for b, p in zip(before, model.parameters()))
    # the legitimate flow afterwards: accumulation inside no_sync(), then one step
    opt.zero_grad()
    with ddp.no_sync():
        ddp(x[0]).square().sum().backward()
    ddp(x[1]).square().sum().backward()
    assert opt.step().update_successful
    ddp.finish_param_sync()
    return errors, untouched, [p.detach().clone() for p in model.parameters()]


@pytest.mark.multirank
@pytest.mark.parametrize("overlap", [True, False])
def test_second_backward_without_no_sync_raises(overlap):
    results = run_on_ranks(_second_backward_without_no_sync, 2, args=(overlap,), timeout=60)
    ref = tied_mlp()
    for rank in range(2):
        for micro in micro_batches(rank):
            (ref(micro).square().sum() / 2).backward()  # averaged over the 2 DP ranks
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for errors, untouched, params in results:
        assert len(errors) == 1
        assert "no_sync()" in errors[0] and "zero_grad()" in errors[0]
        assert "'4.weight'" in errors[0] or "'4.bias'" in errors[0]  # the first hook to fire
        assert untouched  # nothing was added to the launched buckets
        for got, want in zip(params, ref.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharded", [True, False], ids=["zero", "layerwise"])
def test_factory_must_cover_exactly_the_masters(sharded):
    """Both optimizers reject a factory that leaves masters out (their state would never
    exist and their parameters never update)."""
    kind = DistributedOptimizer if sharded else LayerWiseDistributedOptimizer
    config = ZERO if sharded else DDPConfig()

    def first_group_only(groups):
        return torch.optim.SGD([{"params": groups[0]["params"][:1]}], lr=0.1)

    with pytest.raises(ValueError, match="exactly the param groups"):
        kind(DistributedDataParallel(mlp(), config=config), first_group_only)


@pytest.mark.parametrize("sharded", [True, False], ids=["zero", "layerwise"])
def test_state_numel_counts_adam_moments(sharded):
    """One process owns every parameter: AdamW's two moments per element."""
    model = mlp(1)
    kind = DistributedOptimizer if sharded else LayerWiseDistributedOptimizer
    ddp = DistributedDataParallel(model, config=ZERO if sharded else DDPConfig())
    opt = kind(ddp, lambda groups: torch.optim.AdamW(groups, lr=1e-3))
    assert opt.state_numel() == 0  # no step yet: no state
    ddp(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    assert opt.state_numel() == 2 * sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- argument types and values
DDP_BOOL_FIELDS = (
    "overlap_grad_reduce",
    "use_distributed_optimizer",
    "average_in_collective",
    "average_gradients",
    "grad_reduce_in_fp32",
)


@pytest.mark.parametrize("field", DDP_BOOL_FIELDS)
def test_ddp_config_bools_must_be_bools(field):
    """A string such as "False" is truthy: it used to act as True (silently wrong)."""
    with pytest.raises(TypeError, match=re.escape(f"DDPConfig.{field}='False'; valid: True or")):
        DDPConfig(**{field: "False"})
    with pytest.raises(TypeError, match=re.escape(f"DDPConfig.{field}=1;")):
        DDPConfig(**{field: 1})
    for value in (True, False):
        assert getattr(DDPConfig(**{field: value}), field) is value


def test_average_gradients_false_sums():
    """The audit's case with a real bool: grad_divisor=4 divides only when averaging."""
    for average, want in ((False, 1.0), (True, 0.25)):
        model = nn.Linear(2, 1)
        ddp = DistributedDataParallel(
            model, config=DDPConfig(average_gradients=average), grad_divisor=4
        )
        ddp(torch.ones(1, 2)).sum().backward()
        ddp.finish_grad_sync()
        assert model.bias.main_grad.item() == want


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"bucket_size": 1.5}, TypeError, "DDPConfig.bucket_size=1.5; valid: an int >= 1 or None"),
        ({"bucket_size": "big"}, TypeError, "DDPConfig.bucket_size='big'; valid: an int"),
        ({"bucket_size": True}, TypeError, "DDPConfig.bucket_size=True;"),
        ({"bucket_size": 0}, ValueError, "DDPConfig.bucket_size=0; valid: an int >= 1 or None"),
        ({"pad_multiple": 2.0}, TypeError, "DDPConfig.pad_multiple=2.0; valid: an int >= 1"),
        ({"pad_multiple": 0}, ValueError, "DDPConfig.pad_multiple=0; valid: an int >= 1"),
    ],
)
def test_ddp_config_ints_must_be_ints(kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        DDPConfig(**kwargs)


def test_ddp_config_int_boundaries_are_accepted():
    assert DDPConfig(bucket_size=1, pad_multiple=1).bucket_size == 1
    assert DDPConfig(bucket_size=None).bucket_size is None


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"module": None}, TypeError, "module=None is a NoneType; valid: the nn.Module to wrap"),
        (
            {"config": {"bucket_size": 10}},
            TypeError,
            "config={'bucket_size': 10} is a dict; valid: a DDPConfig",
        ),
        (
            {"process_groups": ParallelConfig()},
            TypeError,
            "process_groups=ParallelConfig(tp=1",
        ),
        ({"grad_divisor": 2.5}, TypeError, "grad_divisor=2.5; valid: an int >= 1 or None"),
        ({"grad_divisor": True}, TypeError, "grad_divisor=True;"),
        ({"grad_divisor": 0}, ValueError, "grad_divisor=0; valid: an int >= 1 or None"),
    ],
)
def test_ddp_arguments_are_type_checked(kwargs, error, text):
    """Each used to fail later with an AttributeError naming no argument (or be accepted)."""
    kwargs = {"module": mlp(), **kwargs}
    with pytest.raises(error, match=re.escape(f"DistributedDataParallel: {text}")):
        DistributedDataParallel(kwargs.pop("module"), **kwargs)


def test_ddp_valid_arguments_are_accepted():
    ddp = DistributedDataParallel(
        mlp(), config=None, process_groups=ProcessGroups.single(), grad_divisor=1
    )
    assert ddp.grad_divisor == 1 and ddp.config == DDPConfig()


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"clip_grad": "1.0"}, TypeError, "OptimizerConfig.clip_grad='1.0'; valid: a real number"),
        ({"clip_grad": float("nan")}, ValueError, "OptimizerConfig.clip_grad=nan; valid:"),
        ({"skip_nonfinite": "False"}, TypeError, "OptimizerConfig.skip_nonfinite='False'"),
        ({"overlap_param_gather": 1}, TypeError, "OptimizerConfig.overlap_param_gather=1"),
        ({"count_zeros": None}, TypeError, "OptimizerConfig.count_zeros=None"),
    ],
)
def test_optimizer_config_fields_are_checked(kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        OptimizerConfig(**kwargs)


def test_optimizer_config_boundaries_are_accepted():
    assert OptimizerConfig(clip_grad=0).clip_grad == 0
    assert OptimizerConfig(clip_grad=float("inf"), skip_nonfinite=False).clip_grad == float("inf")


class ScaleOnly:
    """Has a scale but none of the methods the optimizer calls."""

    scale = 4.0


class DuckScaler:
    """A loss scaler of the user's own: what the optimizers call, nothing more."""

    def __init__(self) -> None:
        self.scale = 4.0
        self.updates: list[bool] = []

    def update(self, found_nonfinite: bool) -> None:
        self.updates.append(found_nonfinite)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


@pytest.mark.parametrize("kind", ["zero", "layerwise", "chained"])
def test_config_and_loss_scaler_are_checked_at_construction(kind):
    """A dict config or a bare number as loss scaler used to construct fine and fail at the
    first step() with an AttributeError."""
    owner = {"zero": "DistributedOptimizer", "layerwise": "LayerWiseDistributedOptimizer"}

    def build(**kwargs):
        if kind == "chained":
            part = DistributedOptimizer(DistributedDataParallel(mlp(), config=ZERO), sgd)
            return ChainedOptimizer([part], **kwargs)
        sharded = kind == "zero"
        ddp = DistributedDataParallel(mlp(), config=ZERO if sharded else DDPConfig())
        return (DistributedOptimizer if sharded else LayerWiseDistributedOptimizer)(
            ddp, sgd, **kwargs
        )

    name = owner.get(kind, "ChainedOptimizer")
    with pytest.raises(
        TypeError, match=re.escape(f"{name}: config={{'clip_grad': 1.0}} is a dict")
    ):
        build(config={"clip_grad": 1.0})
    with pytest.raises(TypeError, match=re.escape(f"{name}: loss_scaler=2.0 is a float without")):
        build(loss_scaler=2.0)
    with pytest.raises(TypeError, match=r"loss_scaler=<.*ScaleOnly.*without update, state_dict"):
        build(loss_scaler=ScaleOnly())
    # valid: a scaler of the package, or any object with what the step calls
    assert build(loss_scaler=ConstantLossScaler(2.0)).loss_scale == 2.0
    scaler = DuckScaler()
    opt = build(loss_scaler=scaler, config=OptimizerConfig(clip_grad=1.0))
    if kind != "chained":
        opt.models[0](torch.randn(3, 4)).sum().backward()
    else:
        opt.parts[0].models[0](torch.randn(3, 4)).sum().backward()
    assert opt.step().update_successful and scaler.updates == [False]


def test_process_groups_of_an_optimizer_are_type_checked():
    ddp = DistributedDataParallel(mlp(), config=ZERO)
    with pytest.raises(
        TypeError, match=re.escape("DistributedOptimizer: process_groups=ParallelConfig(")
    ):
        DistributedOptimizer(ddp, sgd, process_groups=ParallelConfig())


@pytest.mark.parametrize("sharded", [True, False], ids=["zero", "layerwise"])
def test_optimizer_factory_must_be_callable_and_return_an_optimizer(sharded):
    kind = DistributedOptimizer if sharded else LayerWiseDistributedOptimizer
    config = ZERO if sharded else DDPConfig()
    instance = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(
        TypeError, match=rf"{kind.__name__}: optimizer_factory=AdamW .* is an AdamW, not callable"
    ):
        kind(DistributedDataParallel(mlp(), config=config), instance)
    # a rank without masters never calls the factory, but still refuses a non-callable one
    no_params = DistributedDataParallel(nn.Sequential(nn.Tanh()), config=config)
    with pytest.raises(TypeError, match="optimizer_factory='sgd' is a str, not callable"):
        kind(no_params, "sgd")
    with pytest.raises(
        TypeError, match=re.escape("optimizer_factory returned None (a NoneType); valid: a torch")
    ):
        kind(DistributedDataParallel(mlp(), config=config), lambda groups: None)
    assert kind(no_params, sgd).optimizer is None  # valid: a callable, even with nothing to build


def test_chained_parts_must_be_distributed_optimizers():
    with pytest.raises(TypeError, match=r"ChainedOptimizer: parts\[1\]=AdamW .* is an AdamW"):
        ChainedOptimizer(
            [
                DistributedOptimizer(DistributedDataParallel(mlp(), config=ZERO), sgd),
                torch.optim.AdamW(nn.Linear(2, 2).parameters()),
            ]
        )
    layerwise = LayerWiseDistributedOptimizer(DistributedDataParallel(mlp(1)), sgd)
    assert ChainedOptimizer([layerwise]).parts == [layerwise]


def linear_params() -> list[nn.Parameter]:
    return list(nn.Linear(2, 2).parameters())


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"lr": "1e-3"}, TypeError, "AdamW.lr='1e-3'; valid: a finite real number >= 0"),
        ({"lr": float("inf")}, ValueError, "AdamW.lr=inf; valid: a finite real number >= 0"),
        ({"betas": (0.9,)}, ValueError, "AdamW.betas=(0.9,) has 1 entries; valid: a pair"),
        ({"betas": 0.9}, TypeError, "AdamW.betas=0.9; valid: a pair (beta1, beta2)"),
        ({"betas": (0.9, 1.0)}, ValueError, "AdamW.betas[1]=1.0; valid: a finite real number in"),
        ({"betas": (0.9, "0.99")}, TypeError, "AdamW.betas[1]='0.99'; valid:"),
        ({"eps": -1e-8}, ValueError, "AdamW.eps=-1e-08; valid: a finite real number >= 0"),
        ({"weight_decay": -0.1}, ValueError, "AdamW.weight_decay=-0.1; valid: a finite real"),
    ],
)
def test_adamw_arguments_are_checked(kwargs, error, text):
    """betas=(0.9,) used to raise an IndexError; a negative weight decay (which grows the
    weights; torch.optim.AdamW refuses it) used to be accepted."""
    with pytest.raises(error, match=re.escape(text)):
        AdamW(linear_params(), **kwargs)


def test_adamw_param_group_values_are_checked():
    """A group's own value is checked too (param_group_fn overrides end up there), and a
    refused group added later is not kept."""
    with pytest.raises(
        ValueError, match=re.escape("AdamW.param_groups[1]['weight_decay']=-1.0; valid:")
    ):
        AdamW([{"params": linear_params()}, {"params": linear_params(), "weight_decay": -1.0}])
    opt = AdamW(linear_params(), lr=0, betas=[0, 0.999], eps=0, weight_decay=0)  # boundaries
    with pytest.raises(TypeError, match=re.escape("AdamW.param_groups[1]['lr']='0.1'")):
        opt.add_param_group({"params": linear_params(), "lr": "0.1"})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": linear_params(), "lr": 0.1, "betas": (0.5, 0.5)})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"weight_decay": -1.0}, ValueError, "Muon.weight_decay=-1.0; valid: a finite real"),
        ({"lr": "0.02"}, TypeError, "Muon.lr='0.02'; valid: a finite real number >= 0"),
        ({"momentum": 1.0}, ValueError, "Muon.momentum=1.0; valid: a finite real number in [0, 1)"),
        ({"nesterov": "yes"}, TypeError, "Muon.nesterov='yes'; valid: True or False"),
        ({"ns_steps": 5.0}, TypeError, "Muon.ns_steps=5.0; valid: an int >= 1"),
        ({"ns_steps": 0}, ValueError, "Muon.ns_steps=0; valid: an int >= 1"),
        ({"adam_betas": (0.9,)}, ValueError, "Muon.adam_betas=(0.9,) has 1 entries"),
        ({"adam_eps": -1.0}, ValueError, "Muon.adam_eps=-1.0; valid:"),
        ({"use_muon": "True"}, TypeError, "Muon.use_muon='True'; valid: True or False"),
        ({"head_dim": 0}, ValueError, "Muon.head_dim=0; valid: an int >= 1 or None"),
        ({"fused_blocks": 3.0}, TypeError, "Muon.fused_blocks=3.0; valid: an int >= 2 or None"),
    ],
)
def test_muon_arguments_are_checked(kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        Muon(linear_params(), **kwargs)


def test_muon_boundary_values_are_accepted():
    opt = Muon(linear_params(), lr=0, momentum=0, weight_decay=0, ns_steps=1, use_muon=None)
    assert opt.defaults["weight_decay"] == 0
