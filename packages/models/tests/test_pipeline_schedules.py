"""Pipeline schedules on real gloo ranks with a toy model, against the single-rank model.

The toy model is embed -> L × (Linear + tanh) -> head (optionally tied to the embedding),
with a masked squared-error loss summed over tokens, so token counts differ between
microbatches and ranks. Every rank computes the single-rank reference itself (same seed,
all data), then runs its pipeline stage(s) and checks loss and every gradient (fp64).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwork.models.pipeline import (
    finalize_model_grads,
    forward_backward_no_pipelining,
    get_schedule,
    layer_split,
    loss_totals,
    reduce_loss,
)
from shardwork.parallel_state import (
    ParallelConfig,
    ParamMeta,
    init_process_groups,
    set_param_meta,
)
from shardwork.parallel_state.testing import run_on_ranks as _run_on_ranks

# The first call also starts and imports the rank processes: generous on a loaded machine.
TIMEOUT_S = 400


def run_on_ranks(fn, world_size, **kwargs):
    return _run_on_ranks(fn, world_size, timeout=TIMEOUT_S, **kwargs)


HIDDEN = 6
SEQ = 3
MICRO_BATCH = 2


class ToyModel(nn.Module):
    """The whole model, or one pipeline chunk of it (same parameter names either way)."""

    def __init__(self, layers, *, pre_process=True, post_process=True, tied=False):
        super().__init__()
        self.pre_process, self.post_process, self.tied = pre_process, post_process, tied
        self.layers = nn.ModuleDict({str(i): nn.Linear(HIDDEN, HIDDEN) for i in layers})
        if pre_process or (post_process and tied):
            self.embed = nn.Linear(HIDDEN, HIDDEN, bias=False)
        if post_process and not tied:
            self.head = nn.Linear(HIDDEN, HIDDEN)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = torch.tanh(self.embed(x)) if self.pre_process else self.input_tensor
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        if not self.post_process:
            return h
        return h @ self.embed.weight if self.tied else self.head(h)


def _full_model(num_layers, tied):
    torch.manual_seed(1234)
    return ToyModel(range(num_layers), tied=tied).double()


def _chunk_of(full, layers, *, pre_process, post_process, tied, shared):
    chunk = ToyModel(layers, pre_process=pre_process, post_process=post_process, tied=tied)
    chunk = chunk.double()
    own = dict(chunk.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name in own:
                own[name].copy_(p)
    if shared and hasattr(chunk, "embed"):
        set_param_meta(chunk.embed.weight, ParamMeta(shared_embedding=True))
    return chunk


def _data(num_ranks_dp, num_microbatches, *, vary_seq=False):
    """data[dp_rank][m] = dict(x, y, mask); token counts differ everywhere."""
    g = torch.Generator().manual_seed(99)
    data = []
    for _ in range(num_ranks_dp):
        batches = []
        for m in range(num_microbatches):
            seq = SEQ + (m % 3 if vary_seq else 0)
            x = torch.randn(seq, MICRO_BATCH, HIDDEN, generator=g, dtype=torch.float64)
            y = torch.randn(seq, MICRO_BATCH, HIDDEN, generator=g, dtype=torch.float64)
            mask = torch.rand(seq, MICRO_BATCH, generator=g) < 0.7
            mask[0, 0] = True
            batches.append({"x": x, "y": y, "mask": mask})
        data.append(batches)
    return data


def _loss_fn(batch, output):
    err = ((output - batch["y"]) ** 2).sum(-1) * batch["mask"]
    return err.sum(), batch["mask"].sum(), {"tokens": int(batch["mask"].sum())}


def _forward_step(data_iterator, chunk):
    batch = next(data_iterator)
    return chunk(batch["x"]), lambda out: _loss_fn(batch, out)


def _reference(full, data):
    """Single-rank mean loss over all microbatches of all DP ranks, and its gradients."""
    full.zero_grad()
    total, tokens = 0.0, 0
    for batches in data:
        for b in batches:
            s, n, _ = _loss_fn(b, full(b["x"]))
            total, tokens = total + s, tokens + n
    loss = total / tokens
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in full.named_parameters()}


def _run_case(
    pp,
    vpp,
    num_microbatches,
    *,
    num_layers=4,
    tied=False,
    first_stage_layers=None,
    known_shape=True,
    vary_seq=False,
    forward_only=False,
):
    groups = init_process_groups(ParallelConfig(pp=pp, vpp=vpp))
    dp, pp_rank, dp_rank = groups.size("dp"), groups.rank("pp"), groups.rank("dp")
    full = _full_model(num_layers, tied)
    data = _data(dp, num_microbatches, vary_seq=vary_seq)
    ref_loss, ref_grads = _reference(full, data)

    v = vpp or 1
    split = layer_split(num_layers, pp, vpp=vpp, first_stage_layers=first_stage_layers)
    chunks = [
        _chunk_of(
            full,
            split[pp_rank][c],
            pre_process=(c == 0 and pp_rank == 0),
            post_process=(c == v - 1 and pp_rank == pp - 1),
            tied=tied,
            shared=tied and pp > 1,
        )
        for c in range(v)
    ]
    schedule = get_schedule(pp, vpp)
    losses = schedule(
        forward_step_func=_forward_step,
        data_iterator=[iter(data[dp_rank]) for _ in chunks] if v > 1 else iter(data[dp_rank]),
        model=chunks if v > 1 else chunks[0],
        num_microbatches=num_microbatches,
        pp_group=groups.pp,
        tensor_shape=(SEQ, MICRO_BATCH, HIDDEN) if known_shape else None,
        dtype=torch.float64,
        forward_only=forward_only,
    )
    assert len(losses) == (num_microbatches if groups.is_last_pp_stage else 0)
    mean, _, tokens = reduce_loss(losses, pp_group=groups.pp, dp_cp_group=groups.dp_cp)
    torch.testing.assert_close(mean, ref_loss, rtol=1e-12, atol=0)
    if groups.is_last_pp_stage:
        assert [r.logs["tokens"] for r in losses] == [int(b["mask"].sum()) for b in data[dp_rank]]
    if forward_only:
        assert all(p.grad is None for c in chunks for p in c.parameters())
        return 0
    global_tokens = finalize_model_grads(chunks, groups, num_tokens=loss_totals(losses)[1])
    assert float(global_tokens) == float(tokens)
    checked = 0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-9, atol=1e-13)
            checked += 1
    return checked


@pytest.mark.multirank
def test_1f1b_pp2_matches_single_rank():
    checked = run_on_ranks(_run_case, 2, args=(2, None, 4))
    assert sum(checked) == 1 + 2 * 4 + 2  # embed + 4 layers (w, b) + head (w, b)


@pytest.mark.multirank
def test_interleaved_pp2_vpp2_uneven_first_stage():
    # 6 layers: rank 0 holds 2 (one per chunk), rank 1 holds 4 (two per chunk).
    checked = run_on_ranks(
        _run_case, 2, args=(2, 2, 4), kwargs={"num_layers": 6, "first_stage_layers": 2}
    )
    assert sum(checked) == 1 + 2 * 6 + 2


@pytest.mark.multirank
def test_forward_only_and_shapes_exchanged():
    # forward_only on interleaved; then 1F1B with shapes that change per microbatch.
    run_on_ranks(_run_case, 2, args=(2, 2, 2), kwargs={"forward_only": True})
    checked = run_on_ranks(
        _run_case, 2, args=(2, None, 3), kwargs={"known_shape": False, "vary_seq": True}
    )
    assert sum(checked) == 1 + 2 * 4 + 2


@pytest.mark.multirank
def test_pp2_dp2_tied_embedding_unequal_tokens():
    checked = run_on_ranks(_run_case, 4, args=(2, None, 3), kwargs={"tied": True})
    assert sum(checked) == 2 * (2 * 4 + 2)  # embed on both stages, every layer, per dp rank


@pytest.mark.multirank
def test_interleaved_pp4_vpp2_tied():
    checked = run_on_ranks(
        _run_case, 4, args=(4, 2, 8), kwargs={"num_layers": 8, "tied": True, "known_shape": False}
    )
    assert sum(checked) == 2 * 8 + 2


def test_no_pipelining_single_process_matches_reference():
    full = _full_model(3, tied=True)
    data = _data(1, 3)
    ref_loss, ref_grads = _reference(full, data)
    full.zero_grad()
    losses = forward_backward_no_pipelining(
        forward_step_func=_forward_step, data_iterator=iter(data[0]), model=full, num_microbatches=3
    )
    mean, _, _ = reduce_loss(losses)
    torch.testing.assert_close(mean, ref_loss, rtol=1e-12, atol=0)
    finalize_model_grads(full, None, num_tokens=loss_totals(losses)[1])
    for name, p in full.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-9, atol=1e-13)


class FakeDDP(nn.Module):
    """Duck-typed DDP: records, per backward, whether grad sync was enabled; sums on finish."""

    def __init__(self, module, group):
        super().__init__()
        self.module, self.group, self.sync, self.backward_syncs = module, group, True, []
        first = next(module.parameters())
        first.register_hook(lambda g: self.backward_syncs.append(self.sync) or g)

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def finish_grad_sync(self):
        for p in self.module.parameters():
            dist.all_reduce(p.grad, group=self.group)

    def forward(self, x):
        return self.module(x)


def _ddp_case(pp, vpp, num_microbatches):
    groups = init_process_groups(ParallelConfig(pp=pp, vpp=vpp))
    num_layers = 4
    full = _full_model(num_layers, False)
    data = _data(groups.size("dp"), num_microbatches)
    ref_loss, ref_grads = _reference(full, data)
    v = vpp or 1
    split = layer_split(num_layers, pp, vpp=vpp)
    r = groups.rank("pp")
    chunks = [
        FakeDDP(
            _chunk_of(
                full,
                split[r][c],
                pre_process=(c == 0 and r == 0),
                post_process=(c == v - 1 and r == pp - 1),
                tied=False,
                shared=False,
            ),
            groups.dp_cp,
        )
        for c in range(v)
    ]
    losses = get_schedule(pp, vpp)(
        forward_step_func=_forward_step,
        data_iterator=[iter(data[groups.rank("dp")]) for _ in chunks],
        model=chunks,
        num_microbatches=num_microbatches,
        pp_group=groups.pp,
        tensor_shape=(SEQ, MICRO_BATCH, HIDDEN),
    )
    mean, _, _ = reduce_loss(losses, pp_group=groups.pp, dp_cp_group=groups.dp_cp)
    torch.testing.assert_close(mean, ref_loss, rtol=1e-12, atol=0)
    finalize_model_grads(chunks, groups, num_tokens=loss_totals(losses)[1])
    for chunk in chunks:
        assert chunk.backward_syncs == [False] * (num_microbatches - 1) + [True]
        for name, p in chunk.module.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-9, atol=1e-13)
    return len(chunks)


@pytest.mark.multirank
def test_ddp_wrapper_syncs_once_per_chunk():
    assert run_on_ranks(_ddp_case, 2, args=(1, None, 3)) == [1, 1]  # no pipelining, dp=2
    assert run_on_ranks(_ddp_case, 4, args=(2, 2, 4)) == [2] * 4  # interleaved, dp=2


def _moe_case():
    from shardwork.moe_router.tracker import AuxLossTracker

    groups = init_process_groups(ParallelConfig(pp=2))
    tracker = AuxLossTracker(num_layers=2, num_experts=3)
    stage = groups.rank("pp")  # layer i lives on stage i
    tracker.record_loss("load_balancing_loss", stage, torch.tensor(1.5 + stage))
    tracker.record_tokens(stage, torch.tensor([1.0, 2.0, 3.0]) * (stage + 1))
    calls = []
    finalize_model_grads(
        nn.Linear(2, 2), groups, moe_tracker=tracker, moe_hooks=[lambda: calls.append(stage)]
    )
    return calls, tracker.losses[0].tolist(), tracker.tokens_per_expert.tolist()


@pytest.mark.multirank
def test_moe_tracker_reduction_joins_every_stage():
    results = run_on_ranks(_moe_case, 2)
    assert [calls for calls, _, _ in results] == [[0], [1]]  # each rank's hook ran once
    for _, losses, tokens in results:  # both stages hold both layers' values
        assert losses == [1.5, 2.5]
        assert tokens == [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]


class _AveragingDDP(nn.Module):
    class config:  # noqa: N801 - mimics DDPConfig's attribute
        average_gradients = True

    grad_divisor = 2

    def finish_grad_sync(self):
        raise AssertionError("must be rejected before any reduction")


def test_token_scaling_rejects_an_averaging_ddp():
    with pytest.raises(ValueError, match="average_gradients=False"):
        finalize_model_grads([_AveragingDDP()], None, num_tokens=10)


def _real_ddp_case(pp, vpp, num_microbatches):
    from shardwork.dist_optimizer import DDPConfig, DistributedDataParallel

    groups = init_process_groups(ParallelConfig(pp=pp, vpp=vpp))
    num_layers = 4
    full = _full_model(num_layers, True)
    data = _data(groups.size("dp"), num_microbatches)
    _, ref_grads = _reference(full, data)
    v = vpp or 1
    split = layer_split(num_layers, pp, vpp=vpp)
    r = groups.rank("pp")
    config = DDPConfig(average_gradients=False, bucket_size=40)  # several buckets, overlapped
    chunks = [
        DistributedDataParallel(
            _chunk_of(
                full,
                split[r][c],
                pre_process=(c == 0 and r == 0),
                post_process=(c == v - 1 and r == pp - 1),
                tied=True,
                shared=True,
            ),
            config=config,
            process_groups=groups,
        )
        for c in range(v)
    ]
    losses = get_schedule(pp, vpp)(
        forward_step_func=_forward_step,
        data_iterator=[iter(data[groups.rank("dp")]) for _ in chunks],
        model=chunks,
        num_microbatches=num_microbatches,
        pp_group=groups.pp,
        tensor_shape=(SEQ, MICRO_BATCH, HIDDEN),
    )
    finalize_model_grads(chunks, groups, num_tokens=loss_totals(losses)[1])
    checked = 0
    for chunk in chunks:
        for name, p in chunk.module.named_parameters():
            torch.testing.assert_close(p.main_grad, ref_grads[name], rtol=1e-9, atol=1e-13)
            checked += 1
    return checked


@pytest.mark.multirank
def test_with_shardwork_ddp_pp2_dp2_tied():
    pytest.importorskip("shardwork.dist_optimizer")
    checked = run_on_ranks(_real_ddp_case, 4, args=(2, None, 3))
    assert sum(checked) == 2 * (2 + 2 * 4)  # per dp replica: tied embed on both stages, layers
