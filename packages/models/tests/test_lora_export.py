"""A trained-shape LoRA model (``apply_lora`` on an imported HF model) leaves through both
exits, with transformers + peft as the oracle:

- ``save_pretrained`` writes the merged model: transformers' plain model loaded from it
  computes the LoRA model's (unmerged) logits, and the LoRA model's base shards are restored
  bit-exactly afterwards;
- ``export_peft`` of the adapters gathered by ``full_state_dict(keys=is_lora_key)``:
  ``PeftModel.from_pretrained(base, folder)`` computes the same logits.

Tolerance as in test_hf_peft.py (fp64 both sides; both stacks build fp32 rotary tables, so the
base models already differ by ~1e-7; the adapters move the logits by > 0.05).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from shardwork.models import LoRAConfig, gather_logits  # noqa: E402
from shardwork.models.full_state import full_state_dict  # noqa: E402
from shardwork.models.hf import export_peft, from_pretrained, save_pretrained  # noqa: E402
from shardwork.models.lora import apply_lora, is_lora_key  # noqa: E402
from shardwork.models.testing import randomize_lora_b  # noqa: E402

pytestmark = pytest.mark.golden

_V = 200
_TOL = dict(rtol=1e-5, atol=1e-5)
_COMMON = dict(
    vocab_size=_V,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _folder(kind: str, tmp_path):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))
    else:  # routed experts go to PEFT's target_parameters
        cfg = transformers.Qwen3MoeConfig(
            **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    return folder


def _ids():
    return torch.randint(0, _V, (2, 10), generator=torch.Generator().manual_seed(3))


def _hf(folder):
    # Eager experts: transformers' grouped_mm has no fp64 kernel (ignored by dense models).
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="eager"
    ).eval()


@pytest.mark.parametrize(
    ("kind", "targets"),
    [
        ("llama", ("linear_qkv", "linear_proj", "fc1", "fc2")),
        ("qwen3_moe", ("linear_qkv", "experts.linear_fc1", "experts.linear_fc2")),
    ],
)
def test_lora_model_exports_merged_and_as_peft(kind, targets, tmp_path):
    folder = _folder(kind, tmp_path)
    model = from_pretrained(folder, params_dtype=torch.float64)
    lora = LoRAConfig(rank=4, alpha=6.0, target_modules=targets)
    apply_lora(model, lora)
    randomize_lora_b(model, seed=5, scale=0.3)
    base = {
        k: st.data.clone() for k, st in model.sharded_state_dict().items() if not is_lora_key(k)
    }
    with torch.no_grad():
        expected = gather_logits(model(_ids()), tp_group=None, vocab_size=_V)

    save_pretrained(model, tmp_path / "merged")
    for key, st in model.sharded_state_dict().items():
        if key in base:
            assert torch.equal(st.data, base[key]), key  # the export gave the base back exactly
    adapters = full_state_dict(model, keys=is_lora_key)
    export_peft(adapters, lora, model.config, tmp_path / "adapter")

    with torch.no_grad():
        plain = _hf(folder)(_ids()).logits
        merged = _hf(tmp_path / "merged")(_ids()).logits
        with_peft = peft.PeftModel.from_pretrained(_hf(folder), tmp_path / "adapter")(_ids()).logits
    assert (expected - plain).abs().max() > 0.05  # the adapters matter
    torch.testing.assert_close(merged, expected, **_TOL)
    torch.testing.assert_close(with_peft, expected, **_TOL)
