"""Bad configs and bad files fail early, clearly, and without side effects.

- ``test_bad_config``: a table of bad configurations (impossible layouts, missing datasets,
  unreadable data configs, out-of-range optimizer and schedule values, ...) validated
  in-process by ``shardwork.trainer``'s ``validate_config`` (through ``tiny_config``): each
  raises ``ConfigError`` (a ValueError) whose single problem line names the field and the bad
  value, and the working directory is left byte-for-byte unchanged (no run dir created).
- ``test_bad_checkpoint``: resuming from a directory that holds no complete checkpoint, and
  from a committed checkpoint whose data file was truncated, stop with a message naming the
  path and the problem; the bad checkpoint is neither deleted nor modified and no new
  checkpoint is written.
- ``test_cli_reports_bad_input``: three of the table's cases through ``python -m
  shardwork.trainer`` (the ``shardwork-train`` entry point): exit status 2, the message on
  stderr, no traceback.
- ``test_cli_reports_corrupt_checkpoint``: the truncated checkpoint through the CLI: non-zero
  exit (4), one paragraph naming the checkpoint and the file, no traceback, nothing written or
  deleted (the trainer resumes before it writes the run directory).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (id, world size, sections, substrings the message must contain). "{d}" in a string value
# becomes the test's scratch directory.
CASES = [
    ("tp-exceeds-world", 2, {"parallel": {"tp": 4}}, ["parallel", "world size 2"]),
    ("pp-not-dividing", 2, {"parallel": {"pp": 3}}, ["parallel", "world size 2"]),
    ("layout-too-big", 2, {"parallel": {"tp": 2, "pp": 2}}, ["parallel", "world size 2"]),
    ("heads-vs-tp", 8, {"parallel": {"tp": 8}}, ["num_attention_heads=4", "tp=8"]),
    ("seq-vs-cp", 2, {"parallel": {"cp": 2}, "data": {"seq_length": 30}}, ["seq_length=30"]),
    ("sp-without-tp", 1, {"parallel": {"sequence_parallel": True}}, ["sequence_parallel"]),
    ("layers-vs-vpp", 2, {"parallel": {"pp": 2, "vpp": 2}}, ["num_layers=2"]),
    (
        "experts-vs-ep",
        3,
        {
            "model": {"preset": "tiny-mixtral-8x7b"},
            "parallel": {"ep": 3},
            "schedule": {"global_batch_size": 12},
        },
        ["num_experts=8", "ep=3"],
    ),
    ("timeout-zero", 1, {"parallel": {"timeout_minutes": 0}}, ["parallel.timeout_minutes=0"]),
    ("nccl-on-cpu", 1, {"parallel": {"backend": "nccl"}}, ["parallel.backend='nccl'", "CUDA"]),
    ("unknown-preset", 1, {"model": {"preset": "llama9-1t"}}, ["model.preset='llama9-1t'"]),
    ("unknown-override", 1, {"model": {"overrides": {"no_such_field": 1}}}, ["no_such_field"]),
    ("lr-zero", 1, {"optimizer": {"lr": 0.0}}, ["optimizer.lr=0.0"]),
    ("min-lr-above-lr", 1, {"optimizer": {"min_lr": 1.0}}, ["optimizer.min_lr=1.0"]),
    ("negative-wd", 1, {"optimizer": {"weight_decay": -0.1}}, ["optimizer.weight_decay=-0.1"]),
    ("beta1-one", 1, {"optimizer": {"beta1": 1.0}}, ["optimizer.beta1=1.0"]),
    ("eps-zero", 1, {"optimizer": {"eps": 0.0}}, ["optimizer.eps=0.0"]),
    ("clip-negative", 1, {"optimizer": {"clip_grad": -1.0}}, ["optimizer.clip_grad=-1.0"]),
    (
        "wd-schedule-no-end",
        1,
        {"optimizer": {"weight_decay_schedule": "linear"}},
        ["weight_decay_schedule='linear'", "weight_decay_end"],
    ),
    ("zero-steps", 1, {"schedule": {"train_steps": 0}}, ["schedule.train_steps=0"]),
    (
        "batch-not-multiple",
        2,
        {"schedule": {"global_batch_size": 6}},
        ["schedule.global_batch_size=6", "4 × 2"],
    ),
    ("warmup-too-long", 1, {"schedule": {"warmup_steps": 100}}, ["schedule.warmup_steps=100"]),
    ("decay-before-warmup", 1, {"schedule": {"lr_decay_steps": 2}}, ["lr_decay_steps=2"]),
    (
        "ramp-decreasing",
        1,
        {"schedule": {"batch_size_ramp": [(5, 8), (3, 16)]}},
        ["batch_size_ramp[1]"],
    ),
    (
        "interleaved-no-vpp",
        1,
        {"schedule": {"pipeline_schedule": "interleaved"}},
        ["pipeline_schedule='interleaved'"],
    ),
    ("1f1b-no-pp", 1, {"schedule": {"pipeline_schedule": "1f1b"}}, ["pipeline_schedule='1f1b'"]),
    ("missing-dataset", 1, {"data": {"prefixes": ["{d}/no/such"]}}, ["{d}/no/such", ".bin"]),
    (
        "weights-mismatch",
        1,
        {"data": {"prefixes": ["{d}/x"], "weights": [1.0, 2.0]}},
        ["data.weights has 2 entries"],
    ),
    ("unknown-corpus", 1, {"data": {"corpus": "wikipedia"}}, ["data.corpus='wikipedia'"]),
    ("no-data", 1, {"data": {"corpus": None}}, ["no data"]),
    ("split-two-parts", 1, {"data": {"split": "90,10"}}, ["data.split='90,10'"]),
    ("split-no-valid", 1, {"data": {"split": "100,0,0"}}, ["data.split='100,0,0'", "evaluation"]),
    ("missing-tokenizer", 1, {"data": {"tokenizer": "{d}/tok.json"}}, ["data.tokenizer="]),
    (
        "data-config-not-json",
        1,
        {"data": {"data_config": "{d}/bad.json"}},
        ["data.data_config=", "not valid JSON"],
    ),
    (
        "resume-missing",
        1,
        {"checkpoint": {"resume": "{d}/ckpt/step_000000009"}},
        ["checkpoint.resume="],
    ),
    ("ckpt-interval-zero", 1, {"checkpoint": {"interval": 0}}, ["checkpoint.interval=0"]),
    ("keep-last-zero", 1, {"checkpoint": {"keep_last": 0}}, ["checkpoint.keep_last=0"]),
    ("eval-steps-zero", 1, {"eval": {"steps": 0}}, ["eval.steps=0"]),
    ("seed-negative", 1, {"seed": -1}, ["seed=-1"]),
    # the byte tokenizer has 257 ids: an embedding of 100 rows could not look them up
    ("vocab-smaller-than-tokenizer", 1, {"model": {"vocab_size": 100}}, ["model.vocab_size=100"]),
    (
        "tokenizer-not-a-tokenizer",
        1,
        {"data": {"tokenizer": "{d}/garbage-tokenizer.json"}},
        ["data.tokenizer=", "not a readable Hugging Face tokenizer JSON"],
    ),
    # a dataset preprocessed with a BPE tokenizer, trained with the byte tokenizer
    (
        "tokenizer-mismatch",
        1,
        {"data": {"prefixes": ["{d}/bpe_data"]}},
        ["data.prefixes[0]=", "was tokenized with", "data.tokenizer='byte' has vocab 257"],
    ),
]


def _fill(value, scratch: Path):
    if isinstance(value, str):
        return value.replace("{d}", str(scratch))
    if isinstance(value, dict):
        return {k: _fill(v, scratch) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, scratch) for v in value]
    return value


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def scratch(tmp_path, corpus_cache, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", corpus_cache)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "garbage-tokenizer.json").write_text('{"model": ')
    _write_bpe_dataset(tmp_path)
    return tmp_path


def _write_bpe_dataset(root: Path) -> None:
    """``root/bpe_data`` tokenized with a small BPE tokenizer trained here (not the byte one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from shardwork.trainer.data.preprocess import write_documents
    from shardwork.trainer.data.tokenizer import load_tokenizer

    docs = ["the cat sat on the mat", "the dog sat on the log"] * 8
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(
        docs, trainers.BpeTrainer(vocab_size=40, special_tokens=["[UNK]", "</s>"])
    )
    bpe.save(str(root / "bpe.json"))
    write_documents(docs, root / "bpe_data", load_tokenizer(str(root / "bpe.json")))


def _check(scratch: Path, world: int, sections: dict, needles: list[str]) -> str:
    from shardwork.trainer.config.load import ConfigError
    from shardwork.trainer.testing import tiny_config

    before = _snapshot(scratch)
    run_dir = scratch / "run"
    with pytest.raises(ConfigError) as info:
        tiny_config(run_dir, world_size=world, **_fill(sections, scratch))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    problems = info.value.problems
    # one line per problem (a consequence of the first may be listed too), no traceback
    assert 1 <= len(problems) <= 2 and all("\n" not in p for p in problems), message
    assert "Traceback" not in message
    for needle in needles:
        assert _fill(needle, scratch) in message, message
    assert not run_dir.exists() and _snapshot(scratch) == before  # nothing written or deleted
    return message


@pytest.mark.parametrize(
    ("world", "sections", "needles"), [pytest.param(*c[1:], id=c[0]) for c in CASES]
)
def test_bad_config(scratch, world, sections, needles):
    _check(scratch, world, sections, needles)


QUICK = {
    "schedule": {"train_steps": 2, "warmup_steps": 1},
    "eval": {"interval": None, "at_end": False},
}


def _resume_fails(scratch: Path, path: Path, needles: list[str], error: type) -> None:
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    before = _snapshot(path)
    run = scratch / "resumed"
    config = tiny_config(run, **QUICK, checkpoint={"resume": str(path)})
    with pytest.raises(error) as info:
        train(config, stream=io.StringIO())
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert _snapshot(path) == before  # the bad checkpoint is kept as it was
    assert not run.exists()  # resuming fails before the run directory is written


def test_resume_from_a_directory_without_checkpoint(scratch):
    junk = scratch / "junk" / "step_000000002"
    junk.mkdir(parents=True)
    (junk / "weights.bin").write_bytes(os.urandom(64))
    _resume_fails(scratch, junk, [str(junk), "no complete checkpoint"], ValueError)


@pytest.fixture
def truncated_checkpoint(scratch) -> tuple[Path, Path]:
    """A committed checkpoint (2 tiny steps) whose largest data file was cut to 100 bytes:
    ``(checkpoint directory, truncated file)``."""
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    good = train(
        tiny_config(scratch / "a", **QUICK, checkpoint={"save_at_end": True}),
        stream=io.StringIO(),
    )
    ckpt = Path(good.checkpoint)
    big = max((p for p in ckpt.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[:100])
    return ckpt, big


def test_resume_from_a_truncated_checkpoint(scratch, truncated_checkpoint):
    from shardwork.dist_checkpoint import CheckpointCorruptError

    ckpt, big = truncated_checkpoint
    _resume_fails(scratch, ckpt, [str(ckpt), big.name, "100 bytes"], CheckpointCorruptError)


CLI_CASES = ["tp-exceeds-world", "missing-dataset", "lr-zero"]


def _cli_args(sections: dict) -> list[str]:
    args = []
    for section, values in sections.items():
        for field, value in values.items():
            args += [
                f"--{section}.{field}",
                *(map(str, value) if isinstance(value, list) else [str(value)]),
            ]
    return args


def _run_cli(scratch: Path, args: list[str], world: int = 1) -> subprocess.CompletedProcess:
    """``python -m shardwork.trainer *args`` as rank 0 of ``world``, in ``scratch``."""
    env = dict(os.environ, WORLD_SIZE=str(world), RANK="0")
    return subprocess.run(
        [sys.executable, "-m", "shardwork.trainer", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=scratch,
    )


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_reports_bad_input(scratch, case):
    _, world, sections, needles = next(c for c in CASES if c[0] == case)
    sections = _fill(sections, scratch)
    before = _snapshot(scratch)
    proc = _run_cli(
        scratch, ["--logging.run_dir", str(scratch / "run"), *_cli_args(sections)], world
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("shardwork-train: invalid configuration")
    for needle in needles:
        assert _fill(needle, scratch) in proc.stderr
    assert not (scratch / "run").exists() and _snapshot(scratch) == before


def test_cli_reports_corrupt_checkpoint(scratch, truncated_checkpoint):
    """Resuming from a truncated checkpoint through the CLI: non-zero exit, one paragraph
    naming the checkpoint and its bad file, no traceback, nothing written or deleted."""
    from shardwork.trainer.config.load import config_to_toml
    from shardwork.trainer.testing import tiny_config

    ckpt, big = truncated_checkpoint
    run = scratch / "resumed"
    config = tiny_config(run, **QUICK, checkpoint={"resume": str(ckpt)})
    (scratch / "resume.toml").write_text(config_to_toml(config))
    before = _snapshot(scratch)
    proc = _run_cli(scratch, ["--config", str(scratch / "resume.toml")])
    assert proc.returncode == 4, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    message = proc.stderr.strip()
    assert message.startswith("shardwork-train:") and "\n\n" not in message, message
    for needle in (str(ckpt), big.name, "100 bytes"):
        assert needle in message, message
    assert not run.exists() and _snapshot(scratch) == before  # nothing written or deleted
