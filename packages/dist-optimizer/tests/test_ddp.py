"""DistributedDataParallel: reduced gradients, overlap with backward, accumulation, fp32 rule,
parameter all-gathers overlapped with the next forward."""

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

WIDTH, LAYERS, BATCH = 6, 4, 3


def build_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).to(dtype)


def data(dp: int, accum: int):
    g = torch.Generator().manual_seed(4)
    return torch.randn(accum, dp * BATCH, WIDTH, generator=g), torch.randn(
        accum, dp * BATCH, WIDTH, generator=g
    )


def _run_ddp(overlap: bool, accum: int, zero: bool):
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = build_model()
    # one bucket per layer (42 elements each)
    ddp = DistributedDataParallel(
        model,
        config=DDPConfig(
            bucket_size=40,
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=zero,
            pad_multiple=1,
        ),
        process_groups=pg,
    )
    x, y = data(dp, accum)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    seen = []
    ddp.zero_grad_buffer()
    for m in range(accum):
        inp = x[m, local].clone().requires_grad_(True)
        if m == accum - 1:
            inp.register_hook(lambda g: seen.append(len(ddp.grad_sync_launch_log)))
        ctx = ddp.no_sync() if m < accum - 1 else contextlib.nullcontext()
        with ctx:
            (nn.functional.mse_loss(ddp(inp), y[m, local]) / accum).backward()
    launched_during_backward = seen[0]
    ddp.finish_grad_sync()
    num_buckets = sum(len(b.buckets) for b in ddp.buffers.values())
    # (name, flat start, flat end, reduced values): all of each parameter with all-reduce,
    # this rank's shard pieces with reduce-scatter
    grads = []
    for buffer in ddp.buffers.values():
        for pc in buffer.layout.shard_pieces(rank) if zero else []:
            p = buffer.params[pc.param_index]
            values = p.main_grad.view(-1)[pc.param_start : pc.param_end].clone()
            grads.append((ddp.param_names[id(p)], pc.param_start, pc.param_end, values))
    if not zero:
        grads = [
            (n, 0, p.numel(), p.main_grad.view(-1).clone()) for n, p in model.named_parameters()
        ]
    return launched_during_backward, num_buckets, grads


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("overlap", "accum", "zero"),
    [(True, 1, False), (False, 1, False), (True, 3, False), (True, 2, True)],
)
def test_ddp_gradients_and_overlap(overlap, accum, zero):
    results = run_on_ranks(_run_ddp, 2, args=(overlap, accum, zero))
    ref = build_model()
    x, y = data(2, accum)
    for m in range(accum):
        (nn.functional.mse_loss(ref(x[m]), y[m]) / accum).backward()
    ref_grads = {n: p.grad.view(-1) for n, p in ref.named_parameters()}
    covered = {n: 0 for n in ref_grads}
    for _, num_buckets, grads in results:
        assert num_buckets == LAYERS
        for name, a, b, got in grads:
            torch.testing.assert_close(got, ref_grads[name][a:b], rtol=1e-5, atol=1e-7)
            covered[name] += b - a
    assert all(covered[n] == (1 if zero else 2) * g.numel() for n, g in ref_grads.items())
    for launched, *_ in results:
        if overlap:
            # the buckets of layers 2..4 were launched while layer 1's backward was still to run
            assert launched >= LAYERS - 1
        else:
            assert launched == 0


def test_bf16_params_accumulate_in_fp32_by_default_and_by_rule():
    model = build_model(torch.bfloat16)
    ddp = DistributedDataParallel(model)
    assert {p.main_grad.dtype for p in model.parameters()} == {torch.float32}
    model = build_model(torch.bfloat16)
    ddp = DistributedDataParallel(
        model, config=DDPConfig(grad_reduce_in_fp32=False, fp32_grad_params=("0.*",))
    )
    dtypes = {n: p.main_grad.dtype for n, p in model.named_parameters()}
    assert dtypes["0.weight"] == dtypes["0.bias"] == torch.float32
    assert dtypes["2.weight"] == torch.bfloat16
    assert len(ddp.buffers) == 2
    # accumulation: main_grad holds the sum of micro-batch gradients
    x = torch.randn(4, WIDTH, dtype=torch.bfloat16)
    with ddp.no_sync():
        ddp(x).float().square().sum().backward()
    ddp(x).float().square().sum().backward()
    ref = build_model(torch.bfloat16)
    for _ in range(2):
        ref(x).float().square().sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad.float(), q.grad.float(), rtol=2e-2, atol=1e-2, msg=n)


def test_frozen_parameters_stay_out_of_buffers():
    model = build_model()
    model[0].weight.requires_grad_(False)
    ddp = DistributedDataParallel(model)
    in_buffers = {id(p) for b in ddp.buffers.values() for p in b.params}
    assert id(model[0].weight) not in in_buffers and id(model[0].bias) in in_buffers
    ddp(torch.randn(2, WIDTH)).sum().backward()
    assert model[0].weight.grad is None and not hasattr(model[0].weight, "main_grad")


def _param_gather_overlap():
    """One ZeRO step with and without overlap; then the overlapped model's next forward."""
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    x, y = data(dp, 2)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    runs = {}
    for overlap in (False, True):
        model = build_model()
        cfg = DDPConfig(
            bucket_size=40,
            use_distributed_optimizer=True,
            overlap_grad_reduce=overlap,
            pad_multiple=1,
        )
        ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
        opt = DistributedOptimizer(
            ddp,
            lambda g: torch.optim.AdamW(g, lr=1e-2),
            config=OptimizerConfig(overlap_param_gather=overlap),
            process_groups=pg,
        )
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[0, local]), y[0, local]).backward()
        opt.step()
        runs[overlap] = (model, ddp)
    model, ddp = runs[True]
    after_step = list(ddp.param_gather_log)
    pending = [b.param_handle is not None for buf in ddp.buffers.values() for b in buf.buckets]
    layers = [m for m in model if isinstance(m, nn.Linear)]
    buckets_of = [
        sorted({(ddp._bucket_of[id(p)].key, ddp._bucket_of[id(p)].index) for p in m.parameters()})
        for m in layers
    ]
    seen = []

    def probe(i):
        # registered after DDP's own pre-hook, so it runs after DDP's wait for this module
        def hook(module, _args):
            waited = [(k, j) for event, k, j in ddp.param_gather_log if event == "wait"]
            seen.append((i, waited, [p.detach().clone() for p in module.parameters()]))

        return hook

    for i, m in enumerate(layers):
        m.register_forward_pre_hook(probe(i))
    out = ddp(x[1, local])
    serial_model = runs[False][0]
    serial = [[p.detach().clone() for p in m.parameters()] for m in serial_model]
    serial = [s for s, m in zip(serial, serial_model) if isinstance(m, nn.Linear)]
    return after_step, pending, buckets_of, seen, serial, out, serial_model(x[1, local])


@pytest.mark.multirank
def test_param_gather_overlaps_next_forward():
    for after_step, pending, buckets_of, seen, serial, out, serial_out in run_on_ranks(
        _param_gather_overlap, 2
    ):
        # after step(): one asynchronous gather per bucket, in forward order, none waited for
        assert [e for e, *_ in after_step] == ["launch"] * LAYERS and all(pending)
        assert [tuple(k) for _, *k in after_step] == [b for bs in buckets_of for b in bs]
        assert [i for i, *_ in seen] == list(range(LAYERS))
        for i, waited, params in seen:
            own = set(buckets_of[i])
            later = {b for bs in buckets_of[i + 1 :] for b in bs}
            assert own <= set(waited)  # this module's buckets were waited for before it ran
            assert not later & set(waited)  # later modules' gathers still pending
            for got, want in zip(params, serial[i]):
                assert torch.equal(got, want)  # the values of the non-overlapped run
        assert torch.equal(out, serial_out)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_dropped_wrapper_and_model_are_freed_and_remove_hooks_detaches(distributed_optimizer):
    """Once the caller drops the wrapper and its module, ``gc.collect()`` frees both (with the
    parameters and their ``main_grad`` buffers), whether or not ``remove_hooks`` ran: the
    parameters' post-accumulate-grad hooks live in autograd's C++ tables, beyond the
    collector's reach, so they must not hold the wrapper strongly (they used to, and every
    wrapped model lived until the process ended). After ``remove_hooks`` backward leaves
    ``p.grad`` alone (no fold into ``main_grad``)."""
    import gc
    import weakref

    def wrapped(detach: bool):
        model = build_model()
        config = DDPConfig(use_distributed_optimizer=distributed_optimizer)
        ddp = DistributedDataParallel(model, config=config)
        x = torch.randn(2, WIDTH)
        ddp(x).sum().backward()
        folded = model[0].weight.main_grad.clone()
        assert model[0].weight.grad is None and folded.abs().sum() > 0
        if detach:
            ddp.zero_grad_buffer()
            ddp.remove_hooks()
            ddp(x).sum().backward()
            # the plain autograd gradient stays; main_grad is not touched
            torch.testing.assert_close(model[0].weight.grad, folded, rtol=0, atol=0)
            assert model[0].weight.main_grad.abs().sum() == 0
        weight = model[0].weight
        return weakref.ref(model), weakref.ref(ddp), weakref.ref(weight.main_grad)

    for detach in (True, False):
        refs = wrapped(detach)
        gc.collect()
        assert [r() for r in refs] == [None, None, None], f"detach={detach}"
