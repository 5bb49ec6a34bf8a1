"""Optimizer state saved at one layout loads at another and training continues identically."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
)
from shardwork.dist_optimizer.sharded_state import _count_before, default_param_rects
from shardwork.parallel_state import ParallelConfig, ParamMeta, init_process_groups, set_param_meta
from shardwork.parallel_state.testing import run_on_ranks

dcp = pytest.importorskip("shardwork.dist_checkpoint")

IN, HID, OUT, GLOBAL_BATCH = 7, 13, 5, 12


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(steps, GLOBAL_BATCH, IN, generator=g), torch.randn(
        steps, GLOBAL_BATCH, OUT, generator=g
    )


def adamw(groups):
    return torch.optim.AdamW(groups, lr=2e-2, weight_decay=0.1)


def _train(path: str, first: int, last: int, load: bool, seed: int):
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = build_model(seed)
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=50, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    opt = DistributedOptimizer(ddp, adamw, process_groups=pg)

    def state():
        params = {
            n: dcp.ShardedTensor.from_rank_offsets(f"model.{n}", p.data, replica_id=rank)
            for n, p in model.named_parameters()
        }
        return {"model": params, "optimizer": opt.sharded_state_dict()}

    if load:
        loaded = dcp.load(state(), path)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(loaded["model"][n])
        opt.load_sharded_state_dict(loaded["optimizer"])
    x, y = batches(4)
    per = GLOBAL_BATCH // dp
    for s in range(first, last):
        opt.zero_grad()
        nn.functional.mse_loss(
            ddp(x[s, rank * per : (rank + 1) * per]), y[s, rank * per : (rank + 1) * per]
        ).backward()
        opt.step()
    if not load:
        dcp.save(state(), path)
    ddp.finish_param_sync()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multirank
def test_saved_at_dp4_resumes_at_dp2(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train, 4, args=(path, 0, 2, False, 0))
    resumed = run_on_ranks(_train, 2, args=(path, 2, 4, True, 123))
    model = build_model(0)
    opt = adamw(model.parameters())
    x, y = batches(4)
    for s in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        opt.step()
    for params in resumed:
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_count_before_matches_brute_force():
    shape = (3, 5, 4)
    flat = torch.arange(60).view(shape)
    for axis, lo, hi in [(0, 1, 3), (1, 1, 4), (2, 0, 2), (2, 3, 4)]:
        box = flat.narrow(axis, lo, hi - lo).reshape(-1)
        for p in range(61):
            assert _count_before(shape, axis, lo, hi, p) == int((box < p).sum())


def test_default_rects_for_fused_tp_blocks():
    # fused [gate(2) | up(4)] over TP=2: rank 1 holds gate row 1 and up rows 2:4
    w = torch.nn.Parameter(torch.zeros(3, 4))
    set_param_meta(w, ParamMeta(tp_axis=0, tp_partition_sizes=(2, 4)))
    rects = default_param_rects("w", w, tp_rank=1, tp_size=2)
    assert [(r.global_shape, r.global_offset, r.start, r.stop) for r in rects] == [
        ((6, 4), (1, 0), 0, 1),
        ((6, 4), (4, 0), 1, 3),
    ]
    replicated = default_param_rects("b", torch.nn.Parameter(torch.zeros(4)), tp_rank=1, tp_size=2)
    assert replicated[0].replica_id == 1 and replicated[0].global_shape == (4,)
