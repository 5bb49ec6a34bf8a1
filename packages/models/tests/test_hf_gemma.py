"""Gemma 2 and Gemma 3 (text) against transformers' Gemma2ForCausalLM / Gemma3ForCausalLM.

Tiny random models (4 layers, head_dim 16, ``query_pre_attn_scalar`` 24 != head_dim) with a
sliding window of 6 and 24-token sequences, so windows cut off real keys. Gemma 2 alternates
sliding/global layers with soft-caps small enough (5 on scores, 2 on logits) that tanh is far
from the identity; Gemma 3 has a non-periodic layer pattern, QK-norm, a local RoPE base and
linear scaling on global layers. Every norm weight is random (``1 + w`` is not 1).

- import at world 1 (fp32), TP=2 (+SP), PP=2 (hidden states sent by hand): logits within
  fp32 rounding of transformers' eager path;
- export (world 1) reloads in transformers with identical logits; the config maps both ways;
- CP=2 with the window smaller than a CP chunk (chunks of 6 at seq 24, window 6 crosses every
  chunk boundary) equals world 1.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwork.models import gather_logits  # noqa: E402
from shardwork.models.context_parallel import slice_for_context_parallel  # noqa: E402
from shardwork.models.hf import from_pretrained, gpt_config_from_hf, save_pretrained  # noqa: E402
from shardwork.parallel_state import ParallelConfig, init_process_groups  # noqa: E402
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks  # noqa: E402

pytestmark = pytest.mark.golden

V, S, B, H = 250, 24, 2, 64
_COMMON = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    max_position_embeddings=128,
    sliding_window=6,
    attn_implementation="eager",
)
_SL, _FULL = "sliding_attention", "full_attention"
# fp32 end to end on both sides; transformers and shardwork order some reductions differently
# (fused QKV vs separate projections, SDPA vs eager on Gemma 3). Measured max logit errors in
# units of eps32·max|logit| at world 1: 0.0 (gemma2: explicit soft-capped attention, the same
# operations as eager), 7.0 (gemma3: SDPA vs eager).
FP32 = dict(rtol=0.0, ulps=16)


def _hf_model(family: str):
    torch.manual_seed(0)
    if family == "gemma2":
        cfg = transformers.Gemma2Config(
            **_COMMON, attn_logit_softcapping=5.0, final_logit_softcapping=2.0
        )
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        rope = {
            _FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            _SL: {"rope_type": "default", "rope_theta": 10000.0},
        }
        cfg = transformers.Gemma3TextConfig(
            **_COMMON, layer_types=[_SL, _FULL, _SL, _SL], rope_parameters=rope
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():  # zero-centred norms: random w so the scale 1 + w is not 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("proj.weight"):
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def _ids():
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def hf_folder(request, tmp_path_factory):
    model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, max_shard_size="100KB")
    with torch.no_grad():
        ref = model(_ids()).logits
    return folder, ref, request.param


def test_config_maps_gemma_features(hf_folder):
    folder, _, family = hf_folder
    model = from_pretrained(folder)
    c = model.config
    assert (c.mlp_activation, c.sandwich_norm, c.scale_embedding) == ("geglu", True, True)
    assert c.layernorm_zero_centered_gamma and c.tie_word_embeddings
    assert (c.query_pre_attn_scalar, c.sliding_window) == (24.0, 6)
    if family == "gemma2":
        assert c.sliding_window_pattern == 2
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (5.0, 2.0)
    else:
        assert c.sliding_window_pattern == (1, 0, 1, 1) and c.qk_layernorm
        assert (c.rope_theta, c.rope_local_theta, c.rope_scaling.factor) == (1e6, 1e4, 8.0)


def test_import_world1_matches_hf_logits(hf_folder):
    folder, ref, _ = hf_folder
    model = from_pretrained(folder).eval()
    with torch.no_grad():
        logits = gather_logits(model(_ids()), tp_group=None, vocab_size=V)
    assert_close_at_scale(logits, ref, name="logits", **FP32)


def test_export_reloads_in_hf_with_identical_logits(hf_folder, tmp_path):
    folder, ref, family = hf_folder
    model = from_pretrained(folder)
    save_pretrained(model, tmp_path / "out", max_shard_bytes=100_000)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert type(reloaded).__name__ == {"gemma2": "Gemma2ForCausalLM"}.get(
        family, "Gemma3ForCausalLM"
    )
    with torch.no_grad():
        logits = reloaded(_ids()).logits
    # Exact: transformers' own model, the same weights, process and kernels as ``ref``.
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    again = gpt_config_from_hf(reloaded.config.to_dict())
    assert again == model.config


def _tp2_logits(folder):
    groups = init_process_groups(ParallelConfig(tp=2))
    model = from_pretrained(folder, groups, sequence_parallel=True).eval()
    with torch.no_grad():
        return gather_logits(model(_ids()), tp_group=groups.tp, vocab_size=V)


@pytest.mark.multirank
def test_import_tp2_matches_hf_logits(hf_folder):
    folder, ref, _ = hf_folder
    for logits in run_on_ranks(_tp2_logits, 2, args=(str(folder),)):
        assert_close_at_scale(logits, ref, name="tp2 logits", **FP32)


def _pp2_logits(folder):
    import torch.distributed as dist

    groups = init_process_groups(ParallelConfig(pp=2))
    stage = groups.rank("pp")
    model = from_pretrained(folder, groups, layer_range=(0, 2) if stage == 0 else (2, 4)).eval()
    with torch.no_grad():
        if stage == 0:
            dist.send(model(_ids()), dst=groups.members["pp"][1])
            return None
        hidden = torch.empty(S, B, H)
        dist.recv(hidden, src=groups.members["pp"][0])
        return gather_logits(model(hidden_states=hidden), tp_group=None, vocab_size=V)


@pytest.mark.multirank
def test_import_pp2_matches_hf_logits(hf_folder):
    folder, ref, _ = hf_folder
    _, logits = run_on_ranks(_pp2_logits, 2, args=(str(folder),))
    assert_close_at_scale(logits, ref, name="pp2 logits", **FP32)


def _cp2_logits(folder):
    groups = init_process_groups(ParallelConfig(cp=2))
    model = from_pretrained(folder, groups).eval()
    ids = slice_for_context_parallel(_ids(), cp_rank=groups.rank("cp"), cp_size=2, dim=1)
    with torch.no_grad():
        return gather_logits(model(ids), tp_group=None, vocab_size=V)


@pytest.mark.multirank
def test_cp2_with_window_across_chunks_matches_world1(hf_folder):
    """seq 24 at cp=2: four chunks of 6 and a window of 6, so every query's window reaches into
    the previous chunk, which sits on the other rank for chunks 1 and 2."""
    folder, _, _ = hf_folder
    model = from_pretrained(folder).eval()
    assert model.config.sliding_window <= S // 4
    with torch.no_grad():
        whole = gather_logits(model(_ids()), tp_group=None, vocab_size=V)
    parts = run_on_ranks(_cp2_logits, 2, args=(str(folder),))
    expected = [slice_for_context_parallel(whole, cp_rank=r, cp_size=2, dim=1) for r in (0, 1)]
    for rank, (got, want) in enumerate(zip(parts, expected, strict=True)):
        assert_close_at_scale(got, want, name=f"cp rank {rank} logits", **FP32)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_bf16_import_matches_hf_bf16_logits(family, tmp_path):
    """Both sides in bf16 (transformers rounds the embedding scale and norms as shardwork
    does): measured 2.8 (gemma2) and 2.5 (gemma3) bf16 ulp of the logits' max; bound 8."""
    hf = _hf_model(family).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = hf(_ids()).logits
    model = from_pretrained(tmp_path, params_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = gather_logits(model(_ids()), tp_group=None, vocab_size=V)
    assert_close_at_scale(logits, ref, name="bf16 logits", rtol=0.0, ulps=8)
