"""Global gradient norm and zero count: shared embedding counted on the first stage only,
TP-replicated parameters counted once, unused parameters counted as zeros; ZeRO over truly
TP-split parameters (TP=2 x DP=2) against the norm of the full, unsplit gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from shardwork.parallel_state import (
    ParallelConfig,
    ParamMeta,
    copy_to_tp_region,
    init_process_groups,
    reduce_from_tp_region,
    set_param_meta,
)
from shardwork.parallel_state.testing import run_on_ranks


class Stage(nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Parameter(torch.randn(5, 4))  # same values on both stages (tied copy)
        set_param_meta(self.emb, ParamMeta(shared_embedding=True))
        torch.manual_seed(1 + stage)
        self.w = nn.Linear(4, 3)
        self.unused = nn.Parameter(torch.randn(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x @ self.emb).tanh()


def inputs(stage: int) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(10 + stage))


def _norm(tp: int):
    pg = init_process_groups(ParallelConfig(pp=2, tp=tp))
    stage = pg.rank("pp")
    model = Stage(stage)
    cfg = DDPConfig(use_distributed_optimizer=True, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    opt = DistributedOptimizer(
        ddp,
        lambda g: torch.optim.SGD(g, lr=0.1),
        config=OptimizerConfig(count_zeros=True),
        process_groups=pg,
    )
    opt.zero_grad()
    ddp(inputs(stage)).square().sum().backward()
    result = opt.step()
    return result.grad_norm, result.num_zeros_in_grad


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2])
def test_norm_counts_shared_embedding_and_tp_replicas_once(tp):
    results = run_on_ranks(_norm, 2 * tp, args=(tp,))
    grads = []
    for stage in (0, 1):
        m = Stage(stage)
        m(inputs(stage)).square().sum().backward()
        counted = [m.w.weight, m.w.bias] + ([m.emb] if stage == 0 else [])
        grads += [p.grad for p in counted] + [torch.zeros(7)]
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads)).item()
    zeros = sum(int((g == 0).sum()) for g in grads)
    for got_norm, got_zeros in results:
        assert got_norm == pytest.approx(norm, rel=1e-6)
        assert got_zeros == zeros


IN, HID, OUT, BATCH, STEPS = 5, 6, 3, 4, 2


class TPMLP(nn.Module):
    """Column-parallel (w1, b1: rows split) -> tanh -> row-parallel (w2: columns split) + b2
    (replicated over TP); with tp_size=1 the plain full model."""

    def __init__(self, tp_group=None, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(2)
        w1, b1 = torch.randn(HID, IN), torch.randn(HID)
        w2, b2 = torch.randn(OUT, HID) / HID**0.5, torch.randn(OUT)
        rows = slice(tp_rank * HID // tp_size, (tp_rank + 1) * HID // tp_size)
        self.w1, self.b1 = nn.Parameter(w1[rows]), nn.Parameter(b1[rows])
        self.w2, self.b2 = nn.Parameter(w2[:, rows]), nn.Parameter(b2)
        for p in (self.w1, self.b1):
            set_param_meta(p, ParamMeta(tp_axis=0))
        set_param_meta(self.w2, ParamMeta(tp_axis=1))
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(copy_to_tp_region(x, self.tp_group) @ self.w1.T + self.b1)
        return reduce_from_tp_region(h @ self.w2.T, self.tp_group) + self.b2


def tp_data(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return torch.randn(STEPS, dp * BATCH, IN, generator=g), torch.randn(
        STEPS, dp * BATCH, OUT, generator=g
    )


def _tp_split_norm():
    pg = init_process_groups(ParallelConfig(tp=2))
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = TPMLP(pg.tp, 2, pg.rank("tp"))
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=8, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    opt = DistributedOptimizer(ddp, lambda g: torch.optim.SGD(g, lr=0.1), process_groups=pg)
    x, y = tp_data(dp)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[s, local]), y[s, local]).backward()
        norms.append(opt.step().grad_norm)
    return norms


@pytest.mark.multirank
def test_zero_norm_over_tp_split_parameters_equals_full_gradient_norm():
    results = run_on_ranks(_tp_split_norm, 4)
    model = TPMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tp_data(2)
    want = []
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        want.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1e30)))
        opt.step()
    for norms in results:
        assert norms == pytest.approx(want, rel=1e-6)
