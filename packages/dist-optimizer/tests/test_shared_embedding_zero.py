"""A weight tied across pipeline stages stays correct under ZeRO's reduce-scatter.

Stage 0 and stage 1 each hold a copy of a tied embedding next to parameters of
different sizes. After the data-parallel reduce-scatter, the embedding-group
sum of ``main_grad`` (what ``finalize_model_grads`` does) must give every rank
the true gradient — summed over all four ranks — on the part of the weight its
shard owns. That holds only if both stages shard the weight identically, which
the layout guarantees by giving a shared-embedding parameter its own bucket.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwork.dist_optimizer import DDPConfig, DistributedDataParallel
from shardwork.dist_optimizer.layout import BufferLayout
from shardwork.parallel_state import ParallelConfig, ParamMeta, init_process_groups, set_param_meta
from shardwork.parallel_state.testing import run_on_ranks

VOCAB, HIDDEN = 7, 5


class _Stage(nn.Module):
    def __init__(self, other_numel: int) -> None:
        super().__init__()
        # Registered first, so it comes last in backward (buffer) order, after `other`.
        self.tied = nn.Parameter(torch.randn(VOCAB, HIDDEN, dtype=torch.float64))
        set_param_meta(self.tied, ParamMeta(shared_embedding=True))
        self.other = nn.Parameter(torch.randn(other_numel, dtype=torch.float64))


def _grad_of(rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _tied_shard_after_sync():
    pg = init_process_groups(ParallelConfig(pp=2))
    stage = pg.rank("pp")
    # Different neighbours per stage: without isolation the shard boundaries would differ.
    model = _Stage(other_numel=3 if stage == 0 else 11)
    ddp = DistributedDataParallel(
        model,
        config=DDPConfig(
            bucket_size=None,
            use_distributed_optimizer=True,
            overlap_grad_reduce=False,
            average_gradients=False,
        ),
        process_groups=pg,
    )
    ddp.zero_grad_buffer()
    me = dist.get_rank()
    loss = (model.tied * _grad_of(me, (VOCAB, HIDDEN))).sum() + model.other.sum()
    loss.backward()
    ddp.finish_grad_sync()
    tied_grad = model.tied.main_grad
    dist.all_reduce(tied_grad, group=pg.group("embedding"))
    location = ddp.index_map.locate(model.tied)
    layout = ddp.index_map.buffers[location.key]
    lo, hi = layout.shard_range(location.bucket_index, pg.rank("dp"))
    start = location.start
    flat = tied_grad.reshape(-1)
    a, b = max(lo - start, 0), min(hi - start, flat.numel())
    return a, b, flat[a:b].clone()


@pytest.mark.multirank
def test_tied_weight_shard_is_the_sum_over_stages_and_replicas():
    results = run_on_ranks(_tied_shard_after_sync, world_size=4)
    expected = sum(_grad_of(r, (VOCAB, HIDDEN)) for r in range(4)).reshape(-1)
    covered = set()
    for a, b, values in results:
        torch.testing.assert_close(values, expected[a:b], rtol=1e-12, atol=1e-12)
        covered |= set(range(a, b))
    assert covered == set(range(VOCAB * HIDDEN))


def test_isolated_parameter_gets_a_bucket_of_its_own():
    layout = BufferLayout.build(
        [3, 35, 11],
        bucket_size=None,
        dp_size=2,
        pad_for_dp=True,
        pad_multiple=4,
        isolated=[False, True, False],
    )
    assert [bucket.param_indices for bucket in layout.buckets] == [(0,), (1,), (2,)]
    assert layout.buckets[1].numel == 36
