"""A hybrid stack (Mamba, attention, Mamba) at TP=2 and TP=2+SP equals the world-1 model.

Each rank builds the world-1 model too (layout-free init gives both the same weights, checked
bit for bit), then both run three fp64 SGD steps: the loss and every parameter's full
gradient agree at each step to rtol 1e-9, as in ``test_tensor_parallel.py``. The TP=2 case
also runs the first Mamba layer's generation ``step`` token by token on its TP-local heads
and compares it with the world-1 layer's whole-sequence forward. A checkpoint saved at TP=2+SP
loads at PP=2 (a model of another init seed) into exactly the saved values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwork.dist_checkpoint import load, save
from shardwork.models import (
    AttentionInputs,
    DecoderSpec,
    GPTConfig,
    GPTModel,
    LayerSpec,
    MambaConfig,
    RotarySpec,
    loss_for_backward,
    reduce_loss,
)
from shardwork.models.full_state import full_state_dict
from shardwork.models.testing import random_batch
from shardwork.parallel_state import (
    ParallelConfig,
    ProcessGroups,
    get_param_meta,
    init_process_groups,
)
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks

pytestmark = pytest.mark.multirank
RTOL64 = 1e-9
LR = 0.5


def hybrid_config(**kw) -> GPTConfig:
    base = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        vocab_size=100,
        params_dtype=torch.float64,
        mamba=MambaConfig(num_heads=4, head_dim=8, state_size=6, num_groups=2, chunk_size=4),
    )
    return GPTConfig(**(base | kw))


def hybrid_spec(cfg: GPTConfig) -> DecoderSpec:
    mamba, attention = LayerSpec(mixer="mamba"), LayerSpec(mixer="attention")
    return DecoderSpec(layers=(mamba, attention, mamba), rotary=RotarySpec(cfg.kv_channels))


def _sgd_step(model, groups, ids, labels):
    model.zero_grad(set_to_none=True)
    loss_sum, n = model(ids, labels=labels)
    loss_for_backward(loss_sum, n, groups.dp_cp).backward()
    for p in model.parameters():  # finalize_model_grads for a plain module (no dp here)
        if p.grad is not None and get_param_meta(p).sequence_parallel and groups.size("tp") > 1:
            dist.all_reduce(p.grad, group=groups.tp)
    loss = reduce_loss(loss_sum, n, groups.dp_cp)
    return loss


def _compare(sequence_parallel: bool) -> list[float]:
    groups = init_process_groups(ParallelConfig(tp=2))
    cfg = hybrid_config(sequence_parallel=sequence_parallel)
    spec = hybrid_spec(cfg)
    single = ProcessGroups.single()
    own = dist.new_group([dist.get_rank()])
    ref = GPTModel(cfg.replace(sequence_parallel=False), single, spec=spec)
    model = GPTModel(cfg, groups, spec=spec)
    ref_params, params = full_state_dict(ref, group=own), full_state_dict(model)
    assert set(params) == set(ref_params)
    for key, value in ref_params.items():
        assert torch.equal(params[key], value), key
    losses = []
    ids, labels = random_batch(cfg.vocab_size, batch=2, seq=16)
    for _ in range(3):
        ref_loss = _sgd_step(ref, single, ids, labels)
        loss = _sgd_step(model, groups, ids, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL64, atol=0)
        ref_grads = full_state_dict(ref, grads=True, group=own)
        grads = full_state_dict(model, grads=True)
        assert set(grads) == set(ref_grads) == set(params)
        for key, ref_grad in ref_grads.items():
            torch.testing.assert_close(
                grads[key], ref_grad, rtol=RTOL64, atol=RTOL64 * 1e-3, msg=lambda m, k=key: k + m
            )
        with torch.no_grad():
            for m in (ref, model):
                for p in m.parameters():
                    p.sub_(LR * p.grad)
        losses.append(float(loss))
    assert losses[-1] < losses[0]  # the same batch each step: its loss falls
    if not sequence_parallel:
        _check_tp_step(ref, model)
    return losses


def _check_tp_step(ref, model) -> None:
    """The TP-local ``step`` of layer 0's mixer equals the world-1 mixer's forward."""
    ref_mixer = ref.decoder.layers[0].self_attention
    mixer = model.decoder.layers[0].self_attention
    assert mixer.heads == ref_mixer.heads // 2
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, 2, 32, generator=gen, dtype=torch.float64)
    none = AttentionInputs(cos=torch.empty(0), sin=torch.empty(0), mask=None)
    with torch.no_grad():
        whole = ref_mixer(hidden, none)
        state, outs = mixer.init_state(2), []
        for t in range(hidden.shape[0]):
            out, state = mixer.step(hidden[t], state)
            outs.append(out)
    # Sums over the other rank's heads arrive through the all-reduce: a few fp64 ulps.
    assert_close_at_scale(torch.stack(outs), whole, rtol=0, ulps=64, name="tp step")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_hybrid_stack_matches_single_rank_fp64(sequence_parallel):
    a, b = run_on_ranks(_compare, 2, args=(sequence_parallel,))
    assert a == b


def _save_tp2_load_pp2(path: str) -> None:
    cfg = hybrid_config()
    spec = hybrid_spec(cfg)
    saver = GPTModel(
        cfg.replace(sequence_parallel=True), init_process_groups(ParallelConfig(tp=2)), spec=spec
    )
    save(saver.sharded_state_dict(), path)
    expected = full_state_dict(saver)
    groups = init_process_groups(ParallelConfig(pp=2))
    # stage 0: Mamba and attention layers, stage 1: the second Mamba layer
    layers = (0, 2) if groups.rank("pp") == 0 else (2, 3)
    loader = GPTModel(cfg.replace(init_seed=99), groups, spec=spec, layer_range=layers)
    before = full_state_dict(loader)
    load(loader.sharded_state_dict(), path)
    after = full_state_dict(loader)
    assert set(after) == set(expected)
    assert any(not torch.equal(before[k], expected[k]) for k in expected)
    for key in expected:
        assert torch.equal(after[key], expected[key]), key


def test_checkpoint_saved_at_tp2_sp_loads_at_pp2(tmp_path):
    run_on_ranks(_save_tp2_load_pp2, 2, args=(str(tmp_path / "ckpt"),))
