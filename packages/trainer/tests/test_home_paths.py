"""A leading ``~`` in a path setting is the home directory, for validation and for the run.

A TOML file is read by no shell, so ``checkpoint.dir = "~/runs/x"`` reaches the trainer with
its ``~``; validation expands it (config/paths.py), and the run, its stored config and the
checkpoints then name ``$HOME/runs/x``, never a ``./~`` folder in the working directory. HOME is
a temporary folder here, and the expected paths are built from it with pathlib, not with
``expanduser``.
"""

import dataclasses
import io
import json
import shutil
from pathlib import Path

import pytest

from shardwork.models import GPTConfig, GPTModel, LoRAConfig
from shardwork.models.full_state import full_state_dict
from shardwork.models.hf import (
    export_peft,
    gpt_config_from_hf,
    import_peft,
    read_hf_config,
    save_pretrained,
)
from shardwork.models.lora import apply_lora, is_lora_key
from shardwork.trainer.config.load import ConfigError, load_config
from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.config.validate import validate_config
from shardwork.trainer.data.preprocess import write_documents
from shardwork.trainer.data.tokenizer import ByteTokenizer, load_tokenizer
from shardwork.trainer.inference import load_for_inference
from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config

DOCS = [f"document {i}: the cat sat on the mat, the dog sat on the log." for i in range(60)]
MEGATRON = Path(__file__).parents[2] / "models/tests/data/megatron/llama_w1_te"
SHORT = {
    "schedule": {"train_steps": 1, "warmup_steps": 1},
    "eval": {"interval": None, "at_end": False},
}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fake $HOME, and an empty working directory beside it (where a literal '~' would go)."""
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path / "cwd")
    return home


def _no_tilde_in_cwd() -> None:
    assert not [p for p in Path.cwd().rglob("*") if p.name.startswith("~")]


def test_a_run_given_home_paths_writes_under_home_and_resumes_from_there(home):
    config = tiny_config(
        "~/runs/x",
        **SHORT,
        checkpoint={"dir": "~/ckpt", "save_at_end": True},
        data={"cache_dir": "~/cache"},
    )
    run_dir, ckpt = home / "runs" / "x", home / "ckpt"
    assert (config.logging.run_dir, config.checkpoint.dir) == (str(run_dir), str(ckpt))
    assert config.data.cache_dir == str(home / "cache")
    # the keywords and names beside the paths stay as given
    assert (config.checkpoint.resume, config.data.tokenizer) == ("none", "byte")
    assert (config.data.corpus, config.logging.name) == ("pydoc", "demo")
    result = train(config, stream=io.StringIO())
    assert result.final_step == 1 and result.checkpoint == str(ckpt / "step_000000001")
    assert (ckpt / "step_000000001").is_dir()
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1]
    assert list((home / "cache").glob("pydoc-*-byte.bin"))  # the corpus, built there
    stored = load_config(run_dir / "config.toml")  # the run's record names the real folders
    assert (stored.logging.run_dir, stored.checkpoint.dir) == (str(run_dir), str(ckpt))
    _, generate_config, _ = load_for_inference(str(ckpt))  # what shardwork-generate reads
    assert generate_config.checkpoint.dir == str(ckpt)
    # a path to resume from, given with '~', is the checkpoint just written
    again = tiny_config(
        "~/runs/y",
        schedule={"train_steps": 2, "warmup_steps": 1},
        eval=SHORT["eval"],
        checkpoint={"dir": "~/ckpt2", "resume": "~/ckpt/step_000000001"},
        data={"cache_dir": "~/cache"},
    )
    assert again.checkpoint.resume == str(ckpt / "step_000000001")
    auto = tiny_config("~/runs/z", **SHORT, checkpoint={"dir": "~/ckpt", "resume": "auto"})
    assert (auto.checkpoint.resume, auto.checkpoint.dir) == ("auto", str(ckpt))
    assert train(again, stream=io.StringIO()).start_step == 1
    _no_tilde_in_cwd()


def _lora_home(home: Path) -> dict:
    """Under ``home``: a Hugging Face model, a PEFT adapter folder for it, a BPE tokenizer and a
    dataset built with it; returns the [peft] options the adapter folder holds."""
    tokenizers = pytest.importorskip("tokenizers")
    model = GPTModel(
        GPTConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=64,
            vocab_size=260,
            max_position_embeddings=64,
            init_seed=7,
        )
    ).eval()
    save_pretrained(model, home / "hf")
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("linear_qkv", "fc2"))
    apply_lora(model, lora)
    export_peft(full_state_dict(model, keys=is_lora_key), lora, model.config, home / "adapter")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=50, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(home / "bpe.json"))
    write_documents(DOCS, home / "data" / "bpe", load_tokenizer(str(home / "bpe.json")))
    _, found = import_peft(home / "adapter", gpt_config_from_hf(read_hf_config(home / "hf")))
    options = ("rank", "alpha", "use_rslora", "target_modules")
    return {"method": "lora", **{name: getattr(found, name) for name in options}}


def test_every_path_setting_of_a_hugging_face_lora_run_is_read_from_home(home):
    lora = _lora_home(home)
    config = tiny_config(
        "~/runs/lora",
        **SHORT,
        data={"prefixes": ["~/data/bpe"], "tokenizer": "~/bpe.json", "cache_dir": "~/cache"},
        checkpoint={"hf_init": "~/hf", "hf_export": "~/export"},
        peft={**lora, "init": "~/adapter", "export": "~/adapter-out"},
    )
    assert config.data.prefixes == [str(home / "data" / "bpe")]
    assert config.data.tokenizer == str(home / "bpe.json")
    assert config.data.cache_dir == str(home / "cache")
    assert config.checkpoint.hf_init == str(home / "hf")
    assert config.checkpoint.hf_export == str(home / "export")
    assert config.peft.init == str(home / "adapter")
    assert config.peft.export == str(home / "adapter-out")
    assert config.logging.run_dir == str(home / "runs" / "lora")
    assert config.checkpoint.dir == str(home / "runs" / "lora" / "checkpoints")


def test_a_megatron_start_and_a_data_config_are_read_from_home(home):
    shutil.copytree(MEGATRON, home / "megatron")
    write_documents(DOCS, home / "data" / "byte", ByteTokenizer())
    prefix = str(home / "data" / "byte")
    blend = {"train": [[1.0, prefix]], "valid": [[1.0, prefix]]}
    (home / "blend.json").write_text(json.dumps(blend))
    model = {"preset": "tiny-llama3-8b", "vocab_size": 260, "ffn_hidden_size": 64}
    config = tiny_config(
        "~/runs/m",
        **SHORT,
        model={**model, "rope_theta": 10000.0},
        data={"data_config": "~/blend.json"},
        checkpoint={"megatron_init": "~/megatron"},
    )
    assert config.checkpoint.megatron_init == str(home / "megatron")
    assert config.data.data_config == str(home / "blend.json")


def test_a_tilde_of_no_user_names_field_value_and_what_is_valid(home):
    bad = "~no-such-user-shardwork/ckpt"
    config = dataclasses.replace(
        TrainConfig(), checkpoint=dataclasses.replace(TrainConfig().checkpoint, dir=bad)
    )
    with pytest.raises(ConfigError) as err:
        validate_config(config, world_size=1)
    (problem,) = err.value.problems
    assert problem == (
        f"checkpoint.dir={bad!r}: cannot expand its leading '~' (there is no user "
        "'no-such-user-shardwork'); valid: a path starting with '~/' (your home directory), "
        "'~USER/' of an existing user, or without '~'"
    )
