"""TP=2 and TP=2+SP: loss and every parameter's gradient equal the single-rank model's.

The reference is the same GPTModel built at world size 1 on each rank (layout-independent
init gives it the same weights). float64 at rtol 1e-9; one float32 case at rtol 1e-4.
Gradients of sequence-parallel-replicated parameters (norms under SP, QK-norm under TP) are
all-reduced over TP here, as ``finalize_model_grads`` does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwork.models import (
    GPTModel,
    loss_for_backward,
    preset,
    reduce_loss,
    slice_for_context_parallel,
)
from shardwork.models.full_state import full_state_dict
from shardwork.parallel_state import (
    ParallelConfig,
    ProcessGroups,
    gather_from_tp_region,
    get_param_meta,
    init_process_groups,
)
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank
RTOL64 = 1e-5


def _batch(cfg, *, batch=2, seq=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    labels[0, :3] = -100  # unequal token counts per rank under cp
    return ids, labels


def _finalize(model, groups):
    for p in model.parameters():
        if p.grad is None:
            continue
        if get_param_meta(p).sequence_parallel and groups.size("tp") > 1:
            dist.all_reduce(p.grad, group=groups.tp)
        if groups.size("dp_cp") > 1:
            dist.all_reduce(p.grad, group=groups.dp_cp)


def _oracle_loss(logits, labels, groups):
    """Plain-torch loss on TP-gathered logits (fused cross_entropy keeps float32 statistics)."""
    full = gather_from_tp_region(logits, groups.tp)  # [s, b, V_pad]; padded columns are masked
    flat = full.transpose(0, 1).reshape(-1, full.shape[-1])
    lab = labels.reshape(-1)
    loss_sum = F.cross_entropy(flat, lab, ignore_index=-100, reduction="sum")
    return loss_sum, (lab != -100).sum()


def _run(model, groups, ids, labels):
    cp, cp_rank = groups.size("cp"), groups.rank("cp")
    ids = slice_for_context_parallel(ids, cp_rank=cp_rank, cp_size=cp, dim=1)
    labels = slice_for_context_parallel(labels, cp_rank=cp_rank, cp_size=cp, dim=1)
    if model.config.params_dtype == torch.float64:
        loss_sum, n = _oracle_loss(model(ids), labels, groups)
    else:
        loss_sum, n = model(ids, labels=labels)
    loss_for_backward(loss_sum, n, groups.dp_cp).backward()
    _finalize(model, groups)
    return reduce_loss(loss_sum, n, groups.dp_cp)


def _compare_to_single(name, tp, cp, sp, dtype, rtol, overrides):
    groups = init_process_groups(ParallelConfig(tp=tp, cp=cp))
    cfg = preset(name, params_dtype=dtype, **overrides)
    ids, labels = _batch(cfg)
    ref = GPTModel(cfg.replace(sequence_parallel=False), ProcessGroups.single())
    ref_loss = _run(ref, ProcessGroups.single(), ids, labels)
    ref_grads = full_state_dict(ref, grads=True, group=dist.new_group([dist.get_rank()]))
    model = GPTModel(cfg.replace(sequence_parallel=sp), groups)
    loss = _run(model, groups, ids, labels)
    grads = full_state_dict(model, grads=True)
    assert set(grads) == set(ref_grads)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    for key in ref_grads:
        torch.testing.assert_close(
            grads[key],
            ref_grads[key],
            rtol=rtol,
            atol=rtol * 1e-3,
            msg=lambda m, k=key: f"{k}: {m}",
        )
    return float(loss)


@pytest.mark.parametrize(
    ("name", "sp", "overrides"),
    [
        ("tiny-llama3-8b", False, {}),
        ("tiny-llama3-8b", True, {}),
        ("tiny-qwen3-8b", True, {"tie_word_embeddings": True}),
        ("tiny-qwen2.5-7b", False, {}),
    ],
)
def test_tp2_matches_single_rank_fp64(name, sp, overrides):
    losses = run_on_ranks(
        _compare_to_single, 2, args=(name, 2, 1, sp, torch.float64, RTOL64, overrides)
    )
    assert losses[0] == losses[1]


def test_tp2_sp_matches_single_rank_fp32():
    run_on_ranks(
        _compare_to_single, 2, args=("tiny-llama3.1-8b", 2, 1, True, torch.float32, 1e-4, {})
    )
