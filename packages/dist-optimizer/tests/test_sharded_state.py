"""Optimizer state saved at one layout loads at another and training continues identically."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwork.dist_optimizer import (
    AdamW,
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
)
from shardwork.dist_optimizer.param_rects import _count_before, default_param_rects
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


def adamw_bf16(groups):
    """shardwork's AdamW with the moments stored in bf16 (round to nearest after each step)."""
    return AdamW(groups, lr=2e-2, weight_decay=0.1, state_dtype=torch.bfloat16)


def adamw_fused(groups):
    """torch's one-pass AdamW kernel (what shardwork-train runs on CPU and CUDA)."""
    return torch.optim.AdamW(groups, lr=2e-2, weight_decay=0.1, fused=True)


OPTIMIZERS = {"fp32": adamw, "bf16": adamw_bf16, "fp32-fused": adamw_fused}


def state_report(opt: DistributedOptimizer) -> tuple[int, int, set[torch.dtype]]:
    """(state elements, shard elements, dtypes of the tensor states) on this rank."""
    dtypes = {
        v.dtype
        for st in opt.optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim() > 0
    }
    return opt.state_numel(), sum(mp.piece.numel for mp in opt.pieces), dtypes


def _nccl_world_of_one(store_file: str):
    """Leave the pool's gloo world for a one-GPU NCCL world (the process groups a CUDA run has)."""
    dist.destroy_process_group()
    torch.cuda.set_device(0)
    store = dist.FileStore(store_file, 1)
    return init_process_groups(ParallelConfig(), backend="nccl", store=store, rank=0, world_size=1)


def _train(
    path: str,
    first: int,
    last: int,
    load: bool,
    seed: int,
    moments: str = "fp32",
    device: str = "cpu",
):
    if device == "cuda":
        pg = _nccl_world_of_one(f"{path}.store-{first}")
    else:
        pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = build_model(seed).to(device)
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=50, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    opt = DistributedOptimizer(ddp, OPTIMIZERS[moments], process_groups=pg)

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
    x, y = (t.to(device) for t in batches(4))
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
    return [p.detach().cpu() for p in model.parameters()], state_report(opt), step_states(opt)


def step_states(opt: DistributedOptimizer) -> set[tuple[str, torch.dtype, float]]:
    """(device type, dtype, value) of every tensor ``step`` state on this rank."""
    return {
        (v.device.type, v.dtype, float(v))
        for st in opt.optimizer.state.values()
        for k, v in st.items()
        if k == "step" and torch.is_tensor(v)
    }


def unsharded_run(moments: str, device: str = "cpu") -> list[torch.Tensor]:
    model = build_model(0).to(device)
    opt = OPTIMIZERS[moments](model.parameters())
    x, y = (t.to(device) for t in batches(4))
    for s in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def far_elements(got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> int:
    """How many elements of ``got`` differ from ``want`` by more than ``atol``."""
    return sum(int(((g - w).abs() > atol).sum()) for g, w in zip(got, want))


@pytest.mark.multirank
@pytest.mark.parametrize("moments", ["fp32", "bf16", "fp32-fused"])
def test_saved_at_dp4_resumes_at_dp2(tmp_path, moments):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_train, 4, args=(path, 0, 2, False, 0, moments))
    resumed = run_on_ranks(_train, 2, args=(path, 2, 4, True, 123, moments))
    want = unsharded_run(moments)
    dtype = torch.bfloat16 if moments == "bf16" else torch.float32
    for _, (state_numel, shard_numel, dtypes), _ in saved + resumed:
        assert state_numel == 2 * shard_numel and dtypes == {dtype}  # exp_avg, exp_avg_sq
    total = sum(p.numel() for p in want)
    assert sum(r[1][1] for r in saved) == sum(r[1][1] for r in resumed) == total
    for _, _, steps in resumed:  # the loaded step kept its place: CPU tensors, 4 steps taken
        assert {(device, value) for device, _, value in steps} == {("cpu", 4.0)}
    for params, _, _ in resumed:
        if moments != "bf16":
            for got, ref in zip(params, want):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
            continue
        # bf16 moments: both runs round the same per-element values to bf16, but their
        # gradients differ in the last fp32 bits (DP reduction order), which can move a
        # moment across a bf16 rounding boundary (a 2^-8 relative change) and that element
        # by up to about lr·2^-8 ≈ 8e-5 per step. Here none does (measured max 7.5e-8), but
        # another CPU's kernels may: allow 2 such elements, within 2e-4; everything else to
        # 1e-6, the fp32 tolerance. Storing fp32 moments instead moves most elements.
        assert far_elements(params, want, 1e-6) <= 2
        assert far_elements(params, want, 2e-4) == 0
    if moments == "bf16":
        assert far_elements(unsharded_run("fp32"), want, 1e-6) > total // 2


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NCCL world)")
def test_fused_adamw_on_a_gpu_resumes_with_its_step_on_the_gpu(tmp_path):
    """What shardwork-train runs on CUDA: torch's fused AdamW, whose ``step`` is a CUDA float32
    tensor that a resumed run must restore there (the fused kernel refuses a CPU step)."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train, 1, args=(path, 0, 2, False, 0, "fp32-fused", "cuda"))
    ((params, _, steps),) = run_on_ranks(
        _train, 1, args=(path, 2, 4, True, 9, "fp32-fused", "cuda")
    )
    assert steps == {("cuda", torch.float32, 4.0)}
    for got, ref in zip(params, unsharded_run("fp32-fused", "cuda"), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


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


def test_flat_piece_entries_select_the_right_elements_for_any_axis():
    from shardwork.dist_optimizer.param_rects import ParamRect, piece_entries

    shape = (3, 6)
    local = torch.arange(18.0).view(shape)
    for axis, blocks in [(1, (2, 4)), (0, (1, 2))]:
        rects, start = [], 0
        for size in blocks:
            rects.append(ParamRect("k", shape, (0, 0), axis, start, start + size))
            start += size
        for a in range(18):
            for b in range(a + 1, 19):
                piece = local.view(-1)[a:b]
                seen = 0
                for rect, _bshape, (fa, fb), selector in piece_entries(rects, shape, a, b):
                    box = local.narrow(axis, rect.start, rect.stop - rect.start).reshape(-1)
                    assert torch.equal(piece[selector], box[fa:fb])
                    seen += fb - fa
                assert seen == b - a


# ---------------------------------------------------------------- TP=2 -> TP=1 resharding
FF, HID2, IN2, B2 = 4, 8, 6, 4


class GatedMLP(nn.Module):
    """tanh(W1 x + b1) -> column-parallel fused [gate | up] -> silu(gate) * up."""

    def __init__(self, seed: int, tp_group=None, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        from shardwork.parallel_state import ParamMeta, set_param_meta

        torch.manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(HID2, IN2) / IN2**0.5)
        self.b1 = nn.Parameter(torch.randn(HID2) * 0.1)
        gate, up = (torch.randn(2 * FF, HID2) / HID2**0.5).split(FF)
        rows = slice(tp_rank * FF // tp_size, (tp_rank + 1) * FF // tp_size)
        self.w2 = nn.Parameter(torch.cat([gate[rows], up[rows]]))
        set_param_meta(self.w2, ParamMeta(tp_axis=0, tp_partition_sizes=(FF, FF)))
        self.tp_group = tp_group

    def forward(self, x):
        from shardwork.parallel_state import copy_to_tp_region, gather_from_tp_region

        h = copy_to_tp_region(torch.tanh(x @ self.w1.T + self.b1), self.tp_group)
        gate, up = (h @ self.w2.T).chunk(2, dim=-1)
        return gather_from_tp_region(nn.functional.silu(gate) * up, self.tp_group)


def gated_data():
    g = torch.Generator().manual_seed(8)
    return torch.randn(4, 2 * B2, IN2, generator=g), torch.randn(4, 2 * B2, FF, generator=g)


def _gated_train(path: str, tp: int, first: int, last: int, load: bool, layerwise: bool):
    from shardwork.dist_optimizer import LayerWiseDistributedOptimizer, Muon

    pg = init_process_groups(ParallelConfig(tp=tp))
    dp, rank, tp_rank = pg.size("dp"), pg.rank("dp"), pg.rank("tp")
    model = GatedMLP(99 if load else 0, pg.tp, tp, tp_rank)
    cfg = DDPConfig(use_distributed_optimizer=not layerwise, bucket_size=40, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    if layerwise:
        opt = LayerWiseDistributedOptimizer(
            ddp, lambda g: Muon(g, lr=0.05, tp_group=pg.tp), process_groups=pg
        )
    else:
        opt = DistributedOptimizer(ddp, adamw, process_groups=pg)
    if load:
        loaded = dcp.load({"optimizer": opt.sharded_state_dict()}, path)
        opt.load_sharded_state_dict(loaded["optimizer"])  # fp32 masters restore the params
    x, y = gated_data()
    per = 2 * B2 // dp
    for s in range(first, last):
        opt.zero_grad()
        local = slice(rank * per, (rank + 1) * per)
        nn.functional.mse_loss(ddp(x[s, local]), y[s, local]).backward()
        opt.step()
    if not load:
        dcp.save({"optimizer": opt.sharded_state_dict()}, path)
    ddp.finish_param_sync()
    if layerwise:
        opt.finish_param_sync()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multirank
@pytest.mark.parametrize("layerwise", [False, True])
def test_saved_at_tp2_dp2_resumes_at_tp1_dp2(tmp_path, layerwise):
    from shardwork.dist_optimizer import Muon

    path = str(tmp_path / "ckpt")
    run_on_ranks(_gated_train, 4, args=(path, 2, 0, 2, False, layerwise))
    resumed = run_on_ranks(_gated_train, 2, args=(path, 1, 2, 4, True, layerwise))
    model = GatedMLP(0)
    opt = Muon(model.parameters(), lr=0.05) if layerwise else adamw(model.parameters())
    x, y = gated_data()
    for s in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        opt.step()
    for params in resumed:
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_rects_from_model_state_takes_keys_and_offsets_not_dp_replicas():
    from shardwork.dist_optimizer import rects_from_model_state

    w = torch.nn.Parameter(torch.zeros(3, 4))
    set_param_meta(w, ParamMeta(tp_axis=0, tp_partition_sizes=(2, 4)))
    b = torch.nn.Parameter(torch.zeros(4))
    experts = torch.nn.Parameter(torch.zeros(2, 5))
    set_param_meta(experts, ParamMeta(is_expert=True))
    model_state = {
        "w": [
            dcp.ShardedTensor("layer.gate", torch.zeros(1, 4), (2, 4), (1, 0), replica_id=3),
            dcp.ShardedTensor("layer.up", torch.zeros(2, 4), (4, 4), (2, 0), replica_id=3),
        ],
        "b": dcp.ShardedTensor("layer.b", torch.zeros(4), (4,), (0,), replica_id=3),
        # local experts 0..1 of ep rank 1 are global experts 2..3
        "experts": dcp.ShardedTensor("moe.w", torch.zeros(2, 5), (4, 5), (2, 0), replica_id=1),
    }
    fn = rects_from_model_state(model_state, tp_rank=1)
    assert [
        (r.key, r.global_offset, r.axis, r.start, r.stop, r.replica_id) for r in fn("w", w)
    ] == [
        ("layer.gate", (1, 0), 0, 0, 1, 0),
        ("layer.up", (2, 0), 0, 1, 3, 0),
    ]
    assert fn("b", b)[0].replica_id == 1  # TP replica, whatever the model's DP replica id
    assert fn("experts", experts)[0].global_offset == (2, 0)
    with pytest.raises(ValueError, match="no model ShardedTensor"):
        fn("missing", b)
