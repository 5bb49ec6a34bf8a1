"""DeepSeek-V3 MTP tensor names against a real checkpoint's naming (no download).

``data/deepseek_v3_tiny_mtp_keys.txt`` lists, by hand from DeepSeek-V3's README_WEIGHTS.md and
vLLM's DeepSeek MTP loader (sources in the file), every tensor name a DeepSeek-V3 checkpoint
of the tiny preset holds: the MTP depth is ``model.layers.<num_hidden_layers>`` with ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, copies of ``embed_tokens`` and ``shared_head.head``,
and a full decoder layer. Export must produce exactly those names; a folder with them imports
back into an equal model (same weights, same loss with the MTP term), and import checks the
copies against the shared embedding and head.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardwork.models import GPTModel, preset
from shardwork.models.full_state import full_state_dict
from shardwork.models.hf import from_pretrained, save_pretrained
from shardwork.models.hf.moe_weights import moe_hf_state_dict
from shardwork.models.mtp import MTPConfig

FIXTURE = Path(__file__).parent / "data" / "deepseek_v3_tiny_mtp_keys.txt"


def _expected() -> set[str]:
    lines = FIXTURE.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def _model(**over):
    cfg = preset("tiny-deepseek-v3", params_dtype=torch.float64, **over)
    assert cfg.num_layers == 3 and cfg.mtp.num_layers == 1
    model = GPTModel(cfg)
    for router in model.modules():  # a non-zero expert bias, so its name is really exported
        bias = getattr(getattr(router, "inner", None), "expert_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(1)))
    return model


def _keys(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            names |= set(f.keys())
    return names


def _loss(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    with torch.no_grad():
        model.train()  # the MTP loss joins the objective in training mode
        loss_sum, _ = model(ids, labels=torch.roll(ids, -1, dims=1))
    return loss_sum, model.mtp.tracker.values.clone()


def test_export_names_equal_the_real_checkpoint_naming():
    model = _model()
    out = moe_hf_state_dict(model)
    assert set(out) == _expected()
    assert torch.equal(out["model.layers.3.embed_tokens.weight"], out["model.embed_tokens.weight"])
    assert torch.equal(out["model.layers.3.shared_head.head.weight"], out["lm_head.weight"])
    full = full_state_dict(model)
    for ours, hf in [
        ("mtp.layers.0.enorm.weight", "model.layers.3.enorm.weight"),
        ("mtp.layers.0.hnorm.weight", "model.layers.3.hnorm.weight"),
        ("mtp.layers.0.eh_proj.weight", "model.layers.3.eh_proj.weight"),
        ("mtp.layers.0.final_layernorm.weight", "model.layers.3.shared_head.norm.weight"),
    ]:
        assert torch.equal(full[ours], out[hf]), hf


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_through_a_checkpoint_folder(tmp_path, tied):
    model = _model(tie_word_embeddings=tied)
    save_pretrained(model, tmp_path)
    expected = _expected()
    if tied:  # tied models store no lm_head; the MTP head copy is the embedding
        expected.discard("lm_head.weight")
    assert _keys(tmp_path) == expected
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    back = from_pretrained(
        tmp_path,
        params_dtype=torch.float64,
        mtp=model.config.mtp,  # transformers configs say 1 depth without weights: opt in
        make_vocab_size_divisible_by=model.config.make_vocab_size_divisible_by,
    )
    assert back.config == model.config
    ref, got = full_state_dict(model), full_state_dict(back)
    assert set(ref) == set(got)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key
    ref_loss, ref_mtp = _loss(model)
    loss, mtp = _loss(back)
    assert torch.equal(loss, ref_loss) and torch.equal(mtp, ref_mtp)
    assert float(mtp[0, 1]) > 0  # the MTP depth counted tokens


def test_import_checks_the_mtp_copies(tmp_path):
    model = _model()
    tensors = moe_hf_state_dict(model)
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"] + 1.0
    save_pretrained(model, tmp_path)  # config.json
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.shared_head\.head\.weight.*differs"):
        from_pretrained(tmp_path, params_dtype=torch.float64, mtp=MTPConfig(loss_coeff=0.3))
