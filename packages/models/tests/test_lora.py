"""LoRA at world size 1: forward against ``W x + scaling · B A x`` written here, trainable
parameters counted from the shapes, merge/unmerge, target validation, loading full adapters.

Layouts (TP=2, TP=2+SP, adapter checkpoints across layouts) are in ``test_lora_layouts.py``.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.models import AttentionInputs, GPTModel, preset
from shardwork.models.full_state import full_state_dict
from shardwork.models.lora import (
    apply_lora,
    is_lora_key,
    load_lora_state,
    merge_lora,
    unmerge_lora,
)
from shardwork.models.lora_config import LoRAConfig
from shardwork.models.rng import REPLICATED, TENSOR_PARALLEL
from shardwork.models.testing import random_batch, randomize_lora_b
from shardwork.parallel_state.testing import assert_close_at_scale


def _model(name, targets, **lora):
    cfg = preset(name, params_dtype=torch.float64, mtp=None)
    model = GPTModel(cfg)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=targets, **lora))
    randomize_lora_b(model)
    return model, dict(model.named_sharded_modules())


_MAMBA = "decoder.layers.0.self_attention"  # the mixer of a hybrid layer
_DELTANET = "decoder.layers.0.self_attention"
_DELTANET_BLOCKS = (".q", ".k", ".v", ".z", ".b", ".a")


def _cat(full, prefix, blocks):
    return torch.cat([full[prefix + b] for b in blocks]) if blocks else full[prefix]


@pytest.mark.parametrize(
    ("name", "module", "blocks", "lora"),
    [
        ("tiny-llama3-8b", "decoder.layers.1.self_attention.linear_qkv", (".q", ".k", ".v"), {}),
        ("tiny-llama3-8b", "decoder.layers.0.self_attention.linear_proj", (), {}),
        ("tiny-llama3-8b", "decoder.layers.0.mlp.fc1", (".gate", ".up"), {"use_rslora": True}),
        ("tiny-llama3-8b", "decoder.layers.1.mlp.fc2", (), {}),
        ("tiny-deepseek-v3", "decoder.layers.0.self_attention.linear_q_up_proj", (), {}),
        ("tiny-deepseek-v3", "decoder.layers.0.self_attention.linear_kv_down_proj", (), {}),
        ("tiny-nemotron-h-8b", _MAMBA + ".in_proj", (".z", ".x", ".B", ".C", ".dt"), {}),
        ("tiny-nemotron-h-8b", _MAMBA + ".out_proj", (), {}),
        ("tiny-qwen3-next-80b-a3b", _DELTANET + ".in_proj", _DELTANET_BLOCKS, {}),
        ("tiny-qwen3-next-80b-a3b", _DELTANET + ".out_proj", (), {}),
    ],
    ids=[
        "qkv",
        "proj",
        "fc1-gate-up-rslora",
        "fc2",
        "mla-q-up",
        "mla-kv-down-replicated",
        "mamba-in",
        "mamba-out",
        "deltanet-in",
        "deltanet-out",
    ],
)
def test_forward_is_base_plus_scaled_ba(name, module, blocks, lora):
    model, modules = _model(name, (module,), **lora)
    full = full_state_dict(model)
    w = _cat(full, module + ".weight", blocks)
    a = full[module + ".lora_A.weight"]
    b = _cat(full, module + ".lora_B.weight", blocks)
    scaling = 8.0 / (4**0.5 if lora.get("use_rslora") else 4)
    x = torch.randn(
        5, 2, w.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    expected = x @ w.T + scaling * (x @ a.T) @ b.T
    actual = modules[module](x)
    assert_close_at_scale(actual, expected, dtype=torch.float64, name=module)
    # The adapter really contributes (B is random, not PEFT's zero init).
    assert (actual - x @ w.T).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("module", "blocks", "stream"),
    [
        ("decoder.layers.0.self_attention.linear_qkv", (".q", ".k", ".v"), REPLICATED),
        ("decoder.layers.1.mlp.fc2", (), TENSOR_PARALLEL),
    ],
    ids=["column-qkv", "row-fc2"],
)
def test_dropout_masks_the_adapter_input_only(module, blocks, stream):
    """Training mode: ``W x + scaling · B A (x ⊙ mask / (1 - p))``, the base path undropped, the
    mask drawn from the model's RNG stream for that input (replicated for a column-parallel
    input without SP, per TP rank for a row-parallel one); eval mode drops nothing."""
    p = 0.5
    model, modules = _model("tiny-llama3-8b", (module,), dropout=p)
    full = full_state_dict(model)
    w = _cat(full, module + ".weight", blocks)
    a = full[module + ".lora_A.weight"]
    b = _cat(full, module + ".lora_B.weight", blocks)
    x = torch.randn(
        6, 2, w.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    layer = modules[module].train()
    tracker = model.rng_tracker
    states = tracker.get_states()
    dropped = layer(x)
    tracker.set_states(states)
    with tracker.fork(stream):  # the same draws: a Bernoulli(1 - p) keep mask of x's shape
        keep = torch.empty_like(x).bernoulli_(1 - p)
    assert 0 < int(keep.sum()) < keep.numel()
    expected = x @ w.T + 2.0 * ((x * keep / (1 - p)) @ a.T) @ b.T
    assert_close_at_scale(dropped, expected, dtype=torch.float64, name="dropped")
    whole = x @ w.T + 2.0 * (x @ a.T) @ b.T
    assert (dropped - whole).abs().max() > 1e-3  # the mask really changed the adapter's path
    with torch.no_grad():
        assert_close_at_scale(layer.eval()(x), whole, dtype=torch.float64, name="eval")


@pytest.mark.parametrize("fc", ["linear_fc1", "linear_fc2"])
def test_expert_forward_uses_each_experts_own_adapter(fc):
    prefix = f"decoder.layers.1.mlp.experts.{fc}"
    model, modules = _model("tiny-mixtral-8x7b", (f"experts.{fc}",))
    full = full_state_dict(model)
    experts = modules["decoder.layers.1.mlp.experts"]
    num = experts.num_local_experts
    blocks = (".gate", ".up") if fc == "linear_fc1" else ()
    counts = torch.tensor([3, 0, 5, 2][:num] + [1] * max(0, num - 4))
    in_size = modules[prefix].weight.shape[2]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(int(counts.sum()), in_size, dtype=torch.float64, generator=gen)
    actual = modules[prefix](x, counts, "auto")
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        w = _cat(full, f"{prefix}.weight.{e}", blocks)
        a = full[f"{prefix}.lora_A.weight.{e}"]
        b = _cat(full, f"{prefix}.lora_B.weight.{e}", blocks)
        xe = x[start : start + n]
        rows.append(xe @ w.T + 2.0 * (xe @ a.T) @ b.T)
        start += n
    assert_close_at_scale(actual, torch.cat(rows), dtype=torch.float64, name=prefix)


@pytest.mark.parametrize(
    ("name", "mixer"),
    [("tiny-nemotron-h-8b", _MAMBA), ("tiny-qwen3-next-80b-a3b", _DELTANET)],
    ids=["mamba", "deltanet"],
)
def test_mixer_step_runs_the_adapters(name, mixer):
    """Token-by-token generation of a Mamba-2 / Gated DeltaNet mixer with adapters on its
    ``in_proj`` and ``out_proj`` equals the forward of the same mixer with the adapters merged
    into its weights (``W + scaling · B A``), which differs from the base mixer's."""
    model, modules = _model(name, (f"{mixer}.in_proj", f"{mixer}.out_proj"))
    layer = modules[mixer]
    x = torch.randn(9, 2, model.config.hidden_size, dtype=torch.float64)
    whole = AttentionInputs(cos=torch.empty(0), sin=torch.empty(0), mask=None)
    with torch.no_grad():
        state, steps = layer.init_state(2), []
        for t in range(x.shape[0]):
            out, state = layer.step(x[t], state)
            steps.append(out)
        merge_lora(model)
        merged = layer(x, whole)
        unmerge_lora(model)
        unmerged = layer(x, whole)
        for m in (layer.in_proj, layer.out_proj):
            m.lora_B.weight.zero_()
        without = layer(x, whole)
    # The step sums in another order than the chunked forward: measured at most 3 fp64 ulps
    # (Mamba) of the output's scale in the mixers' own step tests; bound as theirs.
    assert_close_at_scale(torch.stack(steps), merged, rtol=0, ulps=256, name="steps")
    assert_close_at_scale(unmerged, merged, rtol=0, ulps=256, name="unmerged forward")
    assert (merged - without).abs().max() > 1e-3


def test_only_adapters_train_and_their_count_follows_the_shapes():
    cfg = preset("tiny-llama3-8b", params_dtype=torch.float64)
    model = GPTModel(cfg)
    r = 4
    names = apply_lora(model, LoRAConfig(rank=r, target_modules=("linear_qkv", "fc2")))
    h, d = cfg.hidden_size, cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    per_layer = r * (h + qkv_out) + r * (cfg.ffn_hidden_size + h)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == cfg.num_layers * per_layer
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(names) == 2 * cfg.num_layers


def test_init_is_pefts_default():
    fresh = GPTModel(preset("tiny-llama3-8b", params_dtype=torch.float64, mtp=None))
    apply_lora(fresh, LoRAConfig(rank=4, target_modules=("fc2",)))
    full = full_state_dict(fresh, keys=is_lora_key)
    for key, value in full.items():
        if ".lora_B." in key:
            assert torch.count_nonzero(value) == 0, key
        else:  # kaiming-uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), in = ffn width here
            bound = value.shape[1] ** -0.5
            assert value.abs().max() <= bound and value.abs().max() > 0.9 * bound, key
            assert abs(float(value.mean())) < 0.2 * bound, key


@pytest.mark.parametrize(
    ("name", "targets", "key"),
    [
        ("tiny-llama3-8b", ("linear_qkv", "linear_proj", "fc1", "fc2"), "decoder.layers.0.mlp.fc2"),
        # Experts only: the router then sees bit-identical inputs, so no near-tie can flip.
        (
            "tiny-mixtral-8x7b",
            ("experts.linear_fc1", "experts.linear_fc2"),
            "decoder.layers.0.mlp.experts.linear_fc2",
        ),
    ],
    ids=["dense", "experts"],
)
def test_merge_matches_unmerged_and_unmerge_restores_bit_exactly(name, targets, key):
    model, _ = _model(name, targets)
    ids, _ = random_batch(model.config.vocab_size)
    base = {k: v for k, v in full_state_dict(model).items() if not is_lora_key(k)}
    vocab = model.config.vocab_size
    with torch.no_grad():
        # Real vocabulary columns only: the padded ones hold -finfo.max, which would make any
        # tolerance at the tensor's scale meaningless.
        before = model(ids)[..., :vocab].clone()
        merge_lora(model)
        merged = model(ids)[..., :vocab]
        merged_weights = full_state_dict(model)
        unmerge_lora(model)
        after = model(ids)[..., :vocab]
    # Merged weights are W + scaling·B@A, computed here from the full tensors.
    suffix = ".3" if "experts" in key else ""  # one expert's own weight and adapter
    weight, b, a = (f"{key}.{t}{suffix}" for t in ("weight", "lora_B.weight", "lora_A.weight"))
    expected = base[weight] + 2.0 * (merged_weights[b] @ merged_weights[a])
    assert_close_at_scale(merged_weights[weight], expected, dtype=torch.float64)
    # Merging changes the summation order only: rounding at float64's scale (measured
    # max |diff| = 4.3 (dense) and 2.7 (experts) ulps of max|logit|); bound 32 ulps, margin for
    # other CPUs' kernels.
    assert_close_at_scale(merged, before, ulps=32, dtype=torch.float64, name="merged logits")
    restored = {k: v for k, v in full_state_dict(model).items() if not is_lora_key(k)}
    for k, v in base.items():
        assert torch.equal(restored[k], v), k
    assert torch.equal(after, before)


def test_bad_targets_are_refused_with_the_choices():
    model = GPTModel(preset("tiny-llama3-8b", params_dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\['q_proj'\] match no module.*linear_qkv"):
        apply_lora(model, LoRAConfig(target_modules=("linear_qkv", "q_proj")))
    with pytest.raises(ValueError, match=r"'decoder.layers.0.mlp' \(SwiGLUMLP\).*cannot adapt"):
        apply_lora(model, LoRAConfig(target_modules=("mlp",)))
    with pytest.raises(ValueError, match="LM head"):
        apply_lora(model, LoRAConfig(target_modules=r"output_layer\.linear"))
    # A regular expression given as a list entry (a command line's one value) is named as such;
    # a plain unmatched suffix is not.
    with pytest.raises(ValueError, match=r"not a regular expression: .*one string"):
        apply_lora(model, LoRAConfig(target_modules=(r"decoder\.layers\.3\..*fc1",)))
    with pytest.raises(ValueError, match=r"linear_qkv'\]$"):
        apply_lora(model, LoRAConfig(target_modules=("mlp.q_proj",)))
    assert all(p.requires_grad for p in model.parameters())  # nothing changed before the error


def test_load_lora_state_round_trips_and_refuses_another_rank():
    model, _ = _model("tiny-llama3-8b", ("linear_qkv", "fc2"))
    adapters = full_state_dict(model, keys=is_lora_key)
    other, _ = _model("tiny-llama3-8b", ("linear_qkv", "fc2"))
    randomize_lora_b(other, seed=7)
    load_lora_state(other, adapters)
    for key, value in full_state_dict(other, keys=is_lora_key).items():
        assert torch.equal(value, adapters[key]), key
    small = GPTModel(preset("tiny-llama3-8b", params_dtype=torch.float64))
    apply_lora(small, LoRAConfig(rank=2, target_modules=("linear_qkv", "fc2")))
    with pytest.raises(ValueError, match="different LoRA rank"):
        load_lora_state(small, adapters)


def test_factor_modules_run_their_forward_hooks():
    """Every adapter factor is called as a module, so forward pre-hooks on it (DDP's wait for
    an overlapped ZeRO all-gather of its parameter) run before it is used."""
    model, modules = _model(
        "tiny-mixtral-8x7b",
        ("linear_qkv", "linear_proj", "experts.linear_fc1", "experts.linear_fc2"),
    )
    factors = {n for n, m in modules.items() if n.endswith((".lora_A", ".lora_B"))}
    called = set()
    for name in factors:
        modules[name].register_forward_pre_hook(lambda m, a, n=name: called.add(n))
    ids, _ = random_batch(model.config.vocab_size)
    with torch.no_grad():
        model(ids)
    assert len(factors) == 4 * 2 * model.config.num_layers
    assert called == factors, sorted(factors - called)[:4]
