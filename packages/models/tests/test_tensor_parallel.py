"""TP=2, TP=2+SP and CP=2 (also with packed documents): loss and every parameter's gradient equal the single-rank model's.

See ``shardwork.models.testing.compare_with_single_rank``: float64 at rtol 1e-9 (one case with
a plain ``F.cross_entropy`` oracle loss instead of the fused vocab-parallel one) and one
float32 case at rtol 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.models import GPTModel, preset
from shardwork.models.testing import compare_with_single_rank, random_batch
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank
RTOL64 = 1e-9


def _compare(name, kwargs):
    return compare_with_single_rank(name, **kwargs)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("tiny-llama3-8b", {"tp": 2}),
        ("tiny-llama3-8b", {"tp": 2, "oracle_loss": True}),
        ("tiny-llama3-8b", {"tp": 2, "sequence_parallel": True}),
        ("tiny-qwen3-8b", {"tp": 2, "sequence_parallel": True, "tie_word_embeddings": True}),
        ("tiny-qwen2.5-7b", {"tp": 2}),
        ("tiny-llama3-8b", {"cp": 2}),
        ("tiny-qwen3-8b", {"cp": 2, "tp": 2, "sequence_parallel": True}),
        (
            "tiny-llama3-8b",
            {"tp": 2, "sequence_parallel": True, "batch": 1, "cu_seqlens": [0, 5, 11, 16]},
        ),
        # Chunks of 6 tokens: documents cross the boundaries at 6, 12 and 18.
        ("tiny-llama3-8b", {"cp": 2, "batch": 1, "seq": 24, "cu_seqlens": [0, 5, 13, 19, 24]}),
    ],
    ids=[
        "tp2",
        "tp2-oracle-loss",
        "tp2-sp",
        "tp2-sp-qknorm-tied",
        "tp2-qkv-bias",
        "cp2",
        "cp2-tp2-sp",
        "tp2-sp-packed",
        "cp2-packed",
    ],
)
def test_layout_matches_single_rank_fp64(name, kwargs):
    world = kwargs.get("tp", 1) * kwargs.get("cp", 1)
    losses = run_on_ranks(_compare, world, args=(name, kwargs | {"rtol": RTOL64}))
    assert len(set(losses)) == 1


def test_tp2_sp_matches_single_rank_fp32():
    run_on_ranks(
        _compare,
        2,
        args=(
            "tiny-llama3.1-8b",
            {"tp": 2, "sequence_parallel": True, "dtype": torch.float32, "rtol": 1e-4},
        ),
    )


def _layer_activations(model, ids):
    """Every layer's input and output and the final norm's output, un-gathered ``[s, b, h]``."""
    seen = []

    def keep_input(_module, args):
        seen.append(args[0].detach().clone())

    def keep_output(_module, _args, out):
        seen.append(out.detach().clone())

    hooks = [layer.register_forward_pre_hook(keep_input) for layer in model.decoder.layers]
    hooks += [layer.register_forward_hook(keep_output) for layer in model.decoder.layers]
    hooks.append(model.decoder.final_norm.register_forward_hook(keep_output))
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _attention_dropout_masks(model, seq: int) -> torch.Tensor:
    """The keep-masks layer 0's core attention draws, ``[s_q, local heads, s_k]`` (bool).

    Same random q/k on every rank and ``v`` the identity (``v[j] = e_j``), so the output
    row ``i`` of a head is ``P[i] ⊙ M[i] / (1-p)``: it is nonzero exactly where the mask
    keeps a causal entry (``P > 0`` there in float64).
    """
    attn = model.decoder.layers[0].self_attention
    nq, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    assert d == seq, (d, seq)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(seq, 1, nq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(seq, 1, nkv, d, generator=gen, dtype=torch.float64)
    v = torch.eye(seq, dtype=torch.float64)[:, None, None, :].expand(seq, 1, nkv, d)
    with torch.no_grad():
        # _core takes SDPA's [b, n, s, d] layout.
        sdpa = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
        out = attn._core(*sdpa, None).reshape(seq, nq, d)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[:, None, :]
    assert not ((out != 0) & ~causal).any()  # nothing beyond the causal mask
    return (out != 0) & causal


def _dropout_checks():
    groups = init_process_groups(ParallelConfig(tp=2))
    # (a) TP=2 without SP, hidden dropout on: the replicated region draws the world-1 masks
    loss = compare_with_single_rank("tiny-llama3-8b", tp=2, hidden_dropout=0.3, rtol=RTOL64)
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float64)
    ids, labels = random_batch(cfg.vocab_size)
    with torch.no_grad():
        loss_sum, n = GPTModel(cfg, ProcessGroups.single())(ids, labels=labels)
    loss_without_dropout = float(loss_sum / n)
    # (b) residual stream (embedding dropout, every layer's input/output, final norm) with
    # hidden and attention dropout on, un-gathered
    drop = cfg.replace(hidden_dropout=0.3, attention_dropout=0.3)
    acts = _layer_activations(GPTModel(drop, groups).train(), ids)
    emb_dropped = float((acts[0] == 0).double().mean())
    # (c) attention-dropout masks: per rank, a rebuilt model (same seed), a second draw,
    # another seed
    seq = 16
    masks = _attention_dropout_masks(GPTModel(drop, groups), seq)
    again = GPTModel(drop, groups)
    same_seed = _attention_dropout_masks(again, seq)
    next_draw = _attention_dropout_masks(again, seq)
    other = _attention_dropout_masks(GPTModel(drop.replace(dropout_seed=99), groups), seq)
    return dict(
        loss=loss,
        loss_without_dropout=loss_without_dropout,
        acts=acts,
        emb_dropped=emb_dropped,
        masks=masks,
        reproduced=torch.equal(masks, same_seed),
        next_draw_differs=not torch.equal(masks, next_draw),
        other_seed_differs=not torch.equal(masks, other),
    )


def test_tp_dropout_replicated_where_activations_are_replicated():
    """Hidden dropout is replicated over TP (same masks as world 1), attention dropout is not.

    (a) inside ``compare_with_single_rank``: TP=2 without SP, hidden dropout 0.3, attention
    dropout 0 — the loss and every gradient equal the world-1 model's in float64 (rtol 1e-9)
    and differ from the dropout-free loss. (b) with hidden and attention dropout on, each
    rank's un-gathered residual activations are bit-equal across the TP ranks. (c) the
    attention-dropout keep-masks (TP-sharded heads) differ between the TP ranks, are
    reproduced by a model built with the same seed, and change with the draw and the seed.
    """
    a, b = run_on_ranks(_dropout_checks, 2)
    assert a["loss"] == b["loss"]
    assert abs(a["loss"] - a["loss_without_dropout"]) > 1e-6
    assert len(a["acts"]) == len(b["acts"]) == 2 * 2 + 1
    for i, (xa, xb) in enumerate(zip(a["acts"], b["acts"], strict=True)):
        assert torch.equal(xa, xb), f"activation {i} differs across TP ranks"
    assert 0.2 < a["emb_dropped"] < 0.4  # the embedding's dropout is really on
    keep = a["masks"].double().sum() / torch.ones(16, 16).tril().sum() / a["masks"].shape[1]
    assert 0.55 < float(keep) < 0.85  # p = 0.3
    assert not torch.equal(a["masks"], b["masks"])
    for rank in (a, b):
        assert rank["reproduced"] and rank["next_draw_differs"] and rank["other_seed_differs"]
