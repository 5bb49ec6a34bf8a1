"""Global gradient norm and zero count: shared embedding counted on the first stage only,
TP-replicated parameters counted once, unused parameters counted as zeros."""

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
from shardwork.parallel_state import ParallelConfig, ParamMeta, init_process_groups, set_param_meta
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
