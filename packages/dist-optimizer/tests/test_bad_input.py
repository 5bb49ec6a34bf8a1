"""Bad input: clear ValueErrors before any collective, or correct behaviour — never a hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwork.dist_optimizer import (
    ChainedOptimizer,
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
