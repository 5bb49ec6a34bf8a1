"""DDP + DistributedOptimizer(AdamW) at DP=2/4 equals single-process torch.optim.AdamW."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
)
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

IN, HID, OUT, BATCH, STEPS = 7, 13, 5, 3, 3


def build_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT)).to(dtype)


def make_data(dp: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, accum, dp * BATCH, IN, generator=g)
    y = torch.randn(STEPS, accum, dp * BATCH, OUT, generator=g)
    return x, y


def adamw(groups):
    return torch.optim.AdamW(groups, lr=3e-2, weight_decay=0.1)


def reference(dp: int, accum: int, clip: float) -> tuple[list[torch.Tensor], list[float]]:
    model = build_model()
    opt = adamw(model.parameters())
    x, y = make_data(dp, accum)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(accum):
            loss = nn.functional.mse_loss(model(x[s, m]), y[s, m]) / accum
            loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip if clip else 1e30)))
        opt.step()
    return [p.detach() for p in model.parameters()], norms


def _run_zero(accum: int, clip: float, overlap: bool, bucket_size: int, in_collective: bool):
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = build_model()
    ddp = DistributedDataParallel(
        model,
        config=DDPConfig(
            use_distributed_optimizer=True,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap,
            average_in_collective=in_collective,
            pad_multiple=1,
        ),
        process_groups=pg,
    )
    opt = DistributedOptimizer(
        ddp,
        adamw,
        config=OptimizerConfig(clip_grad=clip, overlap_param_gather=overlap),
        process_groups=pg,
    )
    x, y = make_data(dp, accum)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(accum):
            ctx = ddp.no_sync() if m < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = nn.functional.mse_loss(ddp(x[s, m, local]), y[s, m, local]) / accum
                loss.backward()
        result = opt.step()
        assert result.update_successful
        norms.append(result.grad_norm)
    ddp.finish_param_sync()
    shard = sum(mp.piece.numel for mp in opt.pieces)
    buffer = next(iter(ddp.buffers.values()))
    straddling = {
        i
        for i in range(len(buffer.params))
        if len(
            {r for r in range(dp) for pc in buffer.layout.shard_pieces(r) if pc.param_index == i}
        )
        > 1
    }
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "norms": norms,
        "state_numel": opt.state_numel(),
        "shard_numel": shard,
        "num_straddling": len(straddling),
    }


CASES = [
    # dp, accum, clip, overlap, bucket_size, average_in_collective
    (2, 1, 0.0, True, 40, False),
    (2, 1, 0.0, False, 40, True),
    (4, 1, 0.0, True, 40, True),
    (4, 3, 0.0, True, 40, False),
    (2, 2, 0.05, True, None, False),
    (4, 1, 0.05, False, 40, False),
]


@pytest.mark.multirank
@pytest.mark.parametrize(("dp", "accum", "clip", "overlap", "bucket_size", "in_coll"), CASES)
def test_zero_adamw_matches_single_process(dp, accum, clip, overlap, bucket_size, in_coll):
    results = run_on_ranks(
        _run_zero, dp, args=(accum, clip, overlap, bucket_size, in_coll), timeout=120
    )
    ref_params, ref_norms = reference(dp, accum, clip)
    for r in results:
        for got, want in zip(r["params"], ref_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        # AdamW keeps exp_avg and exp_avg_sq for exactly this rank's shard.
        assert r["state_numel"] == 2 * r["shard_numel"]
    total = sum(p.numel() for p in ref_params)
    assert sum(r["shard_numel"] for r in results) == total
    assert results[0]["num_straddling"] >= 1


def _run_chunks():
    """Two model chunks (virtual pipeline stages on one rank) under one optimizer."""
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = build_model()
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=40, pad_multiple=1)
    chunks = [
        DistributedDataParallel(model[:2], config=cfg, process_groups=pg),
        DistributedDataParallel(model[2:], config=cfg, process_groups=pg),
    ]
    opt = DistributedOptimizer(
        chunks, adamw, config=OptimizerConfig(clip_grad=0.05), process_groups=pg
    )
    x, y = make_data(dp, 1)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(chunks[1](chunks[0](x[s, 0, local])), y[s, 0, local]).backward()
        opt.step()
    for c in chunks:
        c.finish_param_sync()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multirank
def test_two_model_chunks_under_one_optimizer():
    results = run_on_ranks(_run_chunks, 2)
    ref_params, _ = reference(2, 1, 0.05)
    for params in results:
        for got, want in zip(params, ref_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
