"""The Gemma model options one by one against formulas written here (world 1, fp64).

Soft-capped, rescaled, sliding-window attention vs explicit loops; GeGLU vs the tanh-GELU
formula; sandwich norms vs ``x + norm(part(norm(x)))`` with the RMSNorm formula; the window
mask (also as cp ranks build it) vs a double loop; the loss with final-logit soft-capping vs
``F.cross_entropy`` on capped logits; the scaled embedding vs ``weight[ids]·sqrt(h)``; linear
RoPE scaling; the calculator's sliding-window FLOPs; and the errors bad values raise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwork.fused_kernels import LinearRopeScaling, rotary_inv_freq
from shardwork.models import GPTConfig, GPTModel, flops_per_token, gather_logits, preset
from shardwork.models.block_mask import build_block_mask
from shardwork.models.calculator_memory import stage_activation_bytes
from shardwork.models.context_parallel import local_positions
from shardwork.models.hf import gpt_config_from_hf
from shardwork.models.testing import compare_with_single_rank
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks

S, B, H, NQ, NKV, D = 20, 2, 32, 4, 2, 8
# fp64 throughout: differences are rounding of O(1) values over a few dozen terms.
FP64 = dict(rtol=0.0, ulps=64)


def _config(**fields) -> GPTConfig:
    base = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=NQ,
        num_query_groups=NKV,
        head_dim=D,
        ffn_hidden_size=48,
        vocab_size=61,
        make_vocab_size_divisible_by=16,
        params_dtype=torch.float64,
        init_method_std=0.3,
    )
    return GPTConfig(**(base | fields))


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _x(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, dtype=torch.float64, generator=gen)


def _window_mask_loops(q_pos, k_pos, window) -> torch.Tensor:
    mask = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
    for i, q in enumerate(q_pos.tolist()):
        for j, k in enumerate(k_pos.tolist()):
            mask[i, j] = q - k >= 0 and (window is None or q - k < window)
    return mask


def _attention_by_loops(attn, x, *, cap, scalar, window):
    """The attention block computed head by head from its weights (no RoPE)."""
    w = attn.linear_qkv.weight.detach()
    q_w, k_w, v_w = w.split((NQ * D, NKV * D, NKV * D))
    q = (x @ q_w.T).reshape(S, B, NQ, D)
    k = (x @ k_w.T).reshape(S, B, NKV, D)
    v = (x @ v_w.T).reshape(S, B, NKV, D)
    allowed = _window_mask_loops(torch.arange(S), torch.arange(S), window)
    out = torch.empty(S, B, NQ, D, dtype=x.dtype)
    for head in range(NQ):
        kv = head // (NQ // NKV)  # grouped-query attention: consecutive heads share a kv head
        for b in range(B):
            scores = q[:, b, head] @ k[:, b, kv].T / math.sqrt(scalar)
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            scores = scores.masked_fill(~allowed, -math.inf)
            out[:, b, head] = torch.softmax(scores, dim=-1) @ v[:, b, kv]
    return out.reshape(S, B, NQ * D) @ attn.linear_proj.weight.detach().T


@pytest.mark.parametrize("cap", [None, 0.7])
@pytest.mark.parametrize("layer", [0, 1])
def test_attention_softcap_scale_and_window_match_loops(cap, layer):
    """Layer 0 slides (pattern 2), layer 1 is global; cap None runs SDPA, 0.7 the explicit path."""
    cfg = _config(
        position_embedding_type="none",
        attn_logit_softcapping=cap,
        query_pre_attn_scalar=5.0,
        sliding_window=4,
        sliding_window_pattern=2,
    )
    model = GPTModel(cfg)
    attn = model.decoder.layers[layer].self_attention
    _randomize(attn, 7)
    x = _x()
    out = attn(x, model._attention_inputs(S, None, x.device))
    ref = _attention_by_loops(attn, x, cap=cap, scalar=5.0, window=4 if layer == 0 else None)
    assert_close_at_scale(out, ref, name="attention", **FP64)


def test_geglu_mlp_matches_tanh_gelu_formula():
    mlp = GPTModel(_config(mlp_activation="geglu")).decoder.layers[0].mlp
    _randomize(mlp, 3)
    x = _x()
    gate_w, up_w = mlp.fc1.weight.detach().chunk(2)
    g = x @ gate_w.T
    gelu = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    ref = (gelu * (x @ up_w.T)) @ mlp.fc2.weight.detach().T
    assert_close_at_scale(mlp(x), ref, name="geglu mlp", **FP64)


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def test_sandwich_norm_layer_matches_formula():
    cfg = _config(sandwich_norm=True, layernorm_zero_centered_gamma=True)
    model = GPTModel(cfg)
    layer = model.decoder.layers[0]
    _randomize(layer, 5)
    x = _x()
    inputs = model._attention_inputs(S, None, x.device)
    eps = cfg.norm_epsilon

    def norm(module, t):
        return _rms(t, module.weight.detach(), eps)

    mid = x + norm(
        layer.post_attention_layernorm, layer.self_attention(norm(layer.input_layernorm, x), inputs)
    )
    ref = mid + norm(layer.post_mlp_layernorm, layer.mlp(norm(layer.pre_mlp_layernorm, mid)))
    assert_close_at_scale(layer(x, inputs), ref, name="sandwich layer", **FP64)


@pytest.mark.parametrize("window", [1, 3, 7, 40])
@pytest.mark.parametrize("tile", [3, 256])
def test_window_mask_matches_loops_and_holds_across_cp_chunks(window, tile):
    s, cp = 16, 2
    full = _window_mask_loops(torch.arange(s), torch.arange(s), window)
    assert torch.equal(build_block_mask(s, window=window, tile=tile).to_dense(), full)
    for rank in range(cp):
        q = local_positions(s // cp, cp_rank=rank, cp_size=cp)
        # The rank's rows of the full mask; keys are gathered back into position order.
        mask = build_block_mask(s // cp, cp_rank=rank, cp_size=cp, window=window, tile=tile)
        assert torch.equal(mask.to_dense(), full[q])
    # On random scores: masked softmax equals the softmax over each row's allowed keys only.
    scores = torch.randn(s, s, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(scores.masked_fill(~full, -math.inf), dim=-1)
    for i in range(s):
        lo = max(0, i - window + 1)
        row = torch.zeros(s, dtype=torch.float64)
        row[lo : i + 1] = torch.softmax(scores[i, lo : i + 1], dim=-1)
        assert_close_at_scale(probs[i], row, name=f"row {i}", **FP64)


def test_packed_window_stays_inside_documents():
    cfg = _config(sliding_window=3)
    model = GPTModel(cfg)
    inputs = model._attention_inputs(10, torch.tensor([0, 4, 10]), torch.device("cpu"))
    docs = torch.tensor([0] * 4 + [1] * 6)
    expected = _window_mask_loops(torch.arange(10), torch.arange(10), 3)
    expected &= docs[:, None] == docs[None, :]
    assert torch.equal(inputs.sliding.mask.to_dense(), expected)


def test_loss_with_final_softcap_equals_cross_entropy_of_capped_logits():
    cap = 1.5
    capped = GPTModel(_config(final_logit_softcapping=cap, tie_word_embeddings=True))
    plain = GPTModel(_config(tie_word_embeddings=True))
    plain.load_state_dict(capped.state_dict())
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 61, (B, S), generator=gen)
    labels = torch.randint(0, 61, (B, S), generator=gen)
    raw = gather_logits(plain(ids), tp_group=None, vocab_size=61)
    assert raw.abs().max() > cap  # the cap bends real logits
    ref = F.cross_entropy(
        (cap * torch.tanh(raw / cap)).reshape(-1, 61), labels.reshape(-1), reduction="sum"
    )
    loss_sum, count = capped(ids, labels=labels)
    assert int(count) == B * S
    assert_close_at_scale(loss_sum, ref, name="loss", **FP64)
    inference = gather_logits(capped(ids), tp_group=None, vocab_size=61)
    assert_close_at_scale(inference, cap * torch.tanh(raw / cap), name="logits", **FP64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_embedding_multiplies_by_sqrt_hidden_rounded_like_transformers(dtype):
    cfg = _config(hidden_size=48, scale_embedding=True, params_dtype=dtype, num_attention_heads=4)
    model = GPTModel(cfg)
    ids = torch.randint(0, 61, (B, S), generator=torch.Generator().manual_seed(6))
    factor = torch.tensor(48**0.5, dtype=torch.float32).to(dtype)  # HF: fp32 tensor -> weight dtype
    ref = model.embedding.weight[ids.T] * factor
    assert torch.equal(model.embedding(ids), ref)


def test_linear_rope_scaling_divides_frequencies():
    base = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    got = rotary_inv_freq(16, base=1e6, scaling=LinearRopeScaling(factor=8.0))
    assert_close_at_scale(
        got, (base / 8).float(), name="inv_freq", dtype=torch.float32, rtol=0.0, ulps=2
    )


def test_flops_count_sliding_window_keys():
    s, w = 64, 8
    base = _config(num_layers=4)
    slid = base.replace(sliding_window=w, sliding_window_pattern=2)  # layers 0 and 2 slide
    # Per sliding layer, QKᵀ and AV (2 matmuls × 2 FLOPs) over W − W²/(2s) instead of s/2 keys,
    # times 3 for forward + backward.
    saved = 2 * 3 * 4 * NQ * D * (s / 2 - (w - w * w / (2 * s)))
    assert flops_per_token(base, s) - flops_per_token(slid, s) == pytest.approx(saved, rel=1e-12)
    wide = base.replace(sliding_window=s, sliding_window_pattern=2)
    assert flops_per_token(wide, s) == flops_per_token(base, s)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(sliding_window=-4), "sliding_window=-4"),
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(attn_logit_softcapping=0.0), "attn_logit_softcapping=0.0"),
        (dict(final_logit_softcapping=-30.0), "final_logit_softcapping=-30.0"),
        (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar=0"),
        (dict(mlp_activation="gelu"), "mlp_activation='gelu'"),
        (dict(sliding_window_pattern=2), "needs sliding_window"),
        (dict(sliding_window=4, sliding_window_pattern=(1, 0, 1)), "one 1 (sliding) or 0"),
        (dict(rope_local_theta=1e4), "rope_local_theta=10000.0 needs sliding_window"),
        (dict(sandwich_norm=1), "sandwich_norm=1"),
    ],
)
def test_bad_values_raise_naming_the_field(fields, named):
    with pytest.raises(ValueError, match="GPTConfig") as err:
        _config(**fields)
    assert named in str(err.value)


def test_geglu_with_moe_is_refused():
    with pytest.raises(ValueError, match="mlp_activation='geglu' is not supported with moe"):
        preset("tiny-mixtral-8x7b", mlp_activation="geglu")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        (dict(layer_types=["sliding_attention", "chunked"]), "layer_types="),
        (
            dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
            "sliding-window layers rotate without scaling",
        ),
    ],
)
def test_unsupported_gemma_hf_configs_are_refused(change, named):
    hf = dict(
        model_type="gemma3_text",
        num_hidden_layers=2,
        hidden_size=H,
        num_attention_heads=NQ,
        num_key_value_heads=NKV,
        head_dim=D,
        intermediate_size=48,
        vocab_size=61,
        sliding_window=4,
    )
    with pytest.raises(ValueError) as err:
        gpt_config_from_hf(hf | change)
    assert named in str(err.value)


def test_gemma_presets_build_their_features():
    g2, g3 = preset("tiny-gemma2-2b"), preset("tiny-gemma3-4b")
    assert g2.sliding_window_pattern == 2 and g2.final_logit_softcapping == 30.0
    assert g3.sliding_window_pattern == 6 and g3.rope_scaling == LinearRopeScaling(factor=8.0)
    assert g3.rope_local_theta == 1e4 and g3.qk_layernorm
    assert preset("gemma2-27b").query_pre_attn_scalar == 144.0


# ---- TP=2 (+SP), CP=2 and selective recompute against world 1 ---------------------------------

# Caps small and weights large enough that tanh bends scores and logits; window 8 at sequence 16
# (cp=2: chunks of 4, so windows reach into chunks on the other rank).
_BENT = dict(attn_logit_softcapping=0.5, final_logit_softcapping=1.0, init_method_std=0.3)
_PACKED = dict(batch=1, seq=24, cu_seqlens=[0, 5, 17, 24])


def _gemma_layout_cases():
    return [
        compare_with_single_rank("tiny-gemma2-2b", tp=2, sequence_parallel=True, **_BENT),
        compare_with_single_rank("tiny-gemma2-2b", cp=2, recompute="selective", **_BENT),
        compare_with_single_rank("tiny-gemma3-4b", tp=2, init_method_std=0.3),
        compare_with_single_rank("tiny-gemma3-4b", cp=2, init_method_std=0.3),
        # Packed documents crossing the cp chunks (of 6) with the window of 8 inside them.
        compare_with_single_rank("tiny-gemma2-2b", cp=2, **_PACKED, **_BENT),
        compare_with_single_rank("tiny-gemma3-4b", cp=2, init_method_std=0.3, **_PACKED),
    ]


@pytest.mark.multirank
def test_gemma_loss_and_gradients_at_tp2_and_cp2_match_single_rank():
    """Loss and every parameter's full gradient (fp64, rtol 1e-9) equal world size 1."""
    losses = run_on_ranks(_gemma_layout_cases, 2)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("name", ["tiny-gemma2-2b", "tiny-gemma3-4b"])
def test_activation_estimate_of_gemma_matches_saved_tensors(name, recompute, dtype):
    """Sandwich norms, the explicit soft-capped attention and the capped logits are counted:
    within 2% of the bytes autograd saves in fp32 (measured 0.5-0.7%: the loss's and the
    tables' few kB; sliding layers save no mask since they run on block masks), 5% in bf16 as for
    the other presets (measured 2.8-3.2%; the plain tiny Llama twin is 3.6% off in bf16 too)."""
    cfg = preset(name, params_dtype=dtype, recompute=recompute)
    seq, batch = 32, 2
    torch.manual_seed(0)
    model = GPTModel(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=torch.roll(ids, -1, dims=1))
    estimate = stage_activation_bytes(cfg, seq_length=seq, micro_batch_size=batch)
    bound = 0.02 if dtype == torch.float32 else 0.05
    assert estimate == pytest.approx(sum(seen.values()), rel=bound)
