"""Single-rank behaviour: recompute with dropout, packed sequences, padding, loss, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwork.models import (
    GPTConfig,
    GPTModel,
    gather_logits,
    layout_groups,
    preset,
    token_loss,
)
from shardwork.models.testing import random_batch
from shardwork.parallel_state import ParallelConfig


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_with_dropout_gives_bit_equal_grads(mode):
    cfg = preset("tiny-llama3-8b", hidden_dropout=0.2, attention_dropout=0.2, num_layers=3)
    ids, labels = random_batch(cfg.vocab_size, seq=16)
    results = []
    for recompute in ("none", mode):
        model = GPTModel(cfg.replace(recompute=recompute)).train()
        torch.manual_seed(7)  # global RNG differs from the tracker's: both must be replayed
        loss_sum, _ = model(ids, labels=labels)
        loss_sum.backward()
        results.append((loss_sum.detach(), _grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    # dropout is really on: a model without it gives a different loss
    plain = GPTModel(cfg.replace(hidden_dropout=0.0, attention_dropout=0.0)).train()
    assert not torch.equal(plain(ids, labels=labels)[0].detach(), loss_a)


def test_tracker_state_advances_and_eval_is_deterministic():
    cfg = preset("tiny-llama3-8b", hidden_dropout=0.3)
    model = GPTModel(cfg).train()
    ids, _ = random_batch(cfg.vocab_size)
    a, b = model(ids), model(ids)
    assert not torch.equal(a, b)  # streams advance between steps
    model.eval()
    assert torch.equal(model(ids), model(ids))


def test_packed_sequences_equal_separate_documents():
    cfg = preset("tiny-qwen3-8b", params_dtype=torch.float64)
    model = GPTModel(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 8, 3]
    docs = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in lengths]
    cu = torch.tensor([0, 5, 13, 16])
    with torch.no_grad():
        packed = gather_logits(
            model(torch.cat(docs, dim=1), cu_seqlens=cu), tp_group=None, vocab_size=cfg.vocab_size
        )
        separate = [gather_logits(model(d), tp_group=None, vocab_size=cfg.vocab_size) for d in docs]
    torch.testing.assert_close(packed, torch.cat(separate, dim=1), rtol=1e-10, atol=1e-12)


def test_padded_vocab_is_masked_and_not_saved():
    cfg = preset("tiny-llama3-8b")
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (250, 256)
    model = GPTModel(cfg)
    ids, _ = random_batch(cfg.vocab_size)
    logits = model(ids)
    assert logits.shape[-1] == 256
    assert bool((logits[..., 250:] == torch.finfo(logits.dtype).min).all())
    state = model.sharded_state_dict()
    assert state["embedding.word_embeddings.weight"].global_shape == (250, 64)
    assert state["output_layer.weight"].global_shape == (250, 64)
    assert bool((model.embedding.weight[250:] == 0).all())


def test_token_loss_matches_torch_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2, 40, generator=gen, requires_grad=True)  # [s, b, V]
    labels = torch.randint(0, 40, (2, 6), generator=gen)
    labels[1, 2] = -100
    mask = (torch.rand(2, 6, generator=gen) > 0.3).float()
    loss_sum, n = token_loss(logits, labels, loss_mask=mask)
    ref = F.cross_entropy(
        logits.transpose(0, 1).reshape(-1, 40),
        labels.reshape(-1),
        reduction="none",
        ignore_index=-100,
    )
    expected = (ref * mask.reshape(-1)).sum()
    torch.testing.assert_close(loss_sum, expected, rtol=1e-5, atol=1e-6)
    assert int(n) == int(((labels != -100) & (mask != 0)).sum())


def test_meta_build_then_materialize_equals_direct_build():
    cfg = preset("tiny-qwen2.5-7b")
    direct = GPTModel(cfg)
    lazy = GPTModel(cfg, device="meta")
    assert all(p.is_meta for p in lazy.parameters())
    lazy.materialize("cpu")
    for (name, a), (_, b) in zip(direct.named_parameters(), lazy.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_query_groups": 3}, "num_query_groups"),
        ({"hidden_size": 66}, "hidden_size"),
        ({"hidden_dropout": 1.5}, "hidden_dropout"),
        ({"recompute": "some"}, "recompute"),
        ({"kernel_backend": "cuda"}, "kernel_backend"),
        ({"params_dtype": torch.int32}, "params_dtype"),
        ({"head_dim": 7}, "head_dim"),
        ({"rope_theta": 1.0}, "rope_theta"),
        ({"rope_scaling": {"factor": 8}}, "rope_scaling"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    base = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=250
    )
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**(base | kwargs))


@pytest.mark.parametrize(
    ("changes", "parallel", "seq", "match"),
    [
        ({}, {"tp": 3}, None, "num_attention_heads=4 is not divisible by tp=3"),
        ({"num_query_groups": 2}, {"tp": 4}, None, "num_query_groups=2 is not divisible by tp=4"),
        ({"sequence_parallel": True}, {}, None, "sequence_parallel=True needs tp > 1"),
        (
            {"make_vocab_size_divisible_by": 5, "vocab_size": 251},
            {"tp": 2},
            None,
            "make_vocab_size_divisible_by=5",
        ),
        ({}, {"cp": 2}, 18, "not divisible by 2\\*cp=4"),
        ({"sequence_parallel": True}, {"tp": 2}, 15, "not divisible by tp=2"),
    ],
)
def test_bad_layout_is_rejected_before_groups(changes, parallel, seq, match):
    cfg = preset("tiny-llama3-8b", **changes)
    with pytest.raises(ValueError, match=match):
        cfg.check_layout(ParallelConfig(**parallel), seq_length=seq)


def test_model_without_layer_range_at_pp2_is_rejected():
    groups = layout_groups(ParallelConfig(pp=2), 2, 0)
    with pytest.raises(ValueError, match="layer_range"):
        GPTModel(preset("tiny-llama3-8b"), groups)


def test_presets_build_tiny_twins_and_reject_unknown():
    for name in ("tiny-llama3.2-1b", "tiny-qwen3-8b", "tiny-llama2-7b"):
        model = GPTModel(preset(name))
        ids, labels = random_batch(250)
        loss_sum, n = model(ids, labels=labels)
        assert torch.isfinite(loss_sum) and int(n) == 29
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt-5")


def test_compute_dtype_differs_from_params_dtype():
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float32, compute_dtype=torch.bfloat16)
    model = GPTModel(cfg)
    ids, labels = random_batch(cfg.vocab_size)
    assert model(ids).dtype == torch.bfloat16
    loss_sum, _ = model(ids, labels=labels)
    loss_sum.backward()
    ref_sum, _ = GPTModel(cfg.replace(compute_dtype=None))(ids, labels=labels)
    assert loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, ref_sum, rtol=3e-2, atol=0)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_every_parameter_carries_its_layout():
    from shardwork.parallel_state import get_param_meta

    cfg = preset("tiny-qwen3-8b", sequence_parallel=True, tie_word_embeddings=True)
    groups = layout_groups(ParallelConfig(tp=2, pp=2), 4, 3)  # last stage, tp rank 1
    stage = GPTModel(cfg, groups, layer_range=(1, 2), device="meta")
    metas = {n: get_param_meta(p) for n, p in stage.named_parameters()}
    assert all(hasattr(p, "_shardwork_param_meta") for p in stage.parameters())
    layer = "decoder.layers.0."
    assert metas[layer + "self_attention.linear_qkv.weight"].tp_partition_sizes == (64, 32, 32)
    assert metas[layer + "mlp.fc1.weight"].tp_partition_sizes == (96, 96)
    assert metas[layer + "mlp.fc2.weight"].tp_axis == 1
    assert metas[layer + "input_layernorm.weight"].sequence_parallel
    assert metas[layer + "self_attention.q_layernorm.weight"].sequence_parallel
    head = metas["output_layer.linear.weight"]
    assert head.shared_embedding and head.tp_axis == 0
    state = stage.sharded_state_dict()
    tied = state["embedding.word_embeddings.weight"]
    assert tied.replica_id > 0 and tied.global_offset == (128, 0)
    assert tied.global_shape == (250, 64) and tuple(tied.data.shape) == (122, 64)
