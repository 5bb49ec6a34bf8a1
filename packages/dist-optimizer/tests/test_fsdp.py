"""FullyShardedDataParallel + FSDPOptimizer(AdamW) equal single-process torch.optim.AdamW.

The model is three residual blocks between an input and an output projection, with row
counts that do not divide the data-parallel size (13 rows over 4 ranks: 4, 4, 4, 1; the head's
3-row bias leaves rank 3 without rows). Each rank's loss is its micro-batch mean divided by
DP and by the number of micro-batches, so the summed FSDP gradient is the global mean's.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    FSDPConfig,
    FSDPOptimizer,
    FullyShardedDataParallel,
    Muon,
    OptimizerConfig,
    build_optimizer,
)
from shardwork.parallel_state import (
    ParallelConfig,
    ParamMeta,
    all_to_all,
    get_param_meta,
    has_param_meta,
    init_process_groups,
    set_param_meta,
)
from shardwork.parallel_state.testing import run_on_ranks

dcp = pytest.importorskip("shardwork.dist_checkpoint")

IN, HID, OUT, BATCH, STEPS = 6, 13, 3, 3, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HID, HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, HID)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(HID, OUT)
        self.to(dtype)
        # A described parameter: its metadata must survive sharding.
        set_param_meta(self.blocks[1].lin.weight, ParamMeta(tp_axis=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def data(dp: int, accum: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, accum, dp * BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, accum, dp * BATCH, OUT, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def adamw(groups):
    return torch.optim.AdamW(groups, lr=3e-2, weight_decay=0.1)


def reference(dp: int, accum: int, clip: float, dtype=torch.float64):
    model = Net(dtype)
    opt = adamw(model.parameters())
    x, y = data(dp, accum, dtype)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(accum):
            (nn.functional.mse_loss(model(x[s, m]), y[s, m]) / accum).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip or 1e30)))
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, norms


def _step(model, opt, x, y, *, rank: int, dp: int, accum: int, probe=None):
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    opt.zero_grad()
    for m in range(accum):
        ctx = model.no_sync() if m < accum - 1 else contextlib.nullcontext()
        with ctx:
            out = model(x[m, local])
            if probe is not None:
                probe(m)
            (nn.functional.mse_loss(out, y[m, local]) / (accum * dp)).backward()
    return opt.step()


def _run_fsdp(accum: int, clip: float, config: FSDPConfig, dtype: torch.dtype):
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    net = Net(dtype)
    before = {n: get_param_meta(p) for n, p in net.named_parameters()}
    model = FullyShardedDataParallel(net, blocks=list(net.blocks), config=config, process_groups=pg)
    opt = FSDPOptimizer(model, adamw, config=OptimizerConfig(clip_grad=clip), process_groups=pg)
    seen = {"unsharded_between": None, "grads_after_no_sync": []}

    def probe(m: int) -> None:
        # between this micro-batch's forward and backward: is a block's weight still gathered?
        seen["unsharded_between"] = not isinstance(net.blocks[0].lin.weight, DTensor)
        if m > 0:  # the previous micro-batch's backward ran under no_sync (or reduced)
            sharded = next(
                p for p in model.params if model.param_names[id(p)] == "blocks.0.lin.weight"
            )
            seen["grads_after_no_sync"].append(sharded.grad is not None)

    x, y = data(dp, accum, dtype)
    norms = [
        _step(model, opt, x[s], y[s], rank=rank, dp=dp, accum=accum, probe=probe).grad_norm
        for s in range(STEPS)
    ]
    return {
        "params": {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()},
        "norms": norms,
        "all_dtensor": all(isinstance(p, DTensor) for p in net.parameters()),
        "meta_kept": all(
            has_param_meta(p) == (n == "blocks.1.lin.weight") and get_param_meta(p) == before[n]
            for n, p in net.named_parameters()
        ),
        "rows": {n: p.to_local().shape[0] for n, p in net.named_parameters()},
        "state_numel": opt.state_numel(),
        "local_numel": sum(rm.master.numel() for rm in opt.pieces),
        "dtypes": {(str(p.dtype), str(p.grad.dtype)) for p in net.parameters()},
        **seen,
    }


CASES = [
    # dp, accum, clip, config, id
    (2, 1, 0.0, FSDPConfig(), "dp2"),
    (4, 3, 0.0, FSDPConfig(), "dp4-accum3"),
    (4, 3, 0.05, FSDPConfig(reduce_per_micro_batch=True), "dp4-accum3-per-micro-clip"),
    (2, 2, 0.05, FSDPConfig(reshard_after_forward=False, forward_prefetch=2), "dp2-zero2"),
    (2, 1, 0.0, FSDPConfig(forward_prefetch=0, backward_prefetch=0), "dp2-no-prefetch"),
]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("dp", "accum", "clip", "config"), [c[:4] for c in CASES], ids=[c[4] for c in CASES]
)
def test_fsdp_adamw_matches_single_process(dp, accum, clip, config):
    results = run_on_ranks(_run_fsdp, dp, args=(accum, clip, config, torch.float64), timeout=180)
    want, want_norms = reference(dp, accum, clip)
    for rank, r in enumerate(results):
        for name, value in want.items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-12, atol=1e-13)
        assert r["norms"] == pytest.approx(want_norms, rel=1e-12)
        assert r["all_dtensor"] and r["meta_kept"]
        # torch.chunk's split of every parameter's rows (13 -> 4,4,4,1 at DP=4; 3 -> 1,1,1,0)
        chunks = {n: len(torch.arange(v.shape[0]).chunk(dp)) for n, v in want.items()}
        expect_rows = {
            n: (v.shape[0] + dp - 1) // dp
            if rank < chunks[n] - 1
            else (
                v.shape[0] - (chunks[n] - 1) * ((v.shape[0] + dp - 1) // dp)
                if rank == chunks[n] - 1
                else 0
            )
            for n, v in want.items()
        }
        assert r["rows"] == expect_rows
        assert r["state_numel"] == 2 * r["local_numel"]  # AdamW moments for the local rows only
        assert r["dtypes"] == {("torch.float64", "torch.float64")}
        assert r["unsharded_between"] == (not config.reshard_after_forward)
        # under no_sync nothing is reduced: no sharded gradient until the last backward
        assert r["grads_after_no_sync"] == [config.reduce_per_micro_batch] * (accum - 1) * STEPS
    assert sum(r["local_numel"] for r in results) == sum(v.numel() for v in want.values())
    assert results[-1]["rows"]["head.bias"] == (0 if dp == 4 else 1)


def reference_mixed(dp: int):
    """What FSDP(param_dtype=bf16, reduce_dtype=fp32) computes, in one process: fp32 masters;
    each rank's micro-batch runs through a bf16 copy of them; the bf16 gradients are summed in
    fp32 and AdamW steps the masters."""
    masters = Net(torch.float32)
    opt = adamw(masters.parameters())
    x, y = data(dp, 1, torch.float32)
    for s in range(STEPS):
        total = [torch.zeros_like(p) for p in masters.parameters()]
        for r in range(dp):
            rows = slice(r * BATCH, (r + 1) * BATCH)
            low = copy.deepcopy(masters).to(torch.bfloat16)
            out = low(x[s, 0, rows].to(torch.bfloat16))
            (nn.functional.mse_loss(out, y[s, 0, rows]) / dp).backward()
            for t, p in zip(total, low.parameters()):
                t += p.grad.float()
        for p, t in zip(masters.parameters(), total):
            p.grad = t
        opt.step()
    return {n: p.detach() for n, p in masters.named_parameters()}


@pytest.mark.multirank
def test_mixed_precision_bf16_compute_fp32_masters_and_reduction():
    config = FSDPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = run_on_ranks(_run_fsdp, 2, args=(1, 0.0, config, torch.float32), timeout=180)
    want = reference_mixed(2)
    fp32, _ = reference(2, 1, 0.0, torch.float32)
    gathered = run_on_ranks(_gathered_dtype, 2, timeout=60)
    for r in results:
        # fp32 sharded parameters are the masters and gradients arrive reduced in fp32
        assert r["dtypes"] == {("torch.float32", "torch.float32")}
        for name, value in want.items():
            # only the fp32 summation order may differ from the emulation
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-6)
        # bf16 really computed: the all-fp32 run lands elsewhere (by ~0.07 here)
        assert max((r["params"][n] - v).abs().max().item() for n, v in fp32.items()) > 1e-3
    assert gathered == ["torch.bfloat16"] * 2


def _gathered_dtype():
    pg = init_process_groups(ParallelConfig())
    net = Net(torch.float32)
    config = FSDPConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FullyShardedDataParallel(net, blocks=list(net.blocks), config=config, process_groups=pg)
    seen = []
    net.blocks[0].lin.register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))
    model(torch.randn(2, IN))
    return seen[0]


# --- experts over edp ---------------------------------------------------------------------


class ExpertNet(nn.Module):
    """Dense in/out projections around two expert linears, one per expert-parallel rank (a token
    goes to expert 1 when its first feature is positive, through an all-to-all), as in
    test_expert_chained."""

    def __init__(self, ep_group=None, ep_rank: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.inp = nn.Linear(IN, HID, dtype=torch.float64)
        experts = [nn.Linear(HID, HID, dtype=torch.float64) for _ in range(2)]
        self.out = nn.Linear(HID, OUT, dtype=torch.float64)
        self.ep_group = ep_group
        self.experts = nn.ModuleList(experts if ep_rank is None else [experts[ep_rank]])
        for p in self.experts.parameters():
            set_param_meta(p, ParamMeta(is_expert=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        e = (x[:, 0] > 0).long()  # a token's expert depends on the token only
        if self.ep_group is None:
            y = torch.stack([self.experts[int(k)](h[i]) for i, k in enumerate(e)])
        else:
            order = torch.argsort(e, stable=True)
            send = torch.bincount(e, minlength=2)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.ep_group)
            send, recv = send.tolist(), recv.tolist()
            hr = all_to_all(h[order], self.ep_group, output_splits=recv, input_splits=send)
            ys = all_to_all(
                self.experts[0](hr), self.ep_group, output_splits=send, input_splits=recv
            )
            y = ys[torch.argsort(order)]
        return self.out(torch.tanh(y))


def _run_experts():
    pg = init_process_groups(ParallelConfig(ep=2))
    dp, rank = pg.size("dp"), pg.rank("dp")
    net = ExpertNet(pg.ep, pg.rank("ep"))
    model = FullyShardedDataParallel(net, blocks=[], process_groups=pg)
    chain = build_optimizer(model, adamw, process_groups=pg)
    x, y = data(dp, 1, torch.float64)
    for s in range(STEPS):
        _step(model, chain, x[s], y[s], rank=rank, dp=dp, accum=1)
    meshes = {n: p.device_mesh.size() for n, p in net.named_parameters()}
    return (
        pg.rank("ep"),
        {n: p.full_tensor().clone() for n, p in net.named_parameters()},
        meshes,
        [type(part).__name__ for part in chain.parts],
    )


@pytest.mark.multirank
def test_expert_parameters_shard_over_edp_and_match_single_process():
    results = run_on_ranks(_run_experts, 4, timeout=180)
    ref = ExpertNet()
    opt = adamw(ref.parameters())
    x, y = data(4, 1, torch.float64)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ref(x[s, 0]), y[s, 0]).backward()
        opt.step()
    want = dict(ref.named_parameters())
    for ep_rank, params, meshes, parts in results:
        assert parts == ["FSDPOptimizer", "FSDPOptimizer"]
        # dense parameters over dp×cp (4 ranks), each rank's expert over edp (2 ranks)
        assert meshes == {n: 2 if n.startswith("experts") else 4 for n in params}
        for name, value in params.items():
            if name.startswith("experts"):
                name = name.replace("experts.0", f"experts.{ep_rank}")
            torch.testing.assert_close(value, want[name].detach(), rtol=1e-12, atol=1e-13)


# --- checkpoints: FSDP DP=4 -> FSDP DP=2 and ZeRO-1 DP=2 ----------------------------------


def _train_and_save(path: str, kind: str, load: bool):
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    net = Net(torch.float64)
    if kind == "fsdp":
        model = FullyShardedDataParallel(net, blocks=list(net.blocks), process_groups=pg)
        opt = FSDPOptimizer(model, adamw, process_groups=pg)
    else:
        # summing, as FSDP does: each rank's loss is already divided by DP
        cfg = DDPConfig(
            use_distributed_optimizer=True, bucket_size=50, pad_multiple=1, average_gradients=False
        )
        model = DistributedDataParallel(net, config=cfg, process_groups=pg)
        opt = DistributedOptimizer(model, adamw, process_groups=pg)
    x, y = data(dp, 1, torch.float64)
    steps = range(2, STEPS) if load else range(2)
    if load:
        opt.load_sharded_state_dict(
            dcp.load({"optimizer": opt.sharded_state_dict()}, path)["optimizer"]
        )
    for s in steps:
        _step(model, opt, x[s], y[s], rank=rank, dp=dp, accum=1)
    if not load:
        dcp.save({"optimizer": opt.sharded_state_dict()}, path)
    opt.finish_param_sync()
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in net.named_parameters()
    }


@pytest.mark.multirank
@pytest.mark.parametrize("resume_kind", ["fsdp", "zero1"])
def test_fsdp_state_resumes_at_another_size_and_under_zero1(tmp_path, resume_kind):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train_and_save, 4, args=(path, "fsdp", False), timeout=180)
    results = run_on_ranks(_train_and_save, 2, args=(path, resume_kind, True), timeout=180)
    want = _mixed_reference()
    for params in results:
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=1e-12, atol=1e-13)


def _mixed_reference():
    """Two steps on the DP=4 batches, then one on the DP=2 batch (what the resumed run sees)."""
    model = Net(torch.float64)
    opt = adamw(model.parameters())
    x4, y4 = data(4, 1, torch.float64)
    x2, y2 = data(2, 1, torch.float64)
    for s in range(STEPS):
        x, y = (x4, y4) if s < 2 else (x2, y2)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s, 0]), y[s, 0]).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


# --- non-finite gradients -----------------------------------------------------------------


def _nonfinite_step():
    pg = init_process_groups(ParallelConfig())
    net = Net(torch.float64)
    model = FullyShardedDataParallel(net, blocks=list(net.blocks), process_groups=pg)
    opt = FSDPOptimizer(model, adamw, config=OptimizerConfig(clip_grad=1.0), process_groups=pg)
    before = {n: p.full_tensor().clone() for n, p in net.named_parameters()}
    x = torch.randn(BATCH, IN, dtype=torch.float64)
    if pg.rank("dp") == 1:
        x[0, 0] = float("inf")  # one rank's gradient goes non-finite
    opt.zero_grad()
    model(x).square().mean().backward()
    result = opt.step()
    after = {n: p.full_tensor() for n, p in net.named_parameters()}
    return (
        result.update_successful,
        result.grad_norm,
        all(torch.equal(before[n], after[n]) for n in before),
    )


@pytest.mark.multirank
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank():
    for ok, norm, unchanged in run_on_ranks(_nonfinite_step, 2, timeout=120):
        assert not ok and norm is None and unchanged


# --- refusals -----------------------------------------------------------------------------


def _refusals():
    pg = init_process_groups(ParallelConfig())
    out = {}
    net = Net(torch.float64)
    net.head.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'head\.bias' is frozen") as e:
        FullyShardedDataParallel(net, blocks=list(net.blocks), process_groups=pg)
    out["frozen"] = str(e.value)
    net = Net(torch.float64)
    with pytest.raises(ValueError, match="not a submodule") as e:
        FullyShardedDataParallel(net, blocks=[nn.Linear(2, 2)], process_groups=pg)
    out["foreign"] = str(e.value)
    with pytest.raises(ValueError, match=r"blocks\[1\] lies inside blocks\[0\]"):
        FullyShardedDataParallel(net, blocks=[net.blocks[0], net.blocks[0].lin], process_groups=pg)
    mixed = Net(torch.float64)
    set_param_meta(mixed.head.weight, ParamMeta(is_expert=True))
    with pytest.raises(ValueError, match="'head' holds expert and dense parameters directly"):
        FullyShardedDataParallel(mixed, blocks=list(mixed.blocks), process_groups=pg)
    net = Net(torch.float64)
    model = FullyShardedDataParallel(net, blocks=list(net.blocks), process_groups=pg)
    with pytest.raises(ValueError, match="Muon, which orthogonalises whole matrices") as e:
        FSDPOptimizer(model, lambda groups: Muon(groups, lr=0.02), process_groups=pg)
    out["muon"] = str(e.value)
    return out


@pytest.mark.multirank
def test_bad_input_is_refused_before_training():
    out, _ = run_on_ranks(_refusals, 2, timeout=120)
    assert "valid: a model whose parameters all train" in out["frozen"]
    assert "LayerWiseDistributedOptimizer" in out["muon"]


def test_config_and_missing_group_refused():
    with pytest.raises(ValueError, match=r"FSDPConfig.forward_prefetch=-1; valid: an int >= 0"):
        FSDPConfig(forward_prefetch=-1)
    with pytest.raises(ValueError, match=r"FSDPConfig.param_dtype=torch.int32"):
        FSDPConfig(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="dp_group is None"):
        FullyShardedDataParallel(Net(torch.float32), blocks=[])
    for name in ("reshard_after_forward", "reduce_per_micro_batch"):
        # "False" would act as True
        with pytest.raises(TypeError, match=rf"FSDPConfig.{name}='False'; valid: True or False"):
            FSDPConfig(**{name: "False"})
        assert getattr(FSDPConfig(**{name: False}), name) is False
    with pytest.raises(
        TypeError, match=r"FullyShardedDataParallel: config=\{'forward_prefetch': 2\} is a dict"
    ):
        FullyShardedDataParallel(Net(torch.float32), blocks=[], config={"forward_prefetch": 2})
    with pytest.raises(
        TypeError, match=r"FullyShardedDataParallel: process_groups=ParallelConfig\(tp=1"
    ):
        FullyShardedDataParallel(Net(torch.float32), blocks=[], process_groups=ParallelConfig())
