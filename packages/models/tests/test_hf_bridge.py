"""Hugging Face bridge: tiny random-weight HF models (no download) vs GPTModel.

- import at world size 1, TP=2 (+SP) and PP=2 (hidden states sent by hand) gives logits within 1e-4 of transformers' (fp32);
  checkpoints are saved sharded (index file) so the sliced reader is exercised;
- export (at world size 1 and from TP=2) reloads in transformers with identical logits;
- HF configs of both transformers 4.x and 5.x spelling map to the same GPTConfig.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwork.models import gather_logits  # noqa: E402
from shardwork.models.hf import from_pretrained, gpt_config_from_hf, save_pretrained  # noqa: E402
from shardwork.parallel_state import ParallelConfig, init_process_groups  # noqa: E402
from shardwork.parallel_state.testing import run_on_ranks  # noqa: E402

# Golden / cross-implementation: CI reruns these with other CPU kernels (.ci/run).
pytestmark = pytest.mark.golden

_COMMON = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _hf_model(family: str):
    torch.manual_seed(0)
    if family == "llama31":
        cfg = transformers.LlamaConfig(
            **_COMMON,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_COMMON))
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**_COMMON, head_dim=24, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise AssertionError(family)
    with torch.no_grad():  # non-default weights everywhere: norms away from 1, biases nonzero
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def _ids():
    return torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(params=["llama31", "qwen2", "qwen3"])
def hf_folder(request, tmp_path):
    model = _hf_model(request.param)
    folder = tmp_path / request.param
    model.save_pretrained(folder, max_shard_size="60KB")
    with torch.no_grad():
        ref = model(_ids()).logits
    return folder, ref


def test_import_world1_matches_hf_logits(hf_folder):
    folder, ref = hf_folder
    assert (folder / "model.safetensors.index.json").is_file()
    model = from_pretrained(folder).eval()
    with torch.no_grad():
        logits = gather_logits(model(_ids()), tp_group=None, vocab_size=250)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def _tp2_logits(folder, export_to):
    groups = init_process_groups(ParallelConfig(tp=2))
    model = from_pretrained(folder, groups, sequence_parallel=True).eval()
    save_pretrained(model, export_to)  # collective: every rank contributes its shards
    with torch.no_grad():
        return gather_logits(model(_ids()), tp_group=groups.tp, vocab_size=250)


@pytest.mark.multirank
def test_import_tp2_matches_hf_logits_and_exports(hf_folder, tmp_path):
    folder, ref = hf_folder
    out = tmp_path / "exported_tp2"
    for logits in run_on_ranks(_tp2_logits, 2, args=(str(folder), str(out))):
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        # Exact on any CPU: transformers' own model, the same weights, the same process and
        # kernels as ``ref``; any difference means the export changed a weight.
        torch.testing.assert_close(reloaded(_ids()).logits, ref, rtol=0, atol=0)


def _pp2_logits(folder):
    import torch.distributed as dist

    groups = init_process_groups(ParallelConfig(pp=2))
    stage = groups.rank("pp")
    model = from_pretrained(folder, groups, layer_range=(0, 1) if stage == 0 else (1, 2)).eval()
    with torch.no_grad():
        if stage == 0:
            dist.send(model(_ids()), dst=groups.members["pp"][1])
            return None
        hidden = torch.empty(12, 2, 64)
        dist.recv(hidden, src=groups.members["pp"][0])
        return gather_logits(model(hidden_states=hidden), tp_group=None, vocab_size=250)


@pytest.mark.multirank
def test_import_pp2_matches_hf_logits(hf_folder):
    folder, ref = hf_folder
    _, logits = run_on_ranks(_pp2_logits, 2, args=(str(folder),))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_export_reloads_in_hf_with_identical_logits(hf_folder, tmp_path):
    folder, ref = hf_folder
    model = from_pretrained(folder)
    out = tmp_path / "exported"
    save_pretrained(model, out, max_shard_bytes=50_000)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = reloaded(_ids()).logits
    # Exact on any CPU: same model code, weights, process and kernels as ``ref``.
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)


def test_config_4x_and_5x_spellings_agree():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    base = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 250,
        "rms_norm_eps": 1e-5,
    }
    v4 = gpt_config_from_hf(base | {"rope_theta": 500000.0, "rope_scaling": rope})
    v5 = gpt_config_from_hf(base | {"rope_parameters": rope | {"rope_theta": 500000.0}})
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "gpt_neox"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ],
)
def test_unsupported_hf_config_is_rejected(change, field):
    base = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "vocab_size": 250,
    }
    with pytest.raises(ValueError, match=field):
        gpt_config_from_hf(base | change)
