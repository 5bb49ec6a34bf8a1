"""Tokenizer checks before any work (vocabulary vs embedding, unreadable tokenizer JSON,
dataset built with another tokenizer) and fp64 training."""

import dataclasses

import numpy as np
import pytest
import torch

from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.config.sections import ModelSection, TrainConfig
from shardwork.trainer.config.validate import validate_config
from shardwork.trainer.data.dataset_meta import read_dataset_meta
from shardwork.trainer.data.preprocess import write_documents
from shardwork.trainer.data.tokenizer import ByteTokenizer, load_tokenizer

DOCS = ["the cat sat on the mat.", "the dog sat on the log.", "a cat and a dog."] * 10


def _with(**sections):
    config = TrainConfig()
    for name, values in sections.items():
        if name == "model":  # the [model] table: GPTConfig settings
            config = dataclasses.replace(config, model=ModelSection(settings=values))
            continue
        config = dataclasses.replace(
            config, **{name: dataclasses.replace(getattr(config, name), **values)}
        )
    return config


def _problems(config) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate_config(config, world_size=1)
    return err.value.problems


@pytest.fixture
def hf_tokenizer_path(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        DOCS, trainers.BpeTrainer(vocab_size=50, special_tokens=["[UNK]", "</s>"])
    )
    path = tmp_path / "bpe.json"
    tok.save(str(path))
    return path


def test_vocab_smaller_than_tokenizer_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    (problem,) = _problems(_with(model={"vocab_size": 100}))
    assert problem.startswith("model.vocab_size=100 is smaller than the vocabulary of ")
    assert "data.tokenizer='byte' (257 ids)" in problem and "valid: >= 257" in problem
    resolved = validate_config(_with(model={"vocab_size": 257}), world_size=1)
    assert resolved.model.settings["vocab_size"] == 257


def test_unreadable_tokenizer_json_is_a_config_error(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": ')
    (problem,) = _problems(_with(data={"tokenizer": str(bad)}))
    assert problem.startswith(f"data.tokenizer={str(bad)!r}: tokenizer ")
    assert "not a readable Hugging Face tokenizer JSON file" in problem
    with pytest.raises(ValueError, match="not a readable Hugging Face tokenizer JSON"):
        load_tokenizer(str(bad))


def test_preprocess_records_the_tokenizer(tmp_path, hf_tokenizer_path):
    tok = load_tokenizer(str(hf_tokenizer_path))
    write_documents(DOCS, tmp_path / "bpe_data", tok)
    meta = read_dataset_meta(tmp_path / "bpe_data")
    assert (meta.tokenizer, meta.vocab_size, meta.eod_id) == (
        str(hf_tokenizer_path),
        tok.vocab_size,
        tok.eod_id,
    )
    assert read_dataset_meta(tmp_path / "no_such_dataset") is None


def test_dataset_built_with_another_tokenizer_is_rejected(tmp_path, monkeypatch, hf_tokenizer_path):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    hf = load_tokenizer(str(hf_tokenizer_path))
    write_documents(DOCS, tmp_path / "bpe_data", hf)
    write_documents(DOCS, tmp_path / "byte_data", ByteTokenizer())
    prefixes = [str(tmp_path / "byte_data"), str(tmp_path / "bpe_data")]
    # trained with the byte tokenizer: the BPE-built dataset (prefix 1) does not match
    (problem,) = _problems(_with(data={"prefixes": prefixes}))
    assert problem.startswith(f"data.prefixes[1]={prefixes[1]!r} was tokenized with ")
    assert f"(vocab {hf.vocab_size}, end-of-document id {hf.eod_id})" in problem
    assert "data.tokenizer='byte' has vocab 257, end-of-document id 256" in problem
    # the same check through a JSON data config
    data_config = tmp_path / "blend.json"
    data_config.write_text(
        f'{{"train": [[1.0, "{prefixes[1]}"]], "valid": [[1.0, "{prefixes[0]}"]]}}'
    )
    (problem,) = _problems(_with(data={"data_config": str(data_config)}))
    assert problem.startswith(f"data.data_config['train']={prefixes[1]!r} was tokenized with")
    # the matching tokenizer passes
    resolved = validate_config(
        _with(data={"prefixes": prefixes[1:], "tokenizer": str(hf_tokenizer_path)}),
        world_size=1,
    )
    assert resolved.model.settings["vocab_size"] == hf.vocab_size


def test_dataset_with_another_end_of_document_token_names_data_eod_token(
    tmp_path, monkeypatch, hf_tokenizer_path
):
    """A dataset tokenized with --eod_token '[UNK]' under a run whose data.eod_token is unset
    (it picks '</s>'): the problem names data.eod_token, its value and the one to set, and that
    value passes. Blended with a '</s>' dataset, no one value suits both: re-tokenizing is."""
    import tokenizers

    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    ids = tokenizers.Tokenizer.from_file(str(hf_tokenizer_path)).get_vocab(with_added_tokens=True)
    unk, eos = ids["[UNK]"], ids["</s>"]
    path = str(hf_tokenizer_path)
    write_documents(DOCS, tmp_path / "unk_data", load_tokenizer(path, eod_token="[UNK]"))
    write_documents(DOCS, tmp_path / "eos_data", load_tokenizer(path))
    unk_data, eos_data = str(tmp_path / "unk_data"), str(tmp_path / "eos_data")
    (problem,) = _problems(_with(data={"prefixes": [unk_data], "tokenizer": path}))
    assert problem.startswith(f"data.prefixes[0]={unk_data!r} was tokenized with {path!r} ")
    assert problem.endswith(
        f"end-of-document id {eos}: it ends documents with '[UNK]' (id {unk}), and "
        "data.eod_token=None (picks '</s>') does not; valid: data.eod_token='[UNK]'"
    )
    fixed = {"prefixes": [unk_data], "tokenizer": path, "eod_token": "[UNK]"}
    assert validate_config(_with(data=fixed), world_size=1).data.eod_token == "[UNK]"

    blend = {"prefixes": [eos_data, unk_data], "tokenizer": path}
    for eod_token, odd, theirs, ours in ((None, 1, unk, "</s>"), ("[UNK]", 0, eos, "[UNK]")):
        (problem,) = _problems(_with(data={**blend, "eod_token": eod_token}))
        assert problem.startswith(f"data.prefixes[{odd}]={blend['prefixes'][odd]!r} ")
        assert problem.endswith(
            f"the run's datasets mix end-of-document ids {sorted([unk, eos])}, and one "
            "data.eod_token serves one of them; valid: re-tokenize it with shardwork-preprocess "
            f"--eod_token {ours!r}, or leave it out"
        )
        assert f"(id {theirs}), and data.eod_token={eod_token!r}" in problem


def test_fp64_run_keeps_float64_and_tracks_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path / "corpus"))
    from shardwork.trainer.run.setup import build_assembly, init_runtime
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    steps = {"schedule": {"train_steps": 3, "warmup_steps": 1}, "eval": {"interval": None}}
    fp64 = tiny_config(tmp_path / "fp64", precision={"dtype": "fp64"}, **steps)
    assembly = build_assembly(fp64, init_runtime(fp64))
    params = [p for m in assembly.modules for p in m.parameters()]
    assert params and all(p.dtype == torch.float64 for p in params)
    # ZeRO masters are views of the fp64 parameter buffer (AdamW's moments follow them)
    masters = [g for group in assembly.optimizer.param_groups for g in group["params"]]
    assert masters and all(m.dtype == torch.float64 for m in masters)

    losses64 = train(fp64).train_losses
    losses32 = train(tiny_config(tmp_path / "fp32", **steps)).train_losses
    assert sorted(losses64) == sorted(losses32) == [0, 1, 2]
    np.testing.assert_allclose(
        [losses64[s] for s in (0, 1, 2)], [losses32[s] for s in (0, 1, 2)], rtol=1e-4
    )


def test_concurrent_meta_writers_do_not_collide(tmp_path):
    """Every rank of a fresh torchrun job may write the same dataset's side file at once:
    concurrent writers all succeed, the file reads back whole, no temporary file is left."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from shardwork.trainer.data.dataset_meta import DatasetMeta, write_dataset_meta

    prefix = tmp_path / "shared_data"
    meta = DatasetMeta(tokenizer="byte", vocab_size=257, eod_id=256)
    start = threading.Barrier(8)

    def writer(_):
        start.wait()
        for _ in range(50):
            write_dataset_meta(prefix, meta)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(writer, range(8)))  # re-raises a writer's exception
    assert read_dataset_meta(prefix) == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared_data.meta.json"]
