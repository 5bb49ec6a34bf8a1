"""Calculator vs. published counts and the meta-device model; FLOPs vs. torch's flop counter;
a 70B preset built for a 64-GPU layout without allocating."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from shardwork.models import (
    PRESETS,
    PUBLISHED_PARAMS,
    GPTModel,
    MTPConfig,
    layout_groups,
    preset,
    spec_for,
)
from shardwork.models.calculator import flops_per_token, memory_estimate, num_parameters
from shardwork.models.calculator_deltanet import deltanet_forward_flops
from shardwork.parallel_state import ParallelConfig


def _real_params(model: GPTModel) -> dict[str, int]:
    return {k: st.data.numel() for k, st in model.sharded_state_dict().items()}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_published_and_meta_model(name):
    config = PRESETS[name]()
    model = GPTModel(config, device="meta")
    assert all(p.is_meta for p in model.parameters())
    meta_count = sum(_real_params(model).values())
    assert num_parameters(config) == PUBLISHED_PARAMS[name] == meta_count


def test_llama3_8b_count():
    assert num_parameters(preset("llama3-8b")) == 8_030_261_248


def test_70b_for_64_gpus_builds_local_shards_only():
    config = preset("llama3-70b", sequence_parallel=True)
    parallel = ParallelConfig(tp=8, pp=8)
    seen: dict[str, tuple[int, ...]] = {}
    for pp_rank in range(8):
        rank = pp_rank * 8 + 3  # tp rank 3 of every stage
        groups = layout_groups(parallel, 64, rank)
        assert groups.rank("tp") == 3 and groups.rank("pp") == pp_rank
        stage = GPTModel(
            config, groups, layer_range=(10 * pp_rank, 10 * pp_rank + 10), device="meta"
        )
        assert all(p.is_meta for p in stage.parameters())
        assert stage.pre_process == (pp_rank == 0) and stage.post_process == (pp_rank == 7)
        qkv = stage.decoder.layers[0].self_attention.linear_qkv.weight
        assert tuple(qkv.shape) == ((64 + 2 * 8) * 128 // 8, 8192)
        for key, st in stage.sharded_state_dict().items():
            seen[key] = st.global_shape
    total = sum(torch.Size(shape).numel() for shape in seen.values())
    assert total == PUBLISHED_PARAMS["llama3-70b"]


def _grouped_mm_flops(a_shape, b_shape, *_args, **_kwargs) -> int:
    """FLOPs of ``aten._grouped_mm`` (torch's counter has no formula for it): every row of
    ``a`` is multiplied by one group's matrix, so the work is that of one plain matmul over
    all rows. ``[N, K] × [G, K, O]`` (forward, input grad) and ``[K, N] × [N, O]`` split along
    ``N`` (weight grad) both give ``2·N·K·O``."""
    if len(a_shape) == 2 and len(b_shape) in (2, 3):
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
    raise NotImplementedError(f"grouped_mm {a_shape} x {b_shape}")


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, *args, **kwargs) -> int:
    """FLOPs of ``aten.convolution_backward`` honouring groups (torch's counter multiplies by
    all input channels, so a depthwise conv's backward reads ~channels× too high): each of
    the input and weight gradients costs the forward's ``2·N·C_out·L_out·(C_in/groups)·k``."""
    # args after the three shapes: bias sizes, stride, padding, dilation, transposed,
    # output padding, groups, output mask (``out_shape`` comes as a keyword)
    output_mask = args[7]
    per_grad = 2 * math.prod(grad_out_shape) * math.prod(w_shape[1:])
    return per_grad * (int(output_mask[0]) + int(output_mask[1]))


def _cpu_flash_forward_flops(q_shape, k_shape, v_shape, *_args, **_kwargs) -> int:
    """FLOPs of the CPU flash-attention forward, ``[b, h, s, d]`` query: QKᵀ and P·V, each
    ``2·b·h·s_q·s_k`` times its head width (GQA keys broadcast to the query heads)."""
    b, h, s_q, d = q_shape
    return 2 * b * h * s_q * k_shape[2] * (d + v_shape[3])


def _cpu_flash_backward_flops(_grad_shape, q_shape, k_shape, v_shape, *_args, **_kwargs) -> int:
    """FLOPs of its backward: QKᵀ again, then dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K and
    dK = dSᵀ·Q."""
    b, h, s_q, d = q_shape
    return 2 * b * h * s_q * k_shape[2] * (3 * d + 2 * v_shape[3])


def _counter_mapping() -> dict:
    """Formulas for ops the running torch's FlopCounterMode cannot count: ``_grouped_mm`` and
    grouped convolutions' backward always, and the CPU flash attention before torch 2.15
    (whose counter has it; 2.14's counted 0 for it)."""
    mapping = {
        torch.ops.aten._grouped_mm: _grouped_mm_flops,
        torch.ops.aten.convolution_backward: _conv_backward_flops,
    }
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if flash not in flop_registry and flash.default not in flop_registry:
        mapping[flash] = _cpu_flash_forward_flops
        mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
            _cpu_flash_backward_flops
        )
    return mapping


def _flash_recomputed_scores(config, seq: int) -> int:
    """QKᵀ that torch's counter charges the CPU flash-attention backward again (2·s²·a·d per
    GQA layer); the calculator does not count it as model FLOPs. MLA's query and value head
    widths differ, so it runs the math SDPA (plain bmms, no recompute)."""
    if config.mla is not None:
        return 0
    spec = spec_for(config)
    attention = sum(layer.mixer == "attention" for layer in spec.layers + spec.mtp)
    return attention * 2 * seq * seq * config.num_attention_heads * config.kv_channels


def _loss_recomputed_logits(config, seq: int) -> int:
    """The fused loss's recomputed logits GEMM (``2·V·h`` per token) in each head that
    recomputes instead of computing its gradient in the forward: every MTP depth, and the main
    head of a low-precision model; recompute, so not in the calculator's model FLOPs."""
    if not config.fused_linear_cross_entropy:
        return 0
    heads = len(spec_for(config).mtp)
    heads += config.activation_dtype not in (torch.float32, torch.float64)
    return heads * 2 * seq * config.vocab_size * config.hidden_size


def _replay_skipped(config, seq: int) -> int:
    """Forward matmuls that a full-recompute replay never reruns.

    torch's non-reentrant checkpoint stops replaying a layer once the last tensor saved for
    backward has been regenerated. The output of a layer's trailing projection is saved by
    nothing after it, so that matmul is skipped: a dense (SwiGLU, squared-ReLU or GELU) MLP's
    ``fc2``, an ungated shared expert's ``fc2``, and in a mixer-only layer the mixer's output
    projection. A routed expert's ``fc2`` output is saved by the probability-weighted
    unpermute, so it is replayed.
    """
    h, moe, skipped = config.hidden_size, config.moe, 0
    out_width = {  # input width of each mixer kind's output projection
        "attention": config.num_attention_heads * config.kv_channels,
        "mamba": config.mamba.inner_size if config.mamba else 0,
        "gated_deltanet": config.linear_attention.value_dim if config.linear_attention else 0,
    }
    for layer in spec_for(config).layers:
        if layer.mlp in ("dense", "relu2", "gelu"):
            skipped += 2 * seq * config.ffn_hidden_size * h
        elif layer.mlp is None:
            skipped += 2 * seq * out_width[layer.mixer] * h
        elif moe.shared_expert_ffn_hidden_size is not None and not moe.shared_expert_gate:
            skipped += 2 * seq * moe.shared_expert_ffn_hidden_size * h
    return skipped


HYBRID_CASES = {
    # single-part layers in any order, MoE with a gated shared expert, an attention+MoE MTP depth
    "tiny-qwen2-57b-a14b": dict(num_layers=5, hybrid_layer_pattern="*-E*E/*E"),
}


@pytest.mark.parametrize("name", sorted(HYBRID_CASES))
def test_hybrid_pattern_param_count_matches_meta_model(name):
    config = preset(name, mtp=MTPConfig(), **HYBRID_CASES[name])
    model = GPTModel(config, device="meta")
    assert num_parameters(config) == sum(_real_params(model).values())


@pytest.mark.parametrize(
    ("name", "recompute"),
    [
        ("hybrid:tiny-qwen2-57b-a14b", "none"),
        ("tiny-nemotron-h-8b", "none"),
        ("tiny-nemotron-h-8b", "full"),
        ("tiny-nemotron-h-moe", "none"),
        ("hybrid:tiny-qwen2-57b-a14b", "full"),
        ("tiny-llama3-8b", "none"),
        ("tiny-llama3-8b", "full"),
        ("tiny-qwen2.5-7b", "none"),
        ("tiny-mixtral-8x7b", "none"),
        ("tiny-qwen2-57b-a14b", "none"),
        ("tiny-qwen2-57b-a14b", "full"),
        ("tiny-deepseek-v3", "none"),
        ("tiny-deepseek-v3", "full"),
        ("tiny-gpt2", "none"),
        ("tiny-gpt2", "full"),
    ],
)
def test_flops_match_torch_flop_counter(name, recompute):
    """``flops_per_token`` equals torch's FlopCounterMode on a real forward and backward.

    Dense, Mixtral, Qwen2-MoE (QKV bias, gated shared expert) and DeepSeek-V3 (MLA, a
    dense-first layer, a shared expert, one MTP depth) are checked, with and without full
    recompute. MoE routing is dropless (no capacity factor), so each token passes through
    exactly ``top_k`` experts and the routed GEMM rows are ``tokens·top_k`` whatever the
    router chooses. The counter's only blind spots are added here explicitly:
    ``_grouped_mm`` (formula above), flash-attention's recomputed QKᵀ (counted by the
    counter, not by the calculator), and the replay's early stop (counted by the
    calculator, not run by torch).
    """
    if name.startswith("hybrid:"):
        name = name.removeprefix("hybrid:")
        config = preset(name, recompute=recompute, mtp=MTPConfig(), **HYBRID_CASES[name])
    else:
        config = preset(name, recompute=recompute)
    _assert_flops_match_counter(config)


def _assert_flops_match_counter(config):
    """``flops_per_token`` against FlopCounterMode on one forward and backward of ``config``."""
    recompute = config.recompute
    if config.moe is not None:
        assert config.moe.router.capacity_factor is None  # dropless: expert rows are deterministic
    model = GPTModel(config)
    seq = 16
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False, custom_mapping=_counter_mapping()) as counter:
        model(ids, labels=ids)[0].backward()
    counted = counter.get_flop_counts()["Global"]
    if config.moe is not None:  # the routed experts really ran as grouped GEMMs
        assert counted.get(torch.ops.aten._grouped_mm, 0) > 0
    full = recompute == "full"
    expected = flops_per_token(config, seq, causal=False, full_recompute=full) * seq
    expected += _flash_recomputed_scores(config, seq) + _loss_recomputed_logits(config, seq)
    if full:
        expected -= _replay_skipped(config, seq)
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)


# Qwen3-Next's attention options (gate, partial RoPE) and Nemotron-H's (no RoPE, squared ReLU).
LAYER_OPTIONS = [
    ("tiny-qwen3-8b", dict(attention_output_gate=True, rotary_percent=0.25)),
    ("tiny-qwen2.5-7b", dict(attention_output_gate=True)),  # gated, with QKV bias
    ("tiny-llama3-8b", dict(position_embedding_type="none", mlp_activation="relu2")),
    ("tiny-qwen3-30b-a3b", dict(attention_output_gate=True)),  # gated attention with MoE
    ("tiny-llama3-8b", dict(mlp_activation="relu2", add_mlp_bias=True)),
    ("tiny-qwen3-8b", dict(add_mlp_bias=True)),
]


@pytest.mark.parametrize(("name", "over"), LAYER_OPTIONS)
def test_param_count_of_layer_options_matches_meta_model(name, over):
    config = preset(name, **over)
    meta_count = sum(_real_params(GPTModel(config, device="meta")).values())
    assert num_parameters(config) == meta_count
    # The options change the count by the gate block / the missing gate matrix of the MLP / the
    # MLP biases.
    base = preset(name)
    h, a, d, f = base.hidden_size, base.num_attention_heads, base.kv_channels, base.ffn_hidden_size
    delta = 0
    if config.attention_output_gate:
        delta += base.num_layers * a * d * (h + (1 if base.add_qkv_bias else 0))
    if config.mlp_activation == "relu2":
        delta -= base.num_layers * h * f
    if config.add_mlp_bias:  # fc1's (2f SwiGLU, f relu2) and fc2's (h)
        fc1 = f if config.mlp_activation == "relu2" else 2 * f
        delta += base.num_layers * (fc1 + h)
    assert num_parameters(config) - num_parameters(base) == delta


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize(("name", "over"), LAYER_OPTIONS)
def test_flops_of_layer_options_match_torch_flop_counter(name, over, recompute):
    _assert_flops_match_counter(preset(name, recompute=recompute, **over))


def test_memory_estimate_basics():
    config = preset("llama3-8b", params_dtype=torch.bfloat16)
    one = memory_estimate(config, seq_length=4096, micro_batch_size=1)
    assert one.weights == num_parameters(config) * 2
    assert one.optimizer == num_parameters(config) * 12
    eight = memory_estimate(config, seq_length=4096, micro_batch_size=1, dp=8)
    assert eight.optimizer == pytest.approx(one.optimizer / 8)
    full = memory_estimate(config, seq_length=4096, micro_batch_size=1, recompute="full")
    sel = memory_estimate(config, seq_length=4096, micro_batch_size=1, recompute="selective")
    assert full.activations < sel.activations < one.activations


def test_deltanet_model_forward_flops_match_torch_flop_counter():
    """Qwen3-Next's twin (Gated DeltaNet and gated attention + MoE): the forward equals the
    calculator's forward (a third of the training count) less the chunks' triangular solves,
    for which torch's counter has no formula. (Its backward is not compared: the solve's
    gradient is another solve plus matmuls, so the counter cannot see the whole of it; the
    calculator keeps the 3x-forward convention there.) A forward without labels multiplies the
    padded vocabulary, which the calculator counts for the unfused loss."""
    config = preset("tiny-qwen3-next-80b-a3b", fused_linear_cross_entropy=False)
    seq = 16
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    model = GPTModel(config)
    with (
        torch.no_grad(),
        FlopCounterMode(display=False, custom_mapping=_counter_mapping()) as counter,
    ):
        model(ids)
    solves = sum(layer.mixer == "gated_deltanet" for layer in spec_for(config).layers)
    solve = deltanet_forward_flops(config, batch=1, seq_length=seq).triangular_solve
    expected = flops_per_token(config, seq, causal=False) * seq / 3 - solves * solve
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)
