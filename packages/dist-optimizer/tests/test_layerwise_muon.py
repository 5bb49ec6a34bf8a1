"""Layer-wise distributed Muon equals single-process Muon (DP=2, and DP=2 x TP=2 with a
fused [gate | up] weight split over TP); Newton–Schulz and owner assignment unit tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    LayerWiseDistributedOptimizer,
    Muon,
    OptimizerConfig,
)
from shardwork.dist_optimizer.muon import newton_schulz, orthogonalize
from shardwork.parallel_state import (
    ParallelConfig,
    ParamMeta,
    copy_to_tp_region,
    gather_from_tp_region,
    init_process_groups,
    set_param_meta,
)
from shardwork.parallel_state.testing import run_on_ranks

IN, HID, FF, BATCH, STEPS = 6, 8, 4, 3, 3


class GatedMLP(nn.Module):
    """x -> tanh(W1 x + b1) -> [gate | up] = W2 h (column-parallel over TP) -> silu(gate)*up."""

    def __init__(self, tp_group=None, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(HID, IN) / IN**0.5)
        self.b1 = nn.Parameter(torch.randn(HID) * 0.1)
        w2 = torch.randn(2 * FF, HID) / HID**0.5
        gate, up = w2.split(FF)
        local = FF // tp_size
        rows = slice(tp_rank * local, (tp_rank + 1) * local)
        self.w2 = nn.Parameter(torch.cat([gate[rows], up[rows]]))
        set_param_meta(self.w2, ParamMeta(tp_axis=0, tp_partition_sizes=(FF, FF)))
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w1.T + self.b1)
        h = copy_to_tp_region(h, self.tp_group)
        gate, up = (h @ self.w2.T).chunk(2, dim=-1)
        return gather_from_tp_region(nn.functional.silu(gate) * up, self.tp_group)


def data(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(STEPS, dp * BATCH, IN, generator=g), torch.randn(
        STEPS, dp * BATCH, FF, generator=g
    )


def muon(groups, tp_group=None):
    return Muon(groups, lr=0.05, momentum=0.9, weight_decay=0.01, tp_group=tp_group)


def reference(dp: int, clip: float) -> list[torch.Tensor]:
    model = GatedMLP()
    opt = muon(model.parameters())
    x, y = data(dp)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach() for p in model.parameters()]


def _run_layerwise(tp: int, clip: float, overlap: bool):
    pg = init_process_groups(ParallelConfig(tp=tp))
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = GatedMLP(pg.tp, tp, pg.rank("tp"))
    ddp = DistributedDataParallel(model, config=DDPConfig(bucket_size=20), process_groups=pg)
    opt = LayerWiseDistributedOptimizer(
        ddp,
        lambda groups: muon(groups, pg.tp),
        config=OptimizerConfig(clip_grad=clip, overlap_param_gather=overlap),
        process_groups=pg,
    )
    x, y = data(dp)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[s, local]), y[s, local]).backward()
        assert opt.step().update_successful
    opt.finish_param_sync()
    return [p.detach().clone() for p in model.parameters()], pg.rank("tp"), len(opt.owned)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("tp", "world", "clip", "overlap"), [(1, 2, 0.0, True), (2, 4, 0.0, False), (2, 4, 0.5, True)]
)
def test_layerwise_muon_matches_single_process(tp, world, clip, overlap):
    results = run_on_ranks(_run_layerwise, world, args=(tp, clip, overlap))
    w1, b1, w2 = reference(world // tp, clip)
    gate, up = w2.split(FF)
    local = FF // tp
    for params, tp_rank, _ in results:
        rows = slice(tp_rank * local, (tp_rank + 1) * local)
        torch.testing.assert_close(params[0], w1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params[1], b1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            params[2], torch.cat([gate[rows], up[rows]]), rtol=1e-5, atol=1e-6
        )
    # every data-parallel rank owns something, each parameter exactly once per TP rank
    assert sum(n for *_, n in results) == 3 * tp


def test_newton_schulz_orthogonalises():
    g = torch.randn(12, 20, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.6 and s.max() < 1.25  # NS5 pushes all singular values into ~[0.7, 1.2]
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity(
        newton_schulz(g).flatten(), (u @ vh).flatten(), dim=0
    )
    assert cos > 0.98


def test_orthogonalize_splits_fused_blocks():
    g = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    meta = ParamMeta(tp_axis=0, tp_partition_sizes=(4, 6))
    got = orthogonalize(g, meta)
    want = torch.cat([newton_schulz(g[:4]), newton_schulz(g[4:]) * (6 / 6) ** 0.5])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, orthogonalize(g, ParamMeta()))


def test_assign_owners_balances_by_size():
    owners = LayerWiseDistributedOptimizer.assign_owners([100, 60, 50, 40, 10], 2)
    load = [sum(n for n, o in zip([100, 60, 50, 40, 10], owners) if o == r) for r in range(2)]
    assert owners[0] == 0 and sorted(load) == [120, 140]


def test_orthogonalize_per_head():
    g = torch.randn(12, 5, generator=torch.Generator().manual_seed(2))
    meta = ParamMeta(tp_axis=0, tp_partition_sizes=(8, 4))  # [Q (2 heads) | K (1 head)]
    got = orthogonalize(g, meta, head_dim=4)
    want = torch.cat([newton_schulz(h) for h in g.split(4)])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="head_dim"):
        orthogonalize(g, meta, head_dim=3)
    # as a param-group option of the optimizer
    p = torch.nn.Parameter(torch.randn(12, 5))
    set_param_meta(p, meta)
    q = torch.nn.Parameter(p.detach().clone())
    set_param_meta(q, meta)
    for param, head_dim in ((p, 4), (q, None)):
        opt = Muon(
            [{"params": [param], "head_dim": head_dim}], lr=0.1, momentum=0.0, nesterov=False
        )
        param.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), q.detach() + 0.1 * orthogonalize(g, meta) - 0.1 * want)
