"""Multi-head latent attention: a plain-torch reference at world size 1 (HF's de-interleaved
rope formulation, YaRN softmax scale), and TP=2 / TP=2+SP equal to the single-rank model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwork.models import GPTModel, preset
from shardwork.models.moe.testing import compare_moe_layout
from shardwork.parallel_state.testing import run_on_ranks


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_hf(x, cos_half, sin_half):
    """HF DeepSeek: de-interleave pairs, then rotate-half (cos/sin per pair)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos_half - x2 * sin_half, x2 * cos_half + x1 * sin_half), -1)


def _allowed(s: int, cu: list[int] | None) -> torch.Tensor:
    """Causal and, for packed documents, same-document ``[s, s]`` mask (double loop)."""
    doc = [sum(i >= c for c in cu[1:-1]) for i in range(s)] if cu else [0] * s
    return torch.tensor([[j <= i and doc[i] == doc[j] for j in range(s)] for i in range(s)])


@pytest.mark.parametrize("cu", [None, [0, 3, 4, 10]], ids=["causal", "packed"])
@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v2-lite"])
def test_mla_matches_plain_reference(name, cu):
    """Packed: value heads narrower than query/key heads through the block-mask path."""
    cfg = preset(name, params_dtype=torch.float64, mtp=None)
    model = GPTModel(cfg)
    attn = model.decoder.layers[0].self_attention
    m, eps = cfg.mla, cfg.norm_epsilon
    s, b, h, n = 10, 2, cfg.hidden_size, cfg.num_attention_heads
    x = torch.randn(s, b, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = model._attention_inputs(s, None if cu is None else torch.tensor(cu), x.device)
    out = attn(x, inputs)

    if m.q_lora_rank is None:
        q = x @ attn.linear_q_proj.weight.t()
    else:
        qa = _rms(x @ attn.linear_q_down_proj.weight.t(), attn.q_layernorm.weight, eps)
        q = qa @ attn.linear_q_up_proj.weight.t()
    q = q.view(s, b, n, m.qk_head_dim)
    q_nope, q_rot = q.split((m.qk_nope_head_dim, m.qk_rope_head_dim), -1)
    kv_a = x @ attn.linear_kv_down_proj.weight.t()
    latent, k_rot = kv_a.split((m.kv_lora_rank, m.qk_rope_head_dim), -1)
    kv = (_rms(latent, attn.kv_layernorm.weight, eps) @ attn.linear_kv_up_proj.weight.t()).view(
        s, b, n, -1
    )
    k_nope, v = kv.split((m.qk_nope_head_dim, m.v_head_dim), -1)
    cos_half = inputs.cos[..., 0::2].unsqueeze(1)  # [s, 1, 1, dr/2]: each angle was twice
    sin_half = inputs.sin[..., 0::2].unsqueeze(1)
    q_rot = _rope_hf(q_rot, cos_half, sin_half)
    k_rot = _rope_hf(k_rot.unsqueeze(2), cos_half, sin_half)
    qf = torch.cat((q_nope, q_rot), -1).permute(1, 2, 0, 3)
    kf = torch.cat((k_nope, k_rot.expand(s, b, n, -1)), -1).permute(1, 2, 0, 3)
    scale = m.qk_head_dim**-0.5
    if cfg.rope_scaling is not None:
        mscale = 0.1 * cfg.rope_scaling.mscale_all_dim * math.log(cfg.rope_scaling.factor) + 1.0
        scale *= mscale * mscale
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_allowed(s, cu), float("-inf"))
    ctx = F.softmax(scores, -1) @ v.permute(1, 2, 0, 3)
    ref = ctx.permute(2, 0, 1, 3).reshape(s, b, -1) @ attn.linear_proj.weight.t()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def _compare(name, kwargs):
    return compare_moe_layout(name, **kwargs)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("tiny-deepseek-v2-lite", {"tp": 2}),
        ("tiny-deepseek-v3", {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True}),
    ],
    ids=["v2lite-tp2-etp2", "v3-tp2-sp-ep2"],
)
def test_mla_tp2_matches_single_rank(name, kwargs):
    losses = run_on_ranks(_compare, 2, args=(name, kwargs))
    assert len(set(losses)) == 1
