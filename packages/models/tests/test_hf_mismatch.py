"""A Hugging Face folder whose ``config.json`` does not match its weights is refused, naming
what differs, before any weight is copied (transformers writes the folders).

Before these checks a ``config.json`` claiming fewer layers than the weights loaded the first
layers only, ``tie_word_embeddings: true`` beside an ``lm_head.weight`` dropped the head, and a
``config.json`` without ``hidden_size`` ended in a ``KeyError``.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from shardwork.models import GPTModel  # noqa: E402
from shardwork.models.hf import from_pretrained, gpt_config_from_hf, load_hf_weights  # noqa: E402

_CONFIG = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_CONFIG)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _edited(tmp_path, folder, **changes):
    """A copy of ``folder`` whose config.json has ``changes`` (None deletes a key)."""
    for item in folder.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_matching_folder_loads(folder):
    model = from_pretrained(folder)
    assert model.config.num_layers == 2 and not model.config.tie_word_embeddings


def test_fewer_layers_in_config_than_in_the_weights_is_refused(tmp_path, folder):
    with pytest.raises(ValueError, match=r"holds 9 tensor\(s\).*'model\.layers\.1\..*num_layers=1"):
        from_pretrained(_edited(tmp_path, folder, num_hidden_layers=1))


def test_tied_config_beside_an_lm_head_is_refused(tmp_path, folder):
    with pytest.raises(ValueError, match=r"'lm_head\.weight'.*tie_word_embeddings=True"):
        from_pretrained(_edited(tmp_path, folder, tie_word_embeddings=True))


def test_loading_into_a_smaller_model_is_refused_before_any_copy(folder):
    config = gpt_config_from_hf(json.loads((folder / "config.json").read_text()))
    model = GPTModel(config.replace(num_layers=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.input_layernorm\.weight"):
        load_hf_weights(model, folder)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_saved_rotary_buffer_is_not_a_mismatch(tmp_path, folder):
    """Older transformers saved ``rotary_emb.inv_freq`` with the weights: still loadable."""
    copy = _edited(tmp_path, folder)
    weights = load_file(copy / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    reference = from_pretrained(folder)
    loaded = from_pretrained(copy)
    for (name, a), b in zip(reference.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_missing_config_field_names_it(tmp_path, folder):
    with pytest.raises(ValueError, match=r"model_type='llama'\) has no 'hidden_size' field"):
        from_pretrained(_edited(tmp_path, folder, hidden_size=None))


def test_a_config_that_is_not_json_is_refused(tmp_path, folder):
    copy = _edited(tmp_path, folder)
    (copy / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        from_pretrained(copy)


def _copy(tmp_path, folder):
    for item in folder.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    return tmp_path


def test_weight_files_are_checked_from_their_headers(tmp_path, folder):
    """`check_weight_files` reads headers only and names the file: junk where the weights
    should be (a failed download), an index that is not JSON, one naming a missing shard or a
    tensor its shard lacks. The folder transformers wrote passes; each damaged copy also fails
    to load, so the check refuses only what the load would."""
    from shardwork.models.hf.files import check_weight_files

    check_weight_files(folder)
    single = folder / "model.safetensors"
    tensors = load_file(single)
    cases = {}
    (tmp_path / "junk").mkdir()
    junk = _copy(tmp_path / "junk", folder)
    (junk / "model.safetensors").write_bytes(single.read_bytes()[:7])  # a cut-off download
    cases[junk] = r"junk/model\.safetensors is not a readable safetensors file"
    for name, index, pattern in [
        ("not_json", "{weight_map", r"model\.safetensors\.index\.json is not a safetensors index"),
        ("missing_shard", {"weight_map": dict.fromkeys(tensors, "part-2.safetensors")},
         r"part-2\.safetensors \(holding '.*' by the index\) does not exist"),
        ("lacks", {"weight_map": {**dict.fromkeys(tensors, "model.safetensors"), "extra.w": "model.safetensors"}},
         r"lacks 1 tensor\(s\) its index maps to it, e\.g\. 'extra\.w'"),
    ]:  # fmt: skip
        path = tmp_path / name
        path.mkdir()
        _copy(path, folder)
        text = index if isinstance(index, str) else json.dumps(index)
        (path / "model.safetensors.index.json").write_text(text)
        cases[path] = pattern
    for path, pattern in cases.items():
        with pytest.raises(ValueError, match=pattern):
            check_weight_files(path)
        with pytest.raises((ValueError, OSError)):  # the load refuses the same folder
            from_pretrained(path)


@pytest.mark.parametrize("damage", ["missing", "reshaped", "extra"])
def test_check_hf_weights_refuses_from_headers_what_the_load_refuses(tmp_path, folder, damage):
    """`check_hf_weights` (headers only, no tensor read) passes the folder transformers wrote
    and refuses a copy missing a tensor, holding one of another shape, or one too many, with
    the message the load gives for the same copy."""
    from shardwork.models.hf import check_hf_weights

    config = gpt_config_from_hf(json.loads((folder / "config.json").read_text()))
    check_hf_weights(config, folder)
    copy = _edited(tmp_path, folder)
    weights = load_file(copy / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    if damage == "missing":
        del weights[name]
    elif damage == "reshaped":
        weights[name] = weights[name][:, :-1].contiguous()
    else:
        weights["model.layers.2.mlp.down_proj.weight"] = weights[name].clone()
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as from_headers:
        check_hf_weights(config, copy)
    with pytest.raises(ValueError) as from_load:
        from_pretrained(copy)
    assert str(from_headers.value) == str(from_load.value)
    assert {
        "missing": "has no tensor",
        "reshaped": "has shape (64, 95)",
        "extra": "holds 1 tensor",
    }[damage] in str(from_headers.value)
