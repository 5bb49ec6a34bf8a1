"""optimizer.name = "muon" on fused attention QKV weights: they form their own Muon group
(``fused_blocks=3``), and one step updates each layer's [Q | K | V] weight exactly as plain
Muon updates separate Q, K and V matrices (not one fused matrix, not per head)."""

import torch

from shardwork.trainer.run.setup import build_assembly, init_runtime
from shardwork.trainer.testing import TINY_SECTIONS, tiny_config

MUON = {"name": "muon", "lr": 3e-3, "min_lr": 3e-3, "muon_lr": 0.03, "muon_momentum": 0.9}


def plain_muon_step(weight, grad, group, pieces=None):
    """``weight`` after one plain dist-optimizer Muon step on separate matrices (no ParamMeta)."""
    from shardwork.dist_optimizer import Muon

    rows = list(pieces) if pieces is not None else [weight.size(0)]
    params = [torch.nn.Parameter(w.clone()) for w in weight.split(rows)]
    for p, g in zip(params, grad.split(rows)):
        p.grad = g.clone()
    keys = ("lr", "momentum", "nesterov", "ns_steps", "weight_decay")
    Muon(params, **{k: group[k] for k in keys}).step()
    return torch.cat([p.detach() for p in params])


def test_qkv_weights_form_a_muon_group_orthogonalised_per_block(tmp_path):
    config = tiny_config(tmp_path, optimizer=MUON)
    assembly = build_assembly(config, init_runtime(config))
    opt = assembly.optimizer
    names = {id(op.master): op.name for op in opt.owned}
    qkv_names = [f"decoder.layers.{i}.self_attention.linear_qkv.weight" for i in range(2)]
    (group,) = [g for g in opt.param_groups if g.get("fused_blocks") is not None]
    assert sorted(names[id(p)] for p in group["params"]) == qkv_names
    assert group["fused_blocks"] == 3 and group["use_muon"] and group["head_dim"] is None
    assert group["lr_mult"] == MUON["muon_lr"] / MUON["lr"]

    # one step with random gradients in every main_grad
    (chunk,) = assembly.chunks
    gen = torch.Generator().manual_seed(0)
    for p in chunk.buffer_params():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    qkv = dict(chunk.module.named_parameters())[qkv_names[0]]
    before, grad = qkv.detach().clone(), qkv.main_grad.clone()
    assert opt.step().update_successful
    # block sizes from the model config: GQA with 4 query heads, 2 key/value heads
    mc = assembly.model_config
    q, kv = mc.num_attention_heads * mc.kv_channels, mc.kv_heads * mc.kv_channels
    assert (q, kv) == (32, 16)
    want = plain_muon_step(before, grad, group, pieces=(q, kv, kv))
    torch.testing.assert_close(qkv.detach(), want, rtol=1e-5, atol=1e-6)
    per_head = plain_muon_step(before, grad, group, pieces=[mc.kv_channels] * 8)
    whole = plain_muon_step(before, grad, group)
    for other in (per_head, whole):  # the alternatives give another update
        assert (other - want).abs().max() > 1e-3


def test_gated_attention_qkv_is_orthogonalised_per_block_with_its_gate(tmp_path):
    """With ``attention_output_gate`` (Qwen3-Next) ``linear_qkv`` is [Q | K | V | gate]: the
    Muon group checks 4 blocks (building the optimizer does not fail) and the step
    orthogonalises the gate block on its own too."""
    model = {**TINY_SECTIONS["model"], "attention_output_gate": True}
    config = tiny_config(tmp_path, optimizer=MUON, model=model)
    assembly = build_assembly(config, init_runtime(config))
    opt = assembly.optimizer
    (group,) = [g for g in opt.param_groups if g.get("fused_blocks") is not None]
    assert group["fused_blocks"] == 4

    (chunk,) = assembly.chunks
    gen = torch.Generator().manual_seed(0)
    for p in chunk.buffer_params():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    qkv = dict(chunk.module.named_parameters())[name]
    before, grad = qkv.detach().clone(), qkv.main_grad.clone()
    assert opt.step().update_successful
    # 4 query heads and 2 key/value heads of 8 channels; the gate has the queries' size
    q, kv = 4 * 8, 2 * 8
    assert qkv.shape[0] == q + kv + kv + q
    want = plain_muon_step(before, grad, group, pieces=(q, kv, kv, q))
    torch.testing.assert_close(qkv.detach(), want, rtol=1e-5, atol=1e-6)
