"""Hugging Face MoE bridge: tiny random-weight transformers models (no downloads) for Mixtral,
Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 give the same logits (within 1e-4, fp32) and the same
chosen experts after import — from per-expert tensors on disk and from transformers 5's fused
in-memory layout — at world size 1 and at tp×pp×ep×etp layouts; exports load back into
transformers with the same logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwork.models import GPTModel, gather_logits  # noqa: E402
from shardwork.models.hf import (  # noqa: E402
    from_pretrained,
    gpt_config_from_hf,
    hf_config_from_gpt,
    save_pretrained,
)
from shardwork.models.hf.moe_weights import load_hf_moe_state_dict, moe_hf_state_dict  # noqa: E402
from shardwork.models.moe import MoELayer  # noqa: E402
from shardwork.parallel_state.testing import run_on_ranks  # noqa: E402

# Golden / cross-implementation: CI reruns these with other CPU kernels (.ci/run).
pytestmark = pytest.mark.golden

_COMMON = dict(
    vocab_size=250,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
CONFIGS = {
    "mixtral": dict(
        num_hidden_layers=2,
        num_key_value_heads=2,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=1e6,
    ),
    "qwen2_moe": dict(
        num_hidden_layers=2,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    ),
    "qwen3_moe": dict(
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}


def hf_model(model_type: str, seed: int = 0, **changes):
    """A tiny random-weight transformers model (norms and expert bias non-default); ``changes``
    replace fields of its config."""
    fields = _COMMON | CONFIGS[model_type] | changes
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if "norm" in name:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
            elif ".gate.weight" in name:
                t.copy_(0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
    return model


def hf_forward(model, ids):
    """Logits [b, s, V] and per-MoE-layer chosen experts (sorted top-k indices, [b·s, k])."""
    chosen = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].sort(-1).values))
        for name, m in model.named_modules()
        if name.endswith("mlp.gate") and hasattr(m, "top_k")
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return logits, chosen


def our_chosen(model, batch, seq):
    """Chosen experts of each local MoE layer in HF token order [b·s, k]."""
    out = []
    for m in model.modules():
        if isinstance(m, MoELayer) and m.last_routing_map is not None:
            rmap = m.last_routing_map.view(seq, batch, -1).transpose(0, 1).reshape(batch * seq, -1)
            k = int(rmap[0].sum())
            out.append(rmap.nonzero()[:, 1].view(-1, k))
    return out


def _ids(batch=2, seq=12):
    return torch.randint(0, 250, (batch, seq), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_import_per_expert_and_fused_match_hf(model_type, tmp_path):
    ref = hf_model(model_type)
    ids = _ids()
    ref_logits, ref_chosen = hf_forward(ref, ids)
    ref.save_pretrained(tmp_path)  # transformers writes per-expert tensors

    ours = from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logits = gather_logits(ours(ids), tp_group=None, vocab_size=250)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    chosen = our_chosen(ours, 2, 12)
    assert len(chosen) == len(ref_chosen) > 0
    for a, b in zip(chosen, ref_chosen):
        assert torch.equal(a, b)

    # transformers 5's fused in-memory layout (gate_up_proj [E, 2I, H]) loads the same
    fused = GPTModel(gpt_config_from_hf(ref.config.to_dict()))
    load_hf_moe_state_dict(fused, ref.state_dict())
    with torch.no_grad():
        logits2 = gather_logits(fused.eval()(ids), tp_group=None, vocab_size=250)
    torch.testing.assert_close(logits2, ref_logits, rtol=1e-4, atol=1e-4)


# top_k // topk_group = 3: transformers still ranks groups by their top-2 experts' scores
_TOP3 = dict(n_routed_experts=16, num_experts_per_tok=6, n_group=4, topk_group=2)


def test_deepseek_import_keeps_transformers_group_scores_when_k_per_group_is_not_2(tmp_path):
    ref = hf_model("deepseek_v3", **_TOP3)
    ids = _ids()
    ref_logits, ref_chosen = hf_forward(ref, ids)
    config = gpt_config_from_hf(ref.config.to_dict())
    assert config.moe.router.group_score_top_n == 2
    ours = GPTModel(config)
    load_hf_moe_state_dict(ours, ref.state_dict())
    with torch.no_grad():
        logits = gather_logits(ours.eval()(ids), tp_group=None, vocab_size=250)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(our_chosen(ours, 2, 12), ref_chosen, strict=True):
        assert torch.equal(a, b)
    # the default rule (top 3 per group) routes differently on these inputs
    router = config.moe.router
    default_rule = config.replace(
        moe=config.moe.replace(router=dataclasses.replace(router, group_score_top_n=None))
    )
    other = GPTModel(default_rule)
    load_hf_moe_state_dict(other, ref.state_dict())
    with torch.no_grad():
        other.eval()(ids)
    assert any(not torch.equal(a, b) for a, b in zip(our_chosen(other, 2, 12), ref_chosen))
    # and a router transformers cannot express is not exported as deepseek_v3
    with pytest.raises(ValueError, match="scores a group by its top 3 experts"):
        hf_config_from_gpt(default_rule)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_export_loads_in_transformers(model_type, tmp_path):
    """Both exports reload in transformers with the logits (1e-5) and chosen experts of the
    model that was imported."""
    ref = hf_model(model_type)
    ids = _ids()
    ref_logits, ref_chosen = hf_forward(ref, ids)
    assert len(ref_chosen) > 0
    ours = from_pretrained(_saved(ref, tmp_path / "in"))
    # fused in-memory export -> load_state_dict into a fresh transformers model
    fresh = hf_model(model_type, seed=9)
    missing, unexpected = fresh.load_state_dict(moe_hf_state_dict(ours, fused=True), strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    _assert_same_forward(hf_forward(fresh, ids), (ref_logits, ref_chosen))
    # per-expert folder export, split over several safetensors files -> from_pretrained
    save_pretrained(ours, tmp_path / "out", max_shard_bytes=20_000)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert type(back) is type(ref)
    _assert_same_forward(hf_forward(back, ids), (ref_logits, ref_chosen))


def _assert_same_forward(got, want):
    (logits, chosen), (ref_logits, ref_chosen) = got, want
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert len(chosen) == len(ref_chosen)
    for layer, (a, b) in enumerate(zip(chosen, ref_chosen, strict=True)):
        assert torch.equal(a, b), f"MoE layer {layer}: chosen experts differ"


def _saved(model, folder):
    model.save_pretrained(folder)
    return folder


def _layout_logits(folder, parallel_kwargs, ref_logits, ref_chosen):
    """On each rank: build this rank's stage from the saved HF folder, reading only its
    shards, and compare its logits and chosen experts with transformers' (computed once by
    the test, so the ranks never build a transformers model)."""
    from shardwork.models.hf import load_hf_weights, read_hf_config
    from shardwork.models.module import to_empty_keep_meta
    from shardwork.models.pipeline import build_stage, pipeline_logits
    from shardwork.parallel_state import ParallelConfig, init_process_groups

    groups = init_process_groups(ParallelConfig(**parallel_kwargs))
    stage = build_stage(gpt_config_from_hf(read_hf_config(folder)), groups, device="meta")
    to_empty_keep_meta(stage, "cpu")
    stage.rng_tracker.to("cpu")
    load_hf_weights(stage, folder)
    logits = pipeline_logits(stage.eval(), groups, _ids())
    if groups.is_last_pp_stage:
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    # chosen experts of the MoE layers this stage holds (EP ranks route the same tokens)
    first = stage.decoder.layer_range[0]
    moe_layers = [i for i in range(*stage.decoder.layer_range) if stage.config.moe.is_moe_layer(i)]
    skip = sum(1 for i in range(first) if stage.config.moe.is_moe_layer(i))
    ours = our_chosen(stage, 2, 12)
    assert len(ours) == len(moe_layers)
    for a, b in zip(ours, ref_chosen[skip : skip + len(moe_layers)], strict=True):
        assert torch.equal(a, b)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("model_type", "kwargs", "world"),
    [
        ("qwen3_moe", {"ep": 2}, 2),
        pytest.param(
            "deepseek_v3", {"tp": 2, "pp": 2, "ep": 2, "etp": 1}, 4, marks=pytest.mark.slow
        ),
        pytest.param("qwen2_moe", {"tp": 2, "ep": 2, "etp": 2}, 4, marks=pytest.mark.slow),
    ],
    ids=["qwen3moe-ep2", "dsv3-tp2-pp2-ep2", "qwen2moe-tp2-ep2-etp2"],
)
def test_import_at_layout_matches_hf(model_type, kwargs, world, tmp_path):
    """Each rank reads only its shards; logits (1e-4) and chosen experts equal transformers'."""
    ref = hf_model(model_type)
    ref_logits, ref_chosen = hf_forward(ref, _ids())
    folder = _saved(ref, tmp_path / "ckpt")
    args = (folder, kwargs, ref_logits, ref_chosen)
    assert all(run_on_ranks(_layout_logits, world, args=args, timeout=400))
