"""The real GPT model through the pipeline schedules, against the single-rank model (fp64).

PP=2 (1F1B, even split and an uneven one with a tied embedding), PP=2×VPP=2 (interleaved,
tied embedding across stages; and Llama 3's uneven virtual stages, whose first chunk only
embeds and last chunk only projects), TP=2+SP×PP=2 (tied) and CP=2×PP=2: loss and every
parameter's gradient equal those of the same GPTModel built at world size 1
(layout-independent initialisation gives both the same weights), rtol 1e-9. The loss
is plain torch cross entropy on TP-gathered float64 logits, so the comparison is exact to
float64 rounding. Both copies of a tied embedding (first and last stage) are checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwork.models import EMBEDDING_KEY, GPTModel, preset, slice_for_context_parallel
from shardwork.models.full_state import full_state_dict
from shardwork.models.pipeline import (
    build_model_chunks,
    finalize_model_grads,
    get_schedule,
    loss_totals,
    reduce_loss,
)
from shardwork.parallel_state import (
    ParallelConfig,
    ProcessGroups,
    gather_from_tp_region,
    init_process_groups,
)
from shardwork.parallel_state.testing import run_on_ranks as _run_on_ranks

# The first call also starts and imports the rank processes: generous on a loaded machine.
TIMEOUT_S = 400


def run_on_ranks(fn, world_size, **kwargs):
    return _run_on_ranks(fn, world_size, timeout=TIMEOUT_S, **kwargs)


pytestmark = pytest.mark.multirank
SEQ, MICRO_BATCH = 8, 2


def _config(tied, sp=False):
    return preset(
        "tiny-llama3-8b",
        num_layers=4,
        params_dtype=torch.float64,
        tie_word_embeddings=tied,
        sequence_parallel=sp,
    )


def _microbatches(cfg, num_microbatches, dp_rank):
    gen = torch.Generator().manual_seed(7 + dp_rank)
    out = []
    for m in range(num_microbatches):
        ids = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, SEQ), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, SEQ), generator=gen)
        labels[m % MICRO_BATCH, : m + 1] = -100  # token counts differ per microbatch
        out.append((ids, labels))
    return out


def _loss(groups, labels, logits):
    full = gather_from_tp_region(logits, groups.tp)  # [s, b, V_pad], padded columns masked
    flat = full.transpose(0, 1).reshape(-1, full.shape[-1])
    lab = labels.reshape(-1)
    return F.cross_entropy(flat, lab, ignore_index=-100, reduction="sum"), (lab != -100).sum(), {}


def _step_for(groups):
    def forward_step(data_iterator, chunk):
        ids, labels = next(data_iterator)
        out = chunk(ids) if chunk.pre_process else chunk()
        return out, lambda logits: _loss(groups, labels, logits)

    return forward_step


def _self_group():
    """A one-rank group for this rank (every rank creates every one, in order)."""
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return mine


def _gpt_case(tp, pp, vpp, num_microbatches, tied, sp, cp=1, first_stage_layers=None, split=None):
    """Run the case; returns ``(result, this rank's chunks' layer ranges)``. ``split``: the
    per-virtual-stage ends (``first_virtual_stage_layers`` / ``last_virtual_stage_layers``)."""
    groups = init_process_groups(ParallelConfig(tp=tp, pp=pp, vpp=vpp, cp=cp))
    cfg = _config(tied, sp)
    data = _microbatches(cfg, num_microbatches, groups.rank("dp"))

    single = ProcessGroups.single()
    ref = GPTModel(cfg.replace(sequence_parallel=False), single)
    total, tokens = 0.0, 0
    for ids, labels in data:
        s, n, _ = _loss(single, labels, ref(ids))
        total, tokens = total + s, tokens + n
    ref_loss = (total / tokens).detach()
    (total / tokens).backward()
    ref_grads = full_state_dict(ref, grads=True, group=_self_group())

    chunks = build_model_chunks(cfg, groups, first_stage_layers=first_stage_layers, **(split or {}))
    ranges = [chunk.decoder.layer_range for chunk in chunks]
    seq_local = SEQ // cp // (tp if sp else 1)
    cp_rank = groups.rank("cp")
    local = [
        tuple(slice_for_context_parallel(t, cp_rank=cp_rank, cp_size=cp, dim=1) for t in batch)
        for batch in data
    ]
    losses = get_schedule(pp, vpp)(
        forward_step_func=_step_for(groups),
        data_iterator=[iter(local) for _ in chunks],
        model=chunks,
        num_microbatches=num_microbatches,
        pp_group=groups.pp,
        tensor_shape=(seq_local, MICRO_BATCH, cfg.hidden_size),
        dtype=torch.float64,
    )
    mean, _, _ = reduce_loss(losses, pp_group=groups.pp, dp_cp_group=groups.dp_cp)
    torch.testing.assert_close(mean, ref_loss, rtol=1e-12, atol=0)
    finalize_model_grads(chunks, groups, num_tokens=loss_totals(losses)[1])

    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:  # every rank joins each chunk's assembly; each key is written once
        for key, value in full_state_dict(chunk, grads=True).items():
            grads[key] = grads[key] + value if key in grads else value
    assert grads.keys() == ref_grads.keys()
    for key, ref_grad in ref_grads.items():
        torch.testing.assert_close(
            grads[key], ref_grad, rtol=1e-9, atol=1e-13, msg=lambda m, k=key: f"{k}: {m}"
        )
    head = chunks[-1].output_layer
    if tied and groups.is_last_pp_stage and head is not None and head.linear.weight is not None:
        # the last stage's copy of the tied embedding got the same (summed) gradient
        rows = head.linear.weight.grad.shape[0]  # padded_vocab / tp; padding rows get no grad
        start = groups.rank("tp") * rows
        real = ref_grads[EMBEDDING_KEY][start : start + rows]
        expected = torch.zeros_like(head.linear.weight.grad)
        expected[: real.shape[0]] = real
        torch.testing.assert_close(head.linear.weight.grad, expected, rtol=1e-9, atol=1e-13)
        return "tied-checked", ranges
    return len(grads), ranges


def _pp2_even_and_uneven():
    """PP=2 1F1B with the even split, then with an uneven one (first stage: 1 of 4 layers,
    tied embedding), in one start of the ranks."""
    even = _gpt_case(1, 2, None, 3, False, False)
    uneven = _gpt_case(1, 2, None, 3, True, False, first_stage_layers=1)
    return even, uneven


def test_gpt_pp2_1f1b_matches_single_rank():
    (even0, uneven0), (even1, uneven1) = run_on_ranks(_pp2_even_and_uneven, 2)
    assert even0[0] == even1[0] > 10
    assert (even0[1], even1[1]) == ([(0, 2)], [(2, 4)])
    assert uneven1[0] == "tied-checked"
    assert (uneven0[1], uneven1[1]) == ([(0, 1)], [(1, 4)])


def test_gpt_pp2_vpp2_interleaved_tied_embedding():
    out = run_on_ranks(_gpt_case, 2, args=(1, 2, 2, 4, True, False))
    assert out[1][0] == "tied-checked"


def test_gpt_pp2_vpp2_uneven_virtual_stages():
    """Llama 3's split (Dubey et al. 2024, §3.3.2) at its extreme: 4 layers over 2 ranks × 2
    chunks as 0 + 2 + 2 + 0, so virtual stage 0 holds only the (tied) embedding and the last
    one only the final norm, head and loss."""
    split = {"first_virtual_stage_layers": 0, "last_virtual_stage_layers": 0}
    out = run_on_ranks(_gpt_case, 2, args=(1, 2, 2, 4, True, False), kwargs={"split": split})
    assert out[1][0] == "tied-checked"
    assert (out[0][1], out[1][1]) == ([(0, 0), (2, 4)], [(0, 2), (4, 4)])


def test_gpt_tp2_sp_pp2_tied_embedding():
    out = run_on_ranks(_gpt_case, 4, args=(2, 2, None, 2, True, True))
    assert [result for result, _ in out[2:]] == ["tied-checked"] * 2


def test_gpt_cp2_pp2_interleaved():
    out = run_on_ranks(_gpt_case, 4, args=(1, 2, 2, 2, False, False), kwargs={"cp": 2})
    results = [result for result, _ in out]
    assert len(set(results)) == 1 and results[0] > 10
