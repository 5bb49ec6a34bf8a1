"""Multi-token prediction: loss and gradients against a plain reference, packed sequences
(targets rolled per document), the separately logged per-depth losses, and PP=2 (MTP on the
last stage; the embedding copy's gradient synced through finalize_model_grads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwork.models import GPTModel, preset
from shardwork.models.moe.testing import compare_moe_layout
from shardwork.models.mtp import MTPConfig, roll_for_depth
from shardwork.parallel_state.testing import run_on_ranks

V = 250
# fused-kernels' cross entropy keeps float32 statistics for float64 inputs: gradients agree
# with the plain-torch reference to float32 rounding.


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rolled_reference(ids, labels, k, cu):
    """Plain loops: position i of document d predicts labels[i+k] if i+k is still in d."""
    b, s = ids.shape
    bounds = [(0, s)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    out_ids = torch.zeros_like(ids)
    out_lab = torch.full_like(labels, -100)
    for row in range(b):
        for start, stop in bounds:
            for i in range(start, stop):
                if i + k < stop:
                    out_ids[row, i] = ids[row, i + k]
                    out_lab[row, i] = labels[row, i + k]
    return out_ids, out_lab


def _reference_mtp_sums(model, ids, labels, cu):
    """MTP loss sums per depth, written out with plain torch from the model's weights."""
    cfg = model.config
    eps = cfg.norm_epsilon
    hidden = model.embedding(ids)
    inputs = model._attention_inputs(ids.shape[1], cu, ids.device)
    hidden = model.decoder(hidden, inputs)  # includes the final norm
    emb_w = model.embedding.weight
    head_w = model.output_layer.linear.weight
    sums = []
    for k, depth in enumerate(model.mtp.layers, start=1):
        ids_k, lab_k = _rolled_reference(ids, labels, k, cu)
        e = F.embedding(ids_k.t(), emb_w)
        x = torch.cat((_rms(e, depth.enorm.weight, eps), _rms(hidden, depth.hnorm.weight, eps)), -1)
        hidden = depth.transformer_layer(x @ depth.eh_proj.weight.t(), inputs)
        logits = _rms(hidden, depth.final_layernorm.weight, eps) @ head_w.t()
        flat = logits[..., :V].transpose(0, 1).reshape(-1, V)
        sums.append(F.cross_entropy(flat, lab_k.reshape(-1), ignore_index=-100, reduction="sum"))
    return sums


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_mtp_loss_and_grads_match_plain_reference(packed):
    mtp = MTPConfig(num_layers=2, loss_coeff=0.3)
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float64, mtp=mtp)
    gen = torch.Generator().manual_seed(0)
    batch = 1 if packed else 2
    ids = torch.randint(0, V, (batch, 16), generator=gen)
    labels = torch.randint(0, V, (batch, 16), generator=gen)
    labels[0, 1] = -100
    cu = torch.tensor([0, 5, 11, 16]) if packed else None

    model = GPTModel(cfg)
    n_main = int((labels != -100).sum())
    model.mtp_loss_scale.set(1.0 / n_main)
    loss_sum, n = model(ids, labels=labels, cu_seqlens=cu)
    (loss_sum / n).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    logged = model.mtp.tracker.values.clone()

    ref = GPTModel(cfg)
    ref.mtp_loss_scale.set(0.0)  # the model's own MTP path contributes nothing here
    ref_main, ref_n = ref(ids, labels=labels, cu_seqlens=cu)
    sums = _reference_mtp_sums(ref, ids, labels, cu)
    for p in ref.parameters():
        p.grad = None
    total = ref_main + mtp.loss_coeff / mtp.num_layers * sum(sums)
    (total / ref_n).backward()

    torch.testing.assert_close(loss_sum, ref_main, rtol=1e-12, atol=0)
    for k, depth_sum in enumerate(sums):
        torch.testing.assert_close(logged[k, 0], depth_sum.detach(), rtol=1e-10, atol=0)
        counted = int((_rolled_reference(ids, labels, k + 1, cu)[1] != -100).sum())
        assert logged[k, 1] == counted
    for key, p in ref.named_parameters():
        torch.testing.assert_close(
            grads[key], p.grad, rtol=1e-5, atol=1e-9, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert any(float(grads[k].abs().sum()) > 0 for k in grads if k.startswith("mtp."))


def test_roll_never_crosses_documents():
    ids = torch.arange(12).view(1, 12)
    labels = ids + 100
    cu = torch.tensor([0, 4, 9, 12])
    for k in (1, 2, 3):
        got_ids, got_lab, _ = roll_for_depth(ids, labels, None, depth=k, cu_seqlens=cu)
        ref_ids, ref_lab = _rolled_reference(ids, labels, k, cu)
        assert torch.equal(got_lab, ref_lab) and torch.equal(got_ids, ref_ids)


def _pp2(name, kwargs):
    return compare_moe_layout(name, **kwargs)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("tiny-deepseek-v3", {"pp": 2, "num_layers": 4}),
        ("tiny-llama3.2-1b", {"pp": 2, "mtp": MTPConfig(num_layers=2, loss_coeff=0.5)}),
        (
            "tiny-llama3-8b",
            {
                "pp": 2,
                "batch": 1,
                "mtp": MTPConfig(num_layers=1),
                "cu_seqlens": torch.tensor([0, 7, 16]),
            },
        ),
    ],
    ids=["dsv3-moe-mla-untied", "tied-2-depths", "packed"],
)
def test_mtp_pp2_matches_single_rank(name, kwargs):
    losses = run_on_ranks(_pp2, 2, args=(name, kwargs))
    assert len(set(losses)) == 1
