"""The model's fused training loss against logits materialised in the test and ``F.cross_entropy``.

``GPTConfig.fused_linear_cross_entropy`` (default on) sends a forward with labels through
``LMHead.token_loss`` (no logits); the references here call the same model without labels (its
logits, soft-capped by ``LMHead.forward``) and compute the loss with ``F.cross_entropy`` over
the real vocabulary, loss mask and ignored labels included. World 1 (Llama, Gemma 2's tied and
soft-capped head, a float32 and a bf16 model), MTP depths against the unfused path, and TP=2/4
(with SP, tied, an all-padding vocabulary shard) against a world-1 reference computed from its
logits (``compare_with_single_rank(oracle_reference=True)``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwork.models import GPTModel, preset
from shardwork.models.testing import compare_with_single_rank, random_batch
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks

# Measured, fused vs materialised, worst over every parameter's gradient of the cases below and 3
# seeds: float64 12.0 ulp of the gradient's max|expected|, float32 9.1, bf16 1.9 (the loss:
# <= 1.1); bounds with a margin.
ULPS = {torch.float64: 32, torch.float32: 32, torch.bfloat16: 8}


def _batch(cfg, seed=0):
    ids, labels = random_batch(cfg.vocab_size, batch=2, seq=16, seed=seed)
    mask = (torch.rand(2, 16, generator=torch.Generator().manual_seed(seed + 1)) > 0.25).long()
    return ids, labels, mask


def _materialised_loss(model, ids, labels, mask):
    """``(Σ masked token losses, counted tokens)`` from the model's own logits."""
    vocab = model.config.vocab_size
    logits = model(ids)  # [s, b, V_pad]: soft-capped, padding columns masked
    z = logits[..., :vocab].transpose(0, 1).reshape(-1, vocab)
    per_token = F.cross_entropy(z.float() if z.dtype != torch.float64 else z, labels.reshape(-1),
                                reduction="none")  # fmt: skip
    weights = mask.reshape(-1).to(per_token.dtype)
    return (per_token * weights).sum(), ((labels != -100) & (mask != 0)).sum()


def _loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_sum, count = loss_fn()
    (loss_sum / count).backward()
    return loss_sum.detach(), count, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("name", "dtype", "over"),
    [
        ("tiny-llama3-8b", torch.float64, {}),
        ("tiny-llama3-8b", torch.float32, {}),  # dW computed in the forward
        ("tiny-qwen3-8b", torch.bfloat16, {}),  # recomputed in backward
        ("tiny-gemma2-9b", torch.float64, {}),  # tied head, final_logit_softcapping=30
        ("tiny-gemma2-9b", torch.float32, {"final_logit_softcapping": 0.5}),  # cap binds hard
        ("tiny-llama3-8b", torch.float64, {"tie_word_embeddings": True}),
    ],
)
def test_fused_loss_equals_materialised_logits(name, dtype, over):
    cfg = preset(name, params_dtype=dtype, **over)
    assert cfg.fused_linear_cross_entropy
    model = GPTModel(cfg)
    ids, labels, mask = _batch(cfg)
    fused = _loss_and_grads(model, lambda: model(ids, labels=labels, loss_mask=mask))
    ref = _loss_and_grads(model, lambda: _materialised_loss(model, ids, labels, mask))
    assert int(fused[1]) == int(ref[1])
    assert_close_at_scale(fused[0], ref[0], rtol=0, ulps=ULPS[dtype], name="loss")
    for key, grad in ref[2].items():
        assert_close_at_scale(fused[2][key], grad, rtol=0, ulps=ULPS[dtype], name=key)


def test_planted_uncapped_head_fails_the_check(monkeypatch):
    """The fused path without Gemma's cap is far outside the tolerance above."""
    cfg = preset("tiny-gemma2-9b", params_dtype=torch.float64, final_logit_softcapping=0.5)
    model = GPTModel(cfg)
    ids, labels, mask = _batch(cfg)
    ref = _loss_and_grads(model, lambda: _materialised_loss(model, ids, labels, mask))
    monkeypatch.setattr(model.output_layer, "final_logit_softcapping", None)
    fused = _loss_and_grads(model, lambda: model(ids, labels=labels, loss_mask=mask))
    with pytest.raises(AssertionError, match="loss"):
        assert_close_at_scale(fused[0], ref[0], rtol=0, ulps=ULPS[torch.float64], name="loss")


def test_mtp_depth_losses_equal_the_unfused_path():
    """DeepSeek-V3's MTP depths share the head: the fused model gives the unfused model's loss,
    per-depth MTP losses and gradients (its MTP gradient now reaches backward through the
    head's input instead of the logits)."""
    results = []
    for fused in (True, False):
        cfg = preset(
            "tiny-deepseek-v3", params_dtype=torch.float64, fused_linear_cross_entropy=fused
        )
        model = GPTModel(cfg)
        model.mtp_loss_scale.set(0.37)
        batch = _batch(cfg, seed=3)
        loss = _loss_and_grads(model, lambda m=model, b=batch: m(b[0], labels=b[1], loss_mask=b[2]))
        # per depth: (loss sum, token count)
        results.append((loss, model.mtp.tracker.values.clone()))
    (fused, fused_depths), (unfused, unfused_depths) = results
    assert_close_at_scale(fused[0], unfused[0], rtol=0, ulps=ULPS[torch.float64], name="loss")
    for key, grad in unfused[2].items():
        assert_close_at_scale(fused[2][key], grad, rtol=0, ulps=ULPS[torch.float64], name=key)
    assert torch.equal(fused_depths[:, 1], unfused_depths[:, 1])
    assert_close_at_scale(
        fused_depths[:, 0], unfused_depths[:, 0], rtol=0, ulps=ULPS[torch.float64], name="depths"
    )


def test_the_unfused_path_remains_available():
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float64, fused_linear_cross_entropy=False)
    model = GPTModel(cfg)
    ids, labels, mask = _batch(cfg)
    unfused = _loss_and_grads(model, lambda: model(ids, labels=labels, loss_mask=mask))
    ref = _loss_and_grads(model, lambda: _materialised_loss(model, ids, labels, mask))
    assert_close_at_scale(unfused[0], ref[0], rtol=0, ulps=ULPS[torch.float64], name="loss")
    for key, grad in ref[2].items():
        assert_close_at_scale(unfused[2][key], grad, rtol=0, ulps=ULPS[torch.float64], name=key)


def test_bad_setting_names_the_field():
    with pytest.raises(ValueError, match="fused_linear_cross_entropy='yes'"):
        preset("tiny-llama3-8b", fused_linear_cross_entropy="yes")


def _compare(name, kwargs):
    return compare_with_single_rank(name, **kwargs)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("tiny-llama3-8b", {"tp": 2}),
        ("tiny-llama3-8b", {"tp": 4, "sequence_parallel": True, "num_query_groups": 4}),
        ("tiny-gemma2-9b", {"tp": 2, "sequence_parallel": True}),
        # 180 classes padded to 256 over 4 ranks: rank 3 holds only padding rows
        (
            "tiny-llama3-8b",
            {
                "tp": 4,
                "num_query_groups": 4,
                "vocab_size": 180,
                "make_vocab_size_divisible_by": 256,
            },
        ),
        ("tiny-qwen3-8b", {"tp": 2, "dtype": torch.float32, "rtol": 1e-4}),
        ("tiny-llama3-8b", {"tp": 2, "fused_linear_cross_entropy": False}),
    ],
    ids=[
        "tp2",
        "tp4-sp",
        "tp2-sp-gemma2-softcap-tied",
        "tp4-padding-rank",
        "tp2-fp32",
        "tp2-unfused",
    ],
)
def test_layout_equals_a_single_rank_reference_from_logits(name, kwargs):
    world = kwargs["tp"]
    losses = run_on_ranks(_compare, world, args=(name, {"oracle_reference": True} | kwargs))
    assert len(set(losses)) == 1
