"""Hugging Face bridge of the hybrid families: tiny random-weight transformers models (no
downloads) of Nemotron-H (Mamba-2, squared-ReLU MLP, attention without RoPE, one part per
block; and with Nemotron 3 Nano's MoE blocks: squared-ReLU experts and shared expert,
group-limited sigmoid routing with a random expert bias) and Qwen3-Next (Gated DeltaNet and gated attention, zero-centred norms, partial RoPE,
MoE with a gated shared expert) give transformers' logits after import, at world 1 and at
TP=2 / PP=2 (EP=2 with MoE); exports reload in transformers with the same logits.

transformers runs its own torch paths here: mamba-ssm, causal-conv1d and
flash-linear-attention are not installed on this machine, and each test asserts so (a kernel
would change the reference's numerics)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwork.models import GPTModel, gather_logits, preset  # noqa: E402
from shardwork.models.hf import (  # noqa: E402
    from_pretrained,
    gpt_config_from_hf,
    hf_config_from_gpt,
    save_pretrained,
)
from shardwork.parallel_state.testing import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.golden

_COMMON = dict(
    vocab_size=250,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    "nemotron_h": dict(
        layers_block_type=[
            "linear_attention",
            "mlp",
            "full_attention",
            "mlp",
            "linear_attention",
            "mlp",
        ],
        num_hidden_layers=6,
        intermediate_size=96,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        layer_norm_epsilon=1e-5,
    ),
    # Nemotron 3 Nano's blocks: MoE with squared-ReLU experts and shared expert, sigmoid
    # routing on score + e_score_correction_bias, 4 groups of which 2 kept (scored by their
    # top 2, not top_k // topk_group = 1), routed_scaling_factor
    "nemotron_h_moe": dict(
        layers_block_type=[
            "linear_attention",
            "moe",
            "full_attention",
            "mlp",
            "linear_attention",
            "moe",
        ],
        num_hidden_layers=6,
        intermediate_size=96,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        layer_norm_epsilon=1e-5,
    ),
    "qwen3_next": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    ),
}
MODEL_TYPES = {"nemotron_h_moe": "nemotron_h"}
"""Test cases whose name is not their ``model_type``."""
PATTERNS = {"nemotron_h": "M-*-M-", "nemotron_h_moe": "ME*-ME", "qwen3_next": None}
SEQ, BATCH = 20, 2  # SEQ > the scans' chunk (8 here, transformers' 64): state crosses chunks


def _assert_torch_paths():
    """transformers takes a kernel only from these packages (directly, or through the hub's
    ``kernels`` loader); with none importable every mixer runs its torch fallback."""
    for package in ("mamba_ssm", "causal_conv1d", "fla", "kernels"):
        assert importlib.util.find_spec(package) is None, f"{package} is installed"


def hf_model(model_type: str, seed: int = 0):
    """A tiny transformers model with every weight random (norms around 1, zero-centred ones
    around 0 so their scale 1 + w stays near 1)."""
    _assert_torch_paths()
    cfg = transformers.AutoConfig.for_model(
        MODEL_TYPES.get(model_type, model_type), **(_COMMON | CONFIGS[model_type])
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    zero_centred = model_type == "qwen3_next"
    with torch.no_grad():
        for name, t in model.named_parameters():
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("norm.weight") or "layernorm" in name or "norm_f" in name:
                base = 0.0 if zero_centred and "linear_attn.norm" not in name else 1.0
                t.copy_(base + 0.2 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                t.copy_(0.5 * noise)
            elif ".gate.weight" in name:
                t.copy_(0.3 * noise)
            else:
                t.copy_(0.05 * noise)
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # moves some experts in or out
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
    return model


def _ids():
    return torch.randint(0, 250, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _logits(model, ids):
    with torch.no_grad():
        return gather_logits(model.eval()(ids), tp_group=None, vocab_size=250)


# fp32 end to end on both sides; measured largest |difference| on logits up to 1.7: import
# 8.8e-7 (nemotron_h) and 1.4e-6 (qwen3_next), about 7 fp32 ulp at that scale (the scans
# sum in other orders); export 1.8e-7. 1e-5 leaves ~7x headroom; a swapped query/gate head
# or a shifted conv channel moves logits by 1e-2 or more.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_import_matches_transformers(model_type, tmp_path):
    ref = hf_model(model_type)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    ref.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    assert ours.config.hybrid_layer_pattern == PATTERNS[model_type]
    torch.testing.assert_close(_logits(ours, ids), want, **TOL)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_export_reloads_in_transformers(model_type, tmp_path):
    ref = hf_model(model_type)
    ids = _ids()
    config = gpt_config_from_hf(ref.config.to_dict())
    ours = GPTModel(config)  # shardwork's own random init, not the reference's weights
    save_pretrained(ours, tmp_path, max_shard_bytes=40_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        want = back(ids).logits
    torch.testing.assert_close(_logits(ours, ids), want, **TOL)
    # and the written config reads back into the same GPTConfig
    assert gpt_config_from_hf(hf_config_from_gpt(config)) == config


def _layout_logits(folder, parallel_kwargs, want):
    """On each rank: build this rank's stage from the folder, reading only its layers, run
    the pipeline forward and compare the last stage's gathered logits with transformers'."""
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
        torch.testing.assert_close(logits, want, **TOL)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("model_type", "kwargs", "world"),
    [
        ("nemotron_h", {"tp": 2}, 2),
        ("qwen3_next", {"pp": 2}, 2),
        ("nemotron_h_moe", {"ep": 2, "etp": 1}, 2),
        pytest.param("nemotron_h_moe", {"tp": 2, "ep": 2, "etp": 2}, 4, marks=pytest.mark.slow),
        pytest.param("nemotron_h", {"pp": 2}, 2, marks=pytest.mark.slow),
        pytest.param("qwen3_next", {"tp": 2, "ep": 2, "etp": 1}, 2, marks=pytest.mark.slow),
        pytest.param("nemotron_h", {"tp": 2, "pp": 2}, 4, marks=pytest.mark.slow),
    ],
    ids=[
        "nemotronh-tp2",
        "qwen3next-pp2",
        "nemotronh-moe-ep2",
        "nemotronh-moe-tp2-ep2-etp2",
        "nemotronh-pp2",
        "qwen3next-tp2-ep2",
        "nemotronh-tp2-pp2",
    ],
)
def test_import_at_layout_matches_transformers(model_type, kwargs, world, tmp_path):
    ref = hf_model(model_type)
    with torch.no_grad():
        want = ref(_ids()).logits
    ref.save_pretrained(tmp_path / "ckpt")
    args = (tmp_path / "ckpt", kwargs, want)
    assert all(run_on_ranks(_layout_logits, world, args=args, timeout=400))


def _nemotron_h_moe_hf() -> dict:
    cfg = transformers.AutoConfig.for_model("nemotron_h", **(_COMMON | CONFIGS["nemotron_h_moe"]))
    return cfg.to_dict()


def test_nemotron_h_moe_fields():
    config = gpt_config_from_hf(_nemotron_h_moe_hf())
    m = config.moe
    r = m.router
    assert (config.mlp_activation, config.hybrid_layer_pattern) == ("relu2", "ME*-ME")
    assert (m.ffn_hidden_size, m.shared_expert_ffn_hidden_size, m.shared_expert_gate) == (
        32,
        48,
        False,
    )
    assert (r.num_experts, r.top_k, r.score_function, r.top_k_scaling_factor) == (
        8,
        2,
        "sigmoid",
        2.5,
    )
    # transformers scores a group by its top 2 experts; top_k // topk_group would be 1
    assert (r.num_groups, r.group_top_k, r.group_score_top_n) == (4, 2, 2)
    assert r.enable_expert_bias and r.router_dtype == "fp32"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"moe_latent_size": 16}, r"moe_latent_size=16 is not supported for nemotron_h"),
        ({"norm_topk_prob": False}, r"norm_topk_prob=False with num_experts_per_tok=2"),
        (
            {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1},
            r"norm_topk_prob=True with num_experts_per_tok=1",
        ),
    ],
)
def test_nemotron_h_moe_variants_it_cannot_express_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        gpt_config_from_hf(_nemotron_h_moe_hf() | change)


def test_tiny_nemotron_h_moe_preset_exports_its_moe():
    config = preset("tiny-nemotron-h-moe")
    assert gpt_config_from_hf(hf_config_from_gpt(config)).moe == config.moe


def test_nemotron_h_moe_export_refuses_other_routing():
    config = gpt_config_from_hf(_nemotron_h_moe_hf())
    softmax = dataclasses.replace(
        config.moe.router,
        score_function="softmax",
        enable_expert_bias=False,
        num_groups=None,
        group_top_k=None,
        group_score_top_n=None,
    )
    bad = [
        (config.moe.replace(router=softmax), r"score_function='softmax'"),
        (config.moe.replace(shared_expert_ffn_hidden_size=None), "no shared expert"),
    ]
    for moe, match in bad:
        with pytest.raises(ValueError, match=match):
            hf_config_from_gpt(config.replace(moe=moe))
