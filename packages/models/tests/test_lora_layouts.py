"""LoRA across layouts: loss and every gradient (adapters' and the frozen base's zeros) at
TP=2, TP=2+SP (also with full recompute), MLA at TP=2+SP, experts at EP=2 and PP=2 equal
world size 1 for the same seed (float64, dropout off); the initial adapters are the same
global tensors at every layout; merge at TP=2 folds per shard; an adapter checkpoint saved at
TP=2 loads at world 1; adapter dropout keeps TP-replicated factors in step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwork.models import GPTModel, preset
from shardwork.models.full_state import full_state_dict
from shardwork.models.logits import gather_logits
from shardwork.models.lora import apply_lora, is_lora_key, merge_lora, unmerge_lora
from shardwork.models.lora_checkpoint import load_lora_checkpoint, save_lora_checkpoint
from shardwork.models.lora_config import LoRAConfig
from shardwork.models.moe.testing import compare_moe_layout
from shardwork.models.testing import compare_with_single_rank, random_batch, randomize_lora_b
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks

pytestmark = pytest.mark.multirank
RTOL64 = 1e-9
DENSE = ("linear_qkv", "linear_proj", "fc1", "fc2")
# One regular expression (the string form of target_modules): every MLA projection present.
MLA = r".*self_attention\.linear_(q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj|proj)"


def _with_lora(targets):
    def prepare(model):
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=targets))
        # Only B is overwritten: A keeps its initial values, which compare_with_single_rank
        # checks are the same global tensors at both layouts.
        randomize_lora_b(model)

    return prepare


def _dense_prepare(model):
    _with_lora(DENSE)(model)


def _mla_prepare(model):
    _with_lora(MLA)(model)


def _expert_prepare(model):
    _with_lora(("experts.linear_fc1", "experts.linear_fc2", "linear_qkv"))(model)


def _hybrid_prepare(model):
    _with_lora(("in_proj", "out_proj", "linear_qkv", "fc1", "fc2"))(model)


PREPARE = {"dense": _dense_prepare, "mla": _mla_prepare, "hybrid": _hybrid_prepare}


def _compare(name, kwargs, prepare):
    # By name: the rank workers unpickle arguments, and this test module is not importable there.
    return compare_with_single_rank(name, prepare=PREPARE[prepare], **kwargs)


@pytest.mark.parametrize(
    ("name", "kwargs", "prepare"),
    [
        ("tiny-llama3-8b", {"tp": 2}, "dense"),
        ("tiny-llama3-8b", {"tp": 2, "sequence_parallel": True}, "dense"),
        ("tiny-deepseek-v2-lite", {"tp": 2, "sequence_parallel": True}, "mla"),
        ("tiny-llama3-8b", {"tp": 2, "sequence_parallel": True, "recompute": "full"}, "dense"),
        ("tiny-nemotron-h-8b", {"tp": 2, "sequence_parallel": True}, "hybrid"),
    ],
    ids=["tp2", "tp2-sp", "mla-tp2-sp", "tp2-sp-full-recompute", "mamba-tp2-sp"],
)
def test_lora_layout_matches_single_rank(name, kwargs, prepare):
    losses = run_on_ranks(_compare, 2, args=(name, kwargs | {"rtol": RTOL64}, prepare))
    assert len(set(losses)) == 1


def _moe(kwargs):
    return compare_moe_layout("tiny-mixtral-8x7b", prepare=_expert_prepare, rtol=RTOL64, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"ep": 2, "etp": 1}, {"pp": 2}, {"tp": 2, "etp": 1}],
    ids=["ep2", "pp2", "tp2-etp1"],
)
def test_lora_experts_match_single_rank(kwargs):
    run_on_ranks(_moe, 2, args=(kwargs,))


def _adapter_grads_nonzero(name):
    groups = init_process_groups(ParallelConfig(tp=2))
    cfg = preset(name, params_dtype=torch.float64)
    model = GPTModel(cfg, groups)
    _dense_prepare(model)
    ids, labels = random_batch(cfg.vocab_size)
    loss_sum, _n = model(ids, labels=labels)
    loss_sum.backward()
    grads = full_state_dict(model, grads=True, keys=is_lora_key)
    return {k: float(v.abs().max()) for k, v in grads.items()}


def test_every_adapter_factor_gets_a_gradient():
    """Guards the layout test against comparing zeros with zeros."""
    grads = run_on_ranks(_adapter_grads_nonzero, 2, args=("tiny-llama3-8b",))[0]
    assert grads and all(v > 0 for v in grads.values()), grads


def _merge_tp2(tmp):
    groups = init_process_groups(ParallelConfig(tp=2))
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float64, sequence_parallel=True)
    model = GPTModel(cfg, groups)
    _dense_prepare(model)
    ids, _ = random_batch(cfg.vocab_size)
    logits = lambda: gather_logits(model(ids), tp_group=groups.tp, vocab_size=cfg.vocab_size)  # noqa: E731
    full = full_state_dict(model)
    with torch.no_grad():
        before = logits()
        merge_lora(model)
        merged = logits()
        merged_full = full_state_dict(model)
        unmerge_lora(model)
        after = logits()
    for key in ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.fc2"):
        for part in (".q", ".k", ".v") if key.endswith("qkv") else ("",):
            w, a = full[f"{key}.weight{part}"], full[f"{key}.lora_A.weight"]
            expected = w + 2.0 * full[f"{key}.lora_B.weight{part}"] @ a
            assert_close_at_scale(merged_full[f"{key}.weight{part}"], expected, dtype=torch.float64)
    assert_close_at_scale(merged, before, ulps=32, dtype=torch.float64, name="merged logits")
    assert torch.equal(after, before)
    restored = full_state_dict(model)
    assert all(torch.equal(restored[k], v) for k, v in full.items())
    save_lora_checkpoint(model, tmp)
    return before


def _load_world1(tmp, rank):
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float64)
    model = GPTModel(cfg, ProcessGroups.single())
    apply_lora(model, LoRAConfig(rank=rank, alpha=8.0, target_modules=DENSE))
    load_lora_checkpoint(model, tmp, group=dist.new_group([dist.get_rank()]))
    ids, _ = random_batch(cfg.vocab_size)
    with torch.no_grad():
        return model(ids)[..., : cfg.vocab_size].transpose(0, 1)


def test_merge_at_tp2_and_adapter_checkpoint_loads_at_world1(tmp_path):
    tp2_logits = run_on_ranks(_merge_tp2, 2, args=(str(tmp_path / "adapters"),))[0]
    one = run_on_ranks(_load_world1, 1, args=(str(tmp_path / "adapters"), 4))[0]
    # TP splits the GEMMs' sums differently: float64 rounding at the logits' scale.
    assert_close_at_scale(one, tp2_logits, ulps=64, dtype=torch.float64, name="logits")
    with pytest.raises(Exception, match=r"rank: saved 4, model 2"):
        run_on_ranks(_load_world1, 1, args=(str(tmp_path / "adapters"), 2))


def _replicated_grads_agree(sp: bool):
    """Train-mode step at TP=2 with adapter dropout; the gradients of TP-replicated factors
    (column A, row B) on this rank, after the SP reduction finalize_model_grads would do."""
    groups = init_process_groups(ParallelConfig(tp=2))
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float64, sequence_parallel=sp)
    model = GPTModel(cfg, groups)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.3, target_modules=DENSE))
    randomize_lora_b(model)
    model.train()
    ids, labels = random_batch(cfg.vocab_size)
    loss_sum, _n = model(ids, labels=labels)
    loss_sum.backward()
    out = {}
    for name, p in model.named_parameters():
        replicated = ("linear_qkv.lora_A" in name or "fc1.lora_A" in name) or (
            "linear_proj.lora_B" in name or "fc2.lora_B" in name
        )
        if replicated:
            grad = p.grad.clone()
            if sp:  # ParamMeta.sequence_parallel: summed over TP by finalize_model_grads
                dist.all_reduce(grad, group=groups.tp)
            out[name] = grad
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_adapter_dropout_keeps_replicated_factors_in_step(sp):
    """With dropout, a TP-replicated factor must get the same gradient on every TP rank (the
    replicated RNG stream where the adapter's input is whole, per-rank masks where it is
    split), or the copies drift apart after one optimizer step."""
    first, second = run_on_ranks(_replicated_grads_agree, 2, args=(sp,))
    assert len(first) == 4 * 2  # 2 layers x (qkv A, fc1 A, proj B, fc2 B)
    for name, grad in first.items():
        assert grad.abs().max() > 0, name
        assert torch.equal(grad, second[name]), name
