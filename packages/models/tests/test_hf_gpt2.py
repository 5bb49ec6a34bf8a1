"""GPT-2 through the Hugging Face bridge, transformers as the oracle: a tiny random-weight
``GPT2LMHeadModel`` (every weight random, biases and LayerNorm biases included; no downloads)
imported gives transformers' logits at world 1 (float64 and float32), TP=2 (with and without
SP), PP=2 and CP=2; an export reloads in transformers with the same tensors and logits; config
variants shardwork's layers cannot express are refused naming the field; the calculator
matches the published parameter counts."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwork.models import (  # noqa: E402
    GPTModel,
    LayerSpec,
    gather_logits,
    num_parameters,
    preset,
    slice_for_context_parallel,
    spec_for,
)
from shardwork.models.hf import (  # noqa: E402
    adapter_for_config,
    from_pretrained,
    gpt_config_from_hf,
    hf_config_from_gpt,
    save_pretrained,
)
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks  # noqa: E402

pytestmark = pytest.mark.golden

VOCAB, SEQ, BATCH = 250, 24, 2
HF_CONFIG = dict(
    vocab_size=VOCAB,
    n_positions=64,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_inner=None,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
)
# float32 on both sides (transformers' eager attention and tanh-GELU formula, shardwork's SDPA
# and F.gelu): measured largest |difference| on the logits (max |logit| ~7) 5.0-7.6
# eps32·max|ref| at world 1 over four seeds; 16 leaves 2x headroom, and a transposed Conv1D or
# a missing bias moves logits by 1e-2 or more (test_import_planted_bugs_are_caught).
FP32 = dict(dtype=torch.float32, rtol=0.0, ulps=16)


def hf_gpt2(seed: int = 0, *, dtype=torch.float32, **changes):
    """A tiny ``GPT2LMHeadModel`` with every weight random (LayerNorm weights around 1)."""
    cfg = transformers.GPT2Config(**(HF_CONFIG | changes))
    cfg._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(cfg).eval().to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if ".ln_" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def _ids(batch: int = BATCH, seq: int = SEQ):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))


def _logits(model, ids, tp_group=None):
    with torch.no_grad():
        return gather_logits(model.eval()(ids), tp_group=tp_group, vocab_size=VOCAB)


def test_import_matches_transformers_in_float64(tmp_path):
    ref = hf_gpt2(dtype=torch.float64)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    ref.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path, params_dtype=torch.float64)
    # float64 on both sides: the two only order sums differently (measured 4.4-8.1
    # eps64·max|ref| over four seeds, logits of max ~7).
    assert_close_at_scale(_logits(ours, ids), want, dtype=torch.float64, ulps=64, name="logits")


def test_import_matches_transformers_in_float32(tmp_path):
    ref = hf_gpt2()
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    ref.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    twin = preset("tiny-gpt2", max_position_embeddings=64, make_vocab_size_divisible_by=128)
    assert ours.config == twin
    assert_close_at_scale(_logits(ours, ids), want, name="logits", **FP32)


def test_import_planted_bugs_are_caught(tmp_path):
    """An untransposed c_attn (q|k|v read from the wrong axis) or a dropped output-projection
    bias move the logits far beyond the tolerance."""
    ref = hf_gpt2()
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    ref.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    good = _logits(ours, ids)
    layer = ours.decoder.layers[0].self_attention
    with torch.no_grad():
        layer.linear_proj.bias.zero_()
    assert (_logits(ours, ids) - want).abs().max() > 1e-2
    ours = from_pretrained(tmp_path)
    with torch.no_grad():
        w = ours.decoder.layers[1].mlp.fc1.weight
        # Conv1D storage read without the transpose
        w.copy_(w.detach().clone().reshape(w.shape[1], w.shape[0]).t())
    assert (_logits(ours, ids) - good).abs().max() > 1e-2


def test_import_reads_unprefixed_names(tmp_path):
    """OpenAI's original checkpoints name tensors without ``transformer.`` (``h.0.attn...``)."""
    from safetensors.torch import load_file, save_file

    ref = hf_gpt2(seed=4)
    ref.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    assert all(name.startswith("transformer.") for name in tensors)
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()}, path)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    assert_close_at_scale(_logits(from_pretrained(tmp_path), ids), want, name="logits", **FP32)


def test_export_reloads_in_transformers_with_equal_tensors_and_logits(tmp_path):
    ref = hf_gpt2(seed=1)
    ref.save_pretrained(tmp_path / "src")
    ours = from_pretrained(tmp_path / "src")
    save_pretrained(ours, tmp_path / "out", max_shard_bytes=60_000)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert type(back) is transformers.GPT2LMHeadModel
    # A pure copy and transpose: every tensor round-trips bit for bit.
    ref_state, back_state = ref.state_dict(), back.state_dict()
    assert set(back_state) == set(ref_state)
    for name, t in ref_state.items():
        assert torch.equal(back_state[name], t), name
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()  # tied
    ids = _ids()
    with torch.no_grad():
        # Same weights, same transformers code, same process: bit-identical logits.
        assert torch.equal(back(ids).logits, ref(ids).logits)


def test_export_of_shardwork_init_and_untied_head(tmp_path):
    """shardwork's own random init, untied: transformers computes shardwork's logits."""
    config = preset("tiny-gpt2", tie_word_embeddings=False)
    ours = GPTModel(config)
    with torch.no_grad():  # biases start at zero: make them count
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    save_pretrained(ours, tmp_path)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager")
    assert not back.config.tie_word_embeddings
    assert back.lm_head.weight.data_ptr() != back.transformer.wte.weight.data_ptr()
    ids = _ids()
    with torch.no_grad():
        want = back.eval()(ids).logits
    assert_close_at_scale(_logits(ours, ids), want, name="logits", **FP32)
    # (the vocabulary padding is shardwork's choice, not in config.json)
    back_config = gpt_config_from_hf(hf_config_from_gpt(config))
    assert back_config == config.replace(make_vocab_size_divisible_by=128)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"activation_function": "relu"}, r"activation_function='relu' is not supported"),
        ({"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx=True"),
        ({"reorder_and_upcast_attn": True}, r"reorder_and_upcast_attn=True"),
        ({"scale_attn_weights": False}, r"scale_attn_weights=False"),
        ({"add_cross_attention": True}, r"add_cross_attention=True"),
        ({"embd_pdrop": 0.2, "resid_pdrop": 0.1}, r"embd_pdrop=0.2 is not supported"),
    ],
)
def test_variants_it_cannot_express_are_refused(change, match):
    hf = transformers.GPT2Config(**(HF_CONFIG | change)).to_dict()
    with pytest.raises(ValueError, match=match):
        gpt_config_from_hf(hf)


def test_config_fields_both_ways():
    hf = transformers.GPT2Config(**(HF_CONFIG | dict(n_inner=160, layer_norm_epsilon=1e-6)))
    config = gpt_config_from_hf(hf.to_dict())
    assert (config.ffn_hidden_size, config.norm_epsilon, config.max_position_embeddings) == (
        160,
        1e-6,
        64,
    )
    assert config.tie_word_embeddings and config.kv_heads == 4
    # gelu_pytorch_tanh is the same tanh approximation
    tanh = transformers.GPT2Config(**(HF_CONFIG | dict(activation_function="gelu_pytorch_tanh")))
    assert gpt_config_from_hf(tanh.to_dict()).mlp_activation == "gelu_tanh"
    written = hf_config_from_gpt(config)
    assert written["model_type"] == "gpt2" and written["architectures"] == ["GPT2LMHeadModel"]
    assert (written["n_inner"], written["activation_function"]) == (160, "gelu_new")
    assert gpt_config_from_hf(written) == config


def test_only_gpt2_shaped_configs_are_claimed():
    assert adapter_for_config(preset("tiny-gpt2")).model_type == "gpt2"
    for change in (
        dict(add_proj_bias=False),
        dict(normalization="rmsnorm"),
        dict(num_query_groups=2),
        dict(position_embedding_type="rope"),
    ):
        with pytest.raises(ValueError, match="no single Hugging Face model_type"):
            adapter_for_config(preset("tiny-gpt2", **change))
    # and the Llama-lineage adapters do not claim a config with a classic GPT option
    with pytest.raises(ValueError, match="normalization='layernorm'"):
        adapter_for_config(preset("tiny-llama3-8b", normalization="layernorm"))


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_presets_match_the_published_counts(name, count):
    """Hugging Face's ``GPT2LMHeadModel.num_parameters()`` (tied head counted once), and the
    formula written out: embedding + positions + L·(qkv, proj, fc1, fc2 with biases, two
    LayerNorms) + final LayerNorm."""
    c = preset(name)
    h, f, v, p = c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.max_position_embeddings
    layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    assert num_parameters(c) == v * h + p * h + c.num_layers * layer + 2 * h == count


def test_tiny_twin_counts_like_transformers():
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**(HF_CONFIG | dict(n_positions=256)))
    )
    assert num_parameters(preset("tiny-gpt2")) == hf.num_parameters()


def test_spec_is_layernorm_gelu_without_rotary():
    spec = spec_for(preset("gpt2"))
    assert list(spec.layers) == [LayerSpec("attention", "gelu", norm="layernorm")] * 12
    assert spec.final_norm == "layernorm" and spec.rotary is None and spec.mtp == ()


def _layout_logits(folder, parallel_kwargs, want):
    """On each rank: build this rank's stage from the folder, run it on this rank's tokens
    (its CP chunks) and compare the gathered logits with transformers' (same chunks)."""
    from shardwork.models.hf import load_hf_weights, read_hf_config
    from shardwork.models.module import to_empty_keep_meta
    from shardwork.models.pipeline import build_stage, pipeline_logits
    from shardwork.parallel_state import ParallelConfig, init_process_groups

    sp = parallel_kwargs.pop("sequence_parallel", False)
    groups = init_process_groups(ParallelConfig(**parallel_kwargs))
    config = gpt_config_from_hf(read_hf_config(folder), sequence_parallel=sp)
    stage = build_stage(config, groups, device="meta")
    to_empty_keep_meta(stage, "cpu")
    stage.rng_tracker.to("cpu")
    load_hf_weights(stage, folder)
    cp_kw = dict(cp_rank=groups.rank("cp"), cp_size=groups.size("cp"))
    ids = slice_for_context_parallel(_ids(), **cp_kw)
    if groups.size("pp") > 1:
        logits = pipeline_logits(stage.eval(), groups, ids)
        if not groups.is_last_pp_stage:
            return True
    else:
        logits = _logits(stage, ids, tp_group=groups.tp)
    assert_close_at_scale(logits, slice_for_context_parallel(want, **cp_kw), name="logits", **FP32)
    return True


@pytest.mark.multirank
@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp": 2, "sequence_parallel": True},
        {"pp": 2},
        {"cp": 2},
        pytest.param({"tp": 2}, marks=pytest.mark.slow),
    ],
    ids=["tp2-sp", "pp2", "cp2", "tp2"],
)
def test_import_at_layout_matches_transformers(kwargs, tmp_path):
    ref = hf_gpt2(seed=2)
    with torch.no_grad():
        want = ref(_ids()).logits
    ref.save_pretrained(tmp_path / "ckpt")
    args = (tmp_path / "ckpt", kwargs, want)
    assert all(run_on_ranks(_layout_logits, 2, args=args, timeout=400))
