"""Megatron's classic GPT options, each against an independent computation: LayerNorm vs
``torch.nn.functional.layer_norm`` (output and weight/bias gradients), the GELU MLP vs the
tanh formula written out, learned absolute positions vs ``wte[ids] + wpe[positions]`` (packed
documents restart at 0), the output-projection bias at TP=2 added once (world 1 as the
reference), loss and gradients at TP=2+SP / CP=2 / packed equal to world 1, and the option
errors (field, value, valid choices)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwork.models import GPTConfig, GPTModel, MLAConfig, MTPConfig, gather_logits, preset
from shardwork.models.full_state import full_state_dict
from shardwork.models.layer_norm import LayerNorm
from shardwork.models.moe import MoEConfig
from shardwork.models.testing import compare_with_single_rank
from shardwork.moe_router import RouterConfig
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks

H = 64


def _norm(dtype, *, zero_centered=False) -> LayerNorm:
    norm = LayerNorm(
        H,
        groups=ProcessGroups.single(),
        eps=1e-5,
        backend="torch",
        partial_grad=False,
        zero_centered_gamma=zero_centered,
        params_dtype=dtype,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_((0.0 if zero_centered else 1.0) + 0.3 * torch.randn(H, generator=gen))
        norm.bias.copy_(0.3 * torch.randn(H, generator=gen))
    return norm


def _x(dtype, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(8, 2, H, generator=gen) + 1.5).to(dtype)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layernorm_matches_torch_layer_norm_with_gradients(dtype, zero_centered):
    norm = _norm(dtype, zero_centered=zero_centered)
    w = norm.weight.detach().clone().requires_grad_()
    b = norm.bias.detach().clone().requires_grad_()
    x = _x(dtype)
    grad_out = _x(dtype, seed=3)
    out = norm(x)
    scale = w + 1 if zero_centered else w
    ref = F.layer_norm(x, (H,), scale, b, eps=1e-5)
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    # Two-pass mean/variance here, torch's Welford kernel there: rounding of O(1) values over
    # 64 terms, measured <= 1.3 eps·max|ref| (outputs) and <= 1.2 (gradients, 16 tokens).
    tol = dict(dtype=dtype, rtol=0.0, ulps=16)
    assert_close_at_scale(out, ref, name="output", **tol)
    assert_close_at_scale(norm.weight.grad, w.grad, name="weight grad", **tol)
    assert_close_at_scale(norm.bias.grad, b.grad, name="bias grad", **tol)
    # Planted bug: without the bias the output is off by |b| ~ 0.3.
    assert (F.layer_norm(x, (H,), scale, None, eps=1e-5) - out).abs().max() > 0.1


def test_layernorm_bf16_computes_statistics_in_float32():
    norm = _norm(torch.float32)
    x = _x(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    ref = F.layer_norm(x.float(), (H,), norm.weight.detach(), norm.bias.detach(), eps=1e-5)
    # one bf16 rounding of the float32 result (half a bf16 ulp of each element)
    assert_close_at_scale(out.float(), ref, dtype=torch.bfloat16, rtol=2**-8, ulps=1, name="bf16")


def _gelu_tanh(x):
    """GELU's tanh approximation written out (Hendrycks and Gimpel 2016, eq. 3)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def test_gelu_mlp_matches_the_formula():
    cfg = preset("tiny-gpt2", params_dtype=torch.float64)
    mlp = GPTModel(cfg).decoder.layers[0].mlp
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    x = _x(torch.float64, seed=5)
    w1, b1 = mlp.fc1.weight.detach(), mlp.fc1.bias.detach()
    w2, b2 = mlp.fc2.weight.detach(), mlp.fc2.bias.detach()
    assert w1.shape == (4 * H, H) and w2.shape == (H, 4 * H)
    want = _gelu_tanh(x @ w1.T + b1) @ w2.T + b2
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
    # Planted bug: the exact (erf) GELU differs from the tanh approximation by ~1e-4.
    erf = F.gelu(x @ w1.T + b1) @ w2.T + b2
    assert (erf - want).abs().max() > 1e-5


def _embedding_input(model, ids, **kw):
    """The hidden states the first layer receives (the embedding output)."""
    seen = []
    hook = model.decoder.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        model(ids, **kw)
    hook.remove()
    return seen[0]


def test_learned_positions_are_added_to_the_word_embedding():
    cfg = preset("tiny-gpt2", params_dtype=torch.float64)
    model = GPTModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(6))
    wte = model.embedding.weight.detach()
    wpe = model.position_embeddings.weight.detach()
    assert wpe.shape == (cfg.max_position_embeddings, H) and wpe.std() > 0.01
    got = _embedding_input(model, ids)  # [s, b, h]
    # one addition of the same two float64 values: bit-exact
    assert torch.equal(got, (wte[ids] + wpe[:20]).transpose(0, 1))
    assert "embedding.position_embeddings.weight" in model.sharded_state_dict()
    # packed: positions restart at 0 in each document
    cu = torch.tensor([0, 7, 15, 20])
    packed = _embedding_input(model, ids[:1], cu_seqlens=cu)[:, 0]
    positions = torch.cat([torch.arange(7), torch.arange(8), torch.arange(5)])
    assert torch.equal(packed, wte[ids[0]] + wpe[positions])


def test_packed_documents_equal_separate_runs():
    cfg = preset("tiny-gpt2", params_dtype=torch.float64)
    model = GPTModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(7))
    bounds = [0, 7, 15, 20]
    v = cfg.vocab_size  # real columns (padded ones hold the dtype's lowest value)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=torch.tensor(bounds))[..., :v]
        separate = torch.cat([model(ids[:, a:b]) for a, b in itertools.pairwise(bounds)])[..., :v]
        unpacked = model(ids)[..., :v]
    # float64, the same ops on fewer rows: measured 1.4 eps64·max|ref|
    assert_close_at_scale(packed, separate, dtype=torch.float64, rtol=0.0, ulps=16, name="logits")
    # Planted bug: positions continuing across documents (and attention crossing them).
    assert (unpacked[7:] - separate[7:]).abs().max() > 1e-3


def test_sequence_longer_than_the_position_table_is_refused():
    cfg = preset("tiny-gpt2", max_position_embeddings=16)
    model = GPTModel(cfg)
    with pytest.raises(
        ValueError, match=r"seq_length=20 is longer than max_position_embeddings=16"
    ):
        model(torch.zeros(1, 20, dtype=torch.long))


def _proj_bias_at_tp2():
    """TP=2 logits of tiny-gpt2 with random biases (loaded from the full world-1 tensors)
    equal world 1's, and differ from world 1 with the output-projection bias doubled."""
    groups = init_process_groups(ParallelConfig(tp=2))
    cfg = preset("tiny-gpt2", params_dtype=torch.float64)
    ref = GPTModel(cfg, ProcessGroups.single()).eval()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    full = full_state_dict(ref, group=dist.new_group([dist.get_rank()]))
    model = GPTModel(cfg, groups).eval()
    with torch.no_grad():
        for key, st in model.sharded_state_dict().items():
            index = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.data.shape))
            st.data.copy_(full[key][index])
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got = gather_logits(model(ids), tp_group=groups.tp, vocab_size=cfg.vocab_size)
        want = gather_logits(ref(ids), tp_group=None, vocab_size=cfg.vocab_size)
        # float64; TP sums the projections in two halves: rounding only (64 eps64·max|ref|
        # is ~1e-13 at these logits; the doubled bias below moves them by > 1e-2)
        assert_close_at_scale(got, want, dtype=torch.float64, rtol=0.0, ulps=64, name="logits")
        for layer in ref.decoder.layers:  # as if each TP rank had added the bias
            layer.self_attention.linear_proj.bias.mul_(2)
        twice = gather_logits(ref(ids), tp_group=None, vocab_size=cfg.vocab_size)
    return float((twice - got).abs().max())


@pytest.mark.multirank
def test_proj_bias_at_tp2_is_added_once():
    assert all(diff > 1e-2 for diff in run_on_ranks(_proj_bias_at_tp2, 2))


def _compare(kwargs):
    return compare_with_single_rank("tiny-gpt2", **kwargs)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp": 2, "sequence_parallel": True},
        {"cp": 2},
        {"tp": 2, "sequence_parallel": True, "batch": 1, "cu_seqlens": [0, 5, 11, 16]},
    ],
    ids=["tp2-sp", "cp2", "tp2-sp-packed"],
)
def test_loss_and_gradients_match_single_rank(kwargs):
    """Position table, LayerNorm biases and projection biases get world 1's gradients (under
    SP their partial sums are all-reduced over TP); float64 at rtol 1e-9 as the other models."""
    losses = run_on_ranks(_compare, 2, args=(kwargs | {"rtol": 1e-9},))
    assert len(set(losses)) == 1


def _config(**fields):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
    return GPTConfig(**(base | dict(vocab_size=100) | fields))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            dict(normalization="LayerNorm"),
            r"normalization='LayerNorm' is invalid: valid are \('rmsnorm', 'layernorm'\)",
        ),
        (
            dict(mlp_activation="gelu"),
            r"mlp_activation='gelu' is invalid: valid are \('swiglu', 'relu2', 'geglu', 'gelu_tanh'\)",
        ),
        (
            dict(position_embedding_type="learned"),
            r"position_embedding_type='learned' is invalid: valid are \('rope', 'none', "
            r"'learned_absolute'\)",
        ),
        (dict(add_proj_bias=1), r"add_proj_bias=1 is invalid: it must be True or False"),
        (
            dict(normalization="layernorm", qk_layernorm=True),
            r"normalization='layernorm' is not supported with qk_layernorm",
        ),
        (
            dict(position_embedding_type="learned_absolute", mtp=MTPConfig()),
            r"position_embedding_type='learned_absolute' is not supported with mtp",
        ),
        (
            dict(
                mlp_activation="gelu_tanh",
                moe=MoEConfig(
                    router=RouterConfig(num_experts=4, hidden_size=64, top_k=2),
                    ffn_hidden_size=32,
                ),
            ),
            r"mlp_activation='gelu_tanh' is not supported with moe",
        ),
        (
            dict(
                add_proj_bias=True,
                mla=MLAConfig(
                    q_lora_rank=None,
                    kv_lora_rank=32,
                    qk_nope_head_dim=16,
                    qk_rope_head_dim=8,
                    v_head_dim=16,
                ),
            ),
            r"add_proj_bias=True is not supported with mla",
        ),
    ],
)
def test_bad_option_values_are_named(fields, match):
    with pytest.raises(ValueError, match=match):
        _config(**fields)
