"""The catalogue of user mistakes: each ends with one paragraph, a documented exit code, no
traceback, and nothing left behind that a later run would misread.

One :class:`Case` per mistake (``CASES``): which CLI (``train``, ``generate``, ``preprocess``,
``ckpt``), its arguments, the world size announced to it, the expected exit code, the
fragments the message must contain, and a setup that writes the files the case needs into its
scratch directory. Every case runs in-process through the CLI's ``main`` function (so the
catalogue shares one interpreter and its imports), with the scratch directory as the working
directory, and checks:

- the exit code (docs/trainer.md "Exit codes and messages"; ``shardwork-ckpt``: 1 corrupt, 2 not
  a complete checkpoint or a usage error);
- stderr starts with the CLI's name (or ``CORRUPT:``), holds every fragment, is one paragraph
  (no blank line) and holds no ``Traceback``;
- for a configuration error, at most two problems are listed (a consequence of the first may
  be listed too);
- the scratch directory is byte-for-byte as the setup left it: no run directory, no checkpoint
  directory, no partial dataset, no deleted or modified input.

``test_no_traceback_reaches_the_terminal`` runs a few cases as real processes (what a user's
terminal shows), and ``test_torchrun_ends_with_the_message`` a layout mistake under torchrun.
To add a case, append a row to ``CASES`` (``config_case`` builds a train row from config
sections, on the tiny model of ``shardwork.trainer.testing``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

EXIT_USAGE, EXIT_CHECKPOINT, EXIT_DATA = 2, 4, 5
CKPT_CORRUPT, CKPT_NOT_COMPLETE = 1, 2
PROGS = {
    "train": "shardwork-train",
    "generate": "shardwork-generate",
    "preprocess": "shardwork-preprocess",
    "ckpt": "shardwork-ckpt",
    "plan": "shardwork-plan",
}
MODULES = {
    "train": "shardwork.trainer",
    "generate": "shardwork.trainer.generate",
    "preprocess": "shardwork.trainer.data.preprocess",
    "ckpt": "shardwork.dist_checkpoint.cli",
    "plan": "shardwork.trainer.plan.cli",
}
QUICK = {"schedule": {"train_steps": 2, "warmup_steps": 1}, "eval": {"interval": None}}


@dataclass(frozen=True)
class Case:
    """One user mistake and what the CLI must answer. ``{d}`` in an argument or a fragment is
    the scratch directory; ``setup(scratch, trained)`` writes the case's files (``trained``: a
    committed checkpoint directory of a 2-step tiny run, built once for the module)."""

    id: str
    cli: str
    argv: tuple[str, ...]
    code: int
    needles: tuple[str, ...]
    setup: Callable[[Path, Path | None], None] | None = None
    world: int = 1
    needs_checkpoint: bool = False
    starts_with: str | None = None
    """What stderr starts with; None: the CLI's name and a colon."""
    max_problems: int | None = None
    """Configuration errors: at most this many listed problems."""
    env: tuple[tuple[str, str | None], ...] = ()
    """Launcher variables set (None: unset) over the torchrun-like ones of `prepared`."""


def _fill(value, scratch: Path):
    if isinstance(value, str):
        return value.replace("{d}", str(scratch))
    if isinstance(value, dict):
        return {k: _fill(v, scratch) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_fill(v, scratch) for v in value]
    return "none" if value is None else value


def _write_config(name: str, sections: dict) -> Callable[[Path, Path | None], None]:
    """A setup writing ``scratch/name``: the tiny test config with ``sections`` merged in (a
    model section naming a preset replaces the tiny model), writing under ``scratch/run``."""

    def setup(scratch: Path, trained: Path | None) -> None:
        from shardwork.trainer.config.load import config_from_dict, config_to_toml
        from shardwork.trainer.testing import TINY_SECTIONS

        merged = {k: dict(v) for k, v in TINY_SECTIONS.items()}
        merged["logging"]["run_dir"] = str(scratch / "run")
        merged["checkpoint"]["dir"] = str(scratch / "run" / "checkpoints")
        for key, values in _fill(sections, scratch).items():
            if key == "model" and "preset" in values:
                merged["model"] = values
            elif isinstance(values, dict):
                merged.setdefault(key, {}).update(values)
            else:
                merged[key] = values
        (scratch / name).write_text(config_to_toml(config_from_dict(merged)))

    return setup


def config_case(id, world, sections, needles, *, code=EXIT_USAGE, setup=None, **kw) -> Case:
    """A ``shardwork-train --config`` row for the tiny config with ``sections`` merged in."""
    write = _write_config(f"{id}.toml", sections)

    def both(scratch: Path, trained: Path | None) -> None:
        if setup is not None:
            setup(scratch, trained)
        write(scratch, trained)

    max_problems = kw.pop("max_problems", 2 if code == EXIT_USAGE else None)
    return Case(
        id, "train", ("--config", f"{{d}}/{id}.toml"), code, tuple(needles), both, world,
        max_problems=max_problems, **kw,
    )  # fmt: skip


# ---- setups: the files a case needs ---------------------------------------------------------


def _write_text(name: str, text: str):
    def setup(scratch: Path, trained: Path | None) -> None:
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_text(text)

    return setup


def _byte_dataset(
    scratch: Path, name: str = "data", *, docs: int = 40, wide_doc: int | None = None
):
    """``scratch/name``: ``docs`` random documents of byte ids (document ``wide_doc``, if given,
    holds ids up to 999: written without a tokenizer record, as a foreign dataset would be)."""
    from shardwork.trainer.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(17)
    with IndexedDatasetWriter(scratch / name) as writer:
        for i in range(docs):
            high = 1000 if i == wide_doc else 256
            writer.add_document(rng.integers(1, high, size=int(rng.integers(150, 400))))
    return scratch / name


def _truncated(suffix: str, size: int):
    def setup(scratch: Path, trained: Path | None) -> None:
        path = Path(str(_byte_dataset(scratch)) + suffix)
        path.write_bytes(path.read_bytes()[:size])

    return setup


def _garbage_index(scratch: Path, trained: Path | None) -> None:
    _byte_dataset(scratch)
    (scratch / "data.idx").write_bytes(os.urandom(200))


def _wide_ids(scratch: Path, trained: Path | None) -> None:
    _byte_dataset(scratch, wide_doc=13)


def _plain_dataset(scratch: Path, trained: Path | None) -> None:
    _byte_dataset(scratch)


def _data_config_missing_prefix(scratch: Path, trained: Path | None) -> None:
    _byte_dataset(scratch)
    blend = {"train": [[1.0, str(scratch / "data")]], "valid": [[1.0, str(scratch / "gone")]]}
    (scratch / "blend.json").write_text(json.dumps(blend))


def _weightless_train_blend(scratch: Path, trained: Path | None) -> None:
    _byte_dataset(scratch)
    blend = {"train": [[0, str(scratch / "data")]], "valid": [[1.0, str(scratch / "data")]]}
    (scratch / "blend.json").write_text(json.dumps(blend))


def _train_only_blend(scratch: Path, trained: Path | None) -> None:
    _byte_dataset(scratch)
    (scratch / "blend.json").write_text(json.dumps({"train": [[1.0, str(scratch / "data")]]}))


def _empty_dataset(scratch: Path, trained: Path | None) -> None:
    _byte_dataset(scratch, "empty", docs=0)


def _binary_config(scratch: Path, trained: Path | None) -> None:
    (scratch / "binary.toml").write_bytes(bytes(range(0xB0, 0xF0)))


def _bpe_dataset(scratch: Path, trained: Path | None) -> None:
    """``scratch/bpe_data`` tokenized with a small BPE tokenizer trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from shardwork.trainer.data.preprocess import write_documents
    from shardwork.trainer.data.tokenizer import load_tokenizer

    docs = ["the cat sat on the mat", "the dog sat on the log"] * 8
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(
        docs, trainers.BpeTrainer(vocab_size=40, special_tokens=["[UNK]", "</s>"])
    )
    bpe.save(str(scratch / "bpe.json"))
    write_documents(docs, scratch / "bpe_data", load_tokenizer(str(scratch / "bpe.json")))


def _junk_step(scratch: Path, trained: Path | None) -> None:
    junk = scratch / "junk" / "step_000000002"
    junk.mkdir(parents=True)
    (junk / "weights.bin").write_bytes(os.urandom(64))


def _copied_checkpoint(scratch: Path, trained: Path | None) -> Path:
    target = scratch / "ckpt" / trained.name
    shutil.copytree(trained, target)
    return target


def _renamed_checkpoint(scratch: Path, trained: Path | None) -> None:
    """An intact copy of the trained checkpoint under a name that is not ``step_<N>``."""
    shutil.copytree(trained, scratch / "best")


def _run_directory(scratch: Path, trained: Path | None) -> None:
    """A run directory: the checkpoints sit in its ``checkpoints`` folder."""
    shutil.copytree(trained, scratch / "run1" / "checkpoints" / trained.name)


def _truncated_checkpoint(scratch: Path, trained: Path | None) -> None:
    """A copy of the trained checkpoint whose largest data file is cut to 100 bytes."""
    ckpt = _copied_checkpoint(scratch, trained)
    big = max((p for p in ckpt.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[:100])
    (scratch / "truncated-name").write_text(big.name)


def _broken_metadata(scratch: Path, trained: Path | None) -> None:
    """A copy of the trained checkpoint whose metadata file is cut mid-JSON."""
    ckpt = _copied_checkpoint(scratch, trained)
    info = ckpt / "shardwork.json"
    info.write_text(info.read_text()[:40])


def _flipped_byte_checkpoint(scratch: Path, trained: Path | None) -> None:
    """A copy of the trained checkpoint with one flipped byte in its largest data file."""
    ckpt = _copied_checkpoint(scratch, trained)
    big = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    big.write_bytes(bytes(raw))
    (scratch / "truncated-name").write_text(big.name)


def _hostile_checkpoint(scratch: Path, trained: Path | None) -> None:
    """A copy whose DCP metadata would run ``touch`` when unpickled, with every recorded
    checksum updated to match (as whoever wrote it could); the marker must never appear."""
    from shardwork.dist_checkpoint.hostile import RunsCommand, rewrite_metadata

    ckpt = _copied_checkpoint(scratch, trained)
    command = RunsCommand(f"touch {scratch / 'pwned'}")
    rewrite_metadata(ckpt, lambda metadata: metadata.planner_data.update(planted=command))


def _newer_format_checkpoint(scratch: Path, trained: Path | None) -> None:
    """A copy that claims a format version this shardwork does not know."""
    from shardwork.dist_checkpoint.hostile import write_info

    ckpt = _copied_checkpoint(scratch, trained)
    info = json.loads((ckpt / "shardwork.json").read_text())
    info["format_version"] = 99
    write_info(ckpt, info)


def _hf_folder(with_weights: bool, config_text: str):
    def setup(scratch: Path, trained: Path | None) -> None:
        folder = scratch / "hf"
        folder.mkdir()
        (folder / "config.json").write_text(config_text)
        if with_weights:
            (folder / "model.safetensors").write_bytes(os.urandom(64))

    return setup


def _empty_documents(scratch: Path, trained: Path | None) -> None:
    """``scratch/empty``: 40 documents of no tokens (text preprocessed with --no_append_eod
    from empty lines)."""
    from shardwork.trainer.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(scratch / "empty") as writer:
        for _ in range(40):
            writer.add_document(np.array([], dtype=np.int64))


# A small Llama config.json: validation reads it before the weights.
LLAMA_CONFIG = json.dumps(
    {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
     "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
     "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128,
     "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
)  # fmt: skip


def _jsonl(lines: list[str]):
    return _write_text("docs.jsonl", "\n".join(lines) + "\n")


GOOD = json.dumps({"text": "a first document"})

PLAN = ("--model", "llama3-8b", "--gpus", "64", "--global_batch", "128", "--seq_length", "4096")


def _two_config_files(scratch: Path, trained: Path | None) -> None:
    """``a.toml`` and ``b.toml``: two valid config files (argparse used to keep the last)."""
    (scratch / "a.toml").write_text("[schedule]\ntrain_steps = 3\n")
    (scratch / "b.toml").write_text("[optimizer]\nlr = 0.001\n")


def _plan_bad_json(scratch: Path, trained: Path | None) -> None:
    (scratch / "hf").mkdir()
    (scratch / "hf" / "config.json").write_text('{"model_type": "llama", ')


CASES: list[Case] = [
    # ---- configuration values and types (shardwork-train --config FILE) ----
    config_case("tp-exceeds-world", 2, {"parallel": {"tp": 4}}, ["parallel", "world size 2"]),
    config_case("pp-not-dividing", 2, {"parallel": {"pp": 3}}, ["parallel", "world size 2"]),
    config_case("layout-too-big", 2, {"parallel": {"tp": 2, "pp": 2}}, ["world size 2"]),
    config_case("heads-vs-tp", 8, {"parallel": {"tp": 8}}, ["num_attention_heads=4", "tp=8"]),
    config_case(
        "seq-vs-cp", 2, {"parallel": {"cp": 2}, "data": {"seq_length": 30}}, ["seq_length=30"]
    ),
    config_case(
        "sp-without-tp", 1, {"parallel": {"sequence_parallel": True}}, ["sequence_parallel"]
    ),
    config_case("layers-vs-vpp", 2, {"parallel": {"pp": 2, "vpp": 2}}, ["num_layers=2"]),
    config_case(
        "virtual-stage-split",
        2,
        {"parallel": {"pp": 2, "vpp": 2, "first_virtual_stage_layers": 1}},
        ["first_virtual_stage_layers=1", "3 other virtual stages"],
    ),
    config_case(
        "interleaved-micro-batches",
        2,
        {
            "model": {"num_layers": 4},
            "parallel": {"pp": 2, "vpp": 2},
            "schedule": {"micro_batch_size": 8},
        },
        ["schedule.global_batch_size=8", "multiple of parallel.pp=2"],
    ),
    config_case(
        "ramp-vs-interleaved-micro-batches",
        2,
        {
            "model": {"num_layers": 4},
            "parallel": {"pp": 2, "vpp": 2},
            "schedule": {"micro_batch_size": 2, "batch_size_ramp": [[2, 6]]},
        },
        ["schedule.batch_size_ramp[0]=(2, 6)", "3 micro-batches", "parallel.pp=2", "of 4"],
    ),
    config_case(
        "fsdp-with-overlap-grad-reduce",
        2,
        {"parallel": {"fsdp": "full"}, "optimizer": {"overlap_grad_reduce": True}},
        ["parallel.fsdp='full'", "optimizer.overlap_grad_reduce=true", "would be ignored"],
    ),
    config_case(
        "experts-vs-ep",
        3,
        {
            "model": {"preset": "tiny-mixtral-8x7b"},
            "parallel": {"ep": 3},
            "schedule": {"global_batch_size": 12},
        },
        ["num_experts=8", "ep=3"],
    ),
    config_case(
        "eod-token-with-byte-tokenizer",
        1,
        {"data": {"eod_token": "</s>"}},
        ["data.eod_token='</s>'", "data.tokenizer='byte' has a fixed end-of-document id"],
    ),
    config_case(
        "nan-weight-decay",
        1,
        {"optimizer": {"weight_decay": float("nan")}},
        ["optimizer.weight_decay=nan: must be a finite number"],
    ),
    config_case(
        "infinite-timeout",
        1,
        {"parallel": {"timeout_minutes": float("inf")}},
        ["parallel.timeout_minutes=inf: must be a finite number"],
    ),
    config_case(
        "negative-loss-scale",
        1,
        {"precision": {"initial_loss_scale": -1.0}},
        ["precision.initial_loss_scale=-1.0: must be > 0"],
    ),
    config_case(
        "zero-peak-tflops",
        1,
        {"logging": {"peak_tflops": 0.0}},
        ["logging.peak_tflops=0.0: must be > 0"],
    ),
    config_case(
        "logging-name-empty",
        1,
        {"logging": {"name": ""}},
        ["logging.name='': must be one folder name"],
    ),
    config_case(
        "logging-name-leaves-runs",
        1,
        {"logging": {"name": "../escaped"}},
        ["logging.name='../escaped': must be one folder name", "no '/'"],
    ),
    config_case(
        "peft-init-without-lora",
        1,
        {"peft": {"init": "{d}/adapters"}},
        ["peft.init='{d}/adapters' needs peft.method='lora'"],
    ),
    Case(
        "config-typos-in-and-out-of-the-model-table",
        "train",
        ("--config", "{d}/typos.toml"),
        EXIT_USAGE,
        (
            "optimizer.lrr: unknown key",
            "model.num_layer: unknown key",
            "model.moe.num_expertz: unknown key",
        ),
        _write_text(
            "typos.toml",
            "[optimizer]\nlrr = 0.1\n[model]\nnum_layer = 2\n[model.moe]\nnum_expertz = 4\n",
        ),
        max_problems=3,
    ),
    Case(
        "config-is-a-directory",
        "train",
        ("--config", "{d}"),
        EXIT_USAGE,
        ("--config='{d}': is a directory; valid: a TOML file",),
    ),
    config_case(
        "experts-on-a-dense-model",
        2,
        {"parallel": {"ep": 2}, "schedule": {"micro_batch_size": 8}},
        ["parallel.ep=2", "expert parallelism needs a model with experts"],
    ),
    Case(
        "config-not-utf8",
        "train",
        ("--config", "{d}/binary.toml"),
        EXIT_USAGE,
        ("--config='{d}/binary.toml': not UTF-8 text, so not a TOML file",),
        _binary_config,
    ),
    config_case(
        "order-not-a-permutation",
        1,
        {"parallel": {"order": "tp-dp"}},
        ["parallel.order='tp-dp'", "exactly once", "missing ['cp', 'ep', 'pp']"],
    ),
    config_case(
        "order-repeats-an-axis",
        1,
        {"parallel": {"order": "tp-cp-ep-dp-tp"}},
        ["parallel.order='tp-cp-ep-dp-tp'", "repeated ['tp']", "missing ['pp']"],
    ),
    config_case("timeout-zero", 1, {"parallel": {"timeout_minutes": 0}}, ["timeout_minutes=0"]),
    config_case("nccl-on-cpu", 1, {"parallel": {"backend": "nccl"}}, ["backend='nccl'", "CUDA"]),
    config_case("unknown-preset", 1, {"model": {"preset": "llama9-1t"}}, ["preset='llama9-1t'"]),
    config_case(
        "unknown-model-key",
        1,
        {"model": {"rotary_base": 500000}},
        ["model.rotary_base: unknown key", "rope_theta"],
    ),
    config_case("lr-zero", 1, {"optimizer": {"lr": 0.0}}, ["optimizer.lr=0.0"]),
    config_case("min-lr-above-lr", 1, {"optimizer": {"min_lr": 1.0}}, ["optimizer.min_lr=1.0"]),
    config_case("negative-wd", 1, {"optimizer": {"weight_decay": -0.1}}, ["weight_decay=-0.1"]),
    config_case("beta1-one", 1, {"optimizer": {"beta1": 1.0}}, ["optimizer.beta1=1.0"]),
    config_case("eps-zero", 1, {"optimizer": {"eps": 0.0}}, ["optimizer.eps=0.0"]),
    config_case("clip-negative", 1, {"optimizer": {"clip_grad": -1.0}}, ["clip_grad=-1.0"]),
    config_case(
        "wd-schedule-no-end",
        1,
        {"optimizer": {"weight_decay_schedule": "linear"}},
        ["weight_decay_schedule='linear'", "weight_decay_end"],
    ),
    config_case("zero-steps", 1, {"schedule": {"train_steps": 0}}, ["schedule.train_steps=0"]),
    config_case(
        "batch-not-multiple",
        2,
        {"schedule": {"global_batch_size": 6}},
        ["schedule.global_batch_size=6", "4 × 2"],
    ),
    config_case("warmup-too-long", 1, {"schedule": {"warmup_steps": 100}}, ["warmup_steps=100"]),
    config_case(
        "decay-before-warmup", 1, {"schedule": {"lr_decay_steps": 2}}, ["lr_decay_steps=2"]
    ),
    config_case(
        "ramp-decreasing",
        1,
        {"schedule": {"batch_size_ramp": [(5, 8), (3, 16)]}},
        ["batch_size_ramp[1]"],
    ),
    config_case(
        "interleaved-no-vpp",
        1,
        {"schedule": {"pipeline_schedule": "interleaved"}},
        ["pipeline_schedule='interleaved'"],
    ),
    config_case("1f1b-no-pp", 1, {"schedule": {"pipeline_schedule": "1f1b"}}, ["'1f1b'"]),
    config_case(
        "1f1b-with-vpp",
        2,
        {
            "model": {"num_layers": 4},
            "parallel": {"pp": 2, "vpp": 2},
            "schedule": {"pipeline_schedule": "1f1b"},
        },
        ["schedule.pipeline_schedule='1f1b' with parallel.vpp=2", "'interleaved'"],
    ),
    config_case("ckpt-interval-zero", 1, {"checkpoint": {"interval": 0}}, ["interval=0"]),
    config_case("keep-last-zero", 1, {"checkpoint": {"keep_last": 0}}, ["keep_last=0"]),
    config_case("eval-steps-zero", 1, {"eval": {"steps": 0}}, ["eval.steps=0"]),
    config_case("seed-negative", 1, {"seed": -1}, ["seed=-1"]),
    # the byte tokenizer has 257 ids: an embedding of 100 rows could not look them up
    config_case("vocab-below-tokenizer", 1, {"model": {"vocab_size": 100}}, ["vocab_size=100"]),
    # ---- the command line and the config file themselves ----
    Case(
        "flag-wrong-type",
        "train",
        ("--schedule.train_steps", "ten"),
        EXIT_USAGE,
        ("--schedule.train_steps", "ten"),
        starts_with="",
    ),
    Case(
        "flag-misspelt",
        "train",
        ("--schedule.trian_steps", "5"),
        EXIT_USAGE,
        ("--schedule.trian_steps",),
        starts_with="",
    ),
    Case(
        "model-flag-misspelt",
        "train",
        ("--model.preset", "tiny-mixtral-8x7b", "--model.moe.router.top_kk", "3"),
        EXIT_USAGE,
        ("model.moe.router.top_kk: unknown key", "[model.moe.router] (RouterConfig)", "top_k"),
    ),
    Case(
        "model-flag-without-value",
        "train",
        ("--model.num_layers",),
        EXIT_USAGE,
        ("--model.num_layers: needs a value",),
    ),
    Case(
        "config-file-missing",
        "train",
        ("--config", "{d}/nothing.toml"),
        EXIT_USAGE,
        ("--config='{d}/nothing.toml'", "no such file"),
    ),
    Case(
        "config-not-toml",
        "train",
        ("--config", "{d}/c.toml"),
        EXIT_USAGE,
        ("--config='{d}/c.toml'", "not valid TOML"),
        _write_text("c.toml", "[schedule\ntrain_steps = 3\n"),
    ),
    Case(
        "config-value-wrong-type",
        "train",
        ("--config", "{d}/c.toml"),
        EXIT_USAGE,
        ("schedule.train_steps='ten'", "invalid type", "valid: int"),
        _write_text("c.toml", '[schedule]\ntrain_steps = "ten"\n'),
    ),
    Case(
        "config-unknown-key",
        "train",
        ("--config", "{d}/c.toml"),
        EXIT_USAGE,
        ("schedule.trian_steps: unknown key", "train_steps"),
        _write_text("c.toml", "[schedule]\ntrian_steps = 3\n"),
    ),
    # two files were not merged: the first was dropped without a word
    Case(
        "config-given-twice",
        "train",
        ("--config", "{d}/a.toml", "--config", "{d}/b.toml"),
        EXIT_USAGE,
        ("--config is given 2 times", "'{d}/a.toml', '{d}/b.toml'", "one --config FILE.toml"),
        _two_config_files,
    ),
    # ---- directories the run writes (preflight) ----
    config_case(
        "checkpoint-dir-is-a-file",
        1,
        {"checkpoint": {"dir": "{d}/ckfile"}},
        ["checkpoint.dir='{d}/ckfile'", "is a file, not a directory"],
        setup=_write_text("ckfile", "not a directory\n"),
    ),
    config_case(
        "run-dir-under-a-file",
        1,
        {"logging": {"run_dir": "{d}/ckfile/run"}, "checkpoint": {"dir": "{d}/ck"}},
        ["logging.run_dir='{d}/ckfile/run'", "would be created under {d}/ckfile, a file"],
        setup=_write_text("ckfile", "not a directory\n"),
    ),
    # /sys is read-only even for root (a chmod-ed directory is not)
    config_case(
        "checkpoint-dir-read-only",
        1,
        {"checkpoint": {"dir": "/sys/shardwork-checkpoints"}},
        ["checkpoint.dir='/sys/shardwork-checkpoints'", "cannot write there"],
    ),
    config_case(
        "corpus-cache-read-only",
        1,
        {"data": {"cache_dir": "/sys/shardwork-cache"}},
        ["data.cache_dir='/sys/shardwork-cache'", "cannot write there"],
    ),
    # ---- the launcher's environment ----
    config_case(
        "env-world-size-not-a-number",
        1,
        {},
        ["environment: WORLD_SIZE='abc' is not valid", "an integer >= 1", "torchrun"],
        env=(("WORLD_SIZE", "abc"),),
    ),
    config_case(
        "env-world-without-rank",
        2,
        {},
        ["environment: WORLD_SIZE=2 but RANK is not set", "torchrun"],
        env=(("RANK", None),),
    ),
    config_case(
        "env-rank-outside-the-world",
        2,
        {},
        ["environment: RANK=3 is not valid for WORLD_SIZE=2; valid: 0..1"],
        env=(("RANK", "3"),),
    ),
    config_case(
        "env-master-port-not-a-port",
        2,
        {},
        ["environment: MASTER_PORT='abc' is not valid; valid: a TCP port, 1..65535"],
        env=(("MASTER_PORT", "abc"),),
    ),
    config_case(
        "env-no-master-addr",
        2,
        {},
        ["environment: MASTER_ADDR is not set"],
        env=(("MASTER_ADDR", None),),
    ),
    # ---- data files ----
    config_case(
        "data-documents-all-empty",
        1,
        {"data": {"prefixes": ["{d}/empty"]}},
        ["dataset '{d}/empty'", "'train' split", "holds 0 tokens", "at least 2"],
        code=EXIT_DATA,
        setup=_empty_documents,
    ),
    config_case(
        "missing-dataset", 1, {"data": {"prefixes": ["{d}/no/such"]}}, ["{d}/no/such", ".bin"]
    ),
    config_case(
        "weights-mismatch",
        1,
        {"data": {"prefixes": ["{d}/x"], "weights": [1.0, 2.0]}},
        ["data.weights has 2 entries"],
    ),
    config_case("unknown-corpus", 1, {"data": {"corpus": "wikipedia"}}, ["corpus='wikipedia'"]),
    config_case("no-data", 1, {"data": {"corpus": None}}, ["no data"]),
    config_case("split-two-parts", 1, {"data": {"split": "90,10"}}, ["data.split='90,10'"]),
    config_case("split-no-valid", 1, {"data": {"split": "100,0,0"}}, ["100,0,0", "evaluation"]),
    config_case("missing-tokenizer", 1, {"data": {"tokenizer": "{d}/tok.json"}}, ["tokenizer="]),
    config_case(
        "tokenizer-not-a-tokenizer",
        1,
        {"data": {"tokenizer": "{d}/tok.json"}},
        ["data.tokenizer=", "not a readable Hugging Face tokenizer JSON"],
        setup=_write_text("tok.json", '{"model": '),
    ),
    config_case(
        "tokenizer-mismatch",
        1,
        {"data": {"prefixes": ["{d}/bpe_data"]}},
        ["data.prefixes[0]=", "was tokenized with", "data.tokenizer='byte' has vocab 257"],
        setup=_bpe_dataset,
    ),
    config_case(
        "data-config-not-json",
        1,
        {"data": {"data_config": "{d}/bad.json"}},
        ["data.data_config=", "not valid JSON"],
        setup=_write_text("bad.json", "{not json"),
    ),
    config_case(
        "data-config-blend-not-a-list",
        1,
        {"data": {"data_config": "{d}/blend.json"}},
        ["data.data_config=", "valid: 'x' is a JSON str", "a list of [weight, prefix] pairs"],
        setup=_write_text("blend.json", '{"train": [[1.0, "data"]], "valid": "x"}'),
    ),
    config_case(
        "data-bin-truncated",
        1,
        {"data": {"prefixes": ["{d}/data"]}},
        ["data.prefixes[0]=", "{d}/data.bin is 1000 bytes", "{d}/data.idx points to", "truncated"],
        code=EXIT_DATA,
        setup=_truncated(".bin", 1000),
    ),
    config_case(
        "data-idx-truncated",
        1,
        {"data": {"prefixes": ["{d}/data"]}},
        ["{d}/data.idx is 300 bytes", "40 sequences", "truncated"],
        code=EXIT_DATA,
        setup=_truncated(".idx", 300),
    ),
    config_case(
        "data-idx-not-an-index",
        1,
        {"data": {"prefixes": ["{d}/data"]}},
        ["{d}/data.idx is not an MMIDIDX index"],
        code=EXIT_DATA,
        setup=_garbage_index,
    ),
    config_case(
        "data-ids-past-vocab",
        1,
        {"data": {"prefixes": ["{d}/data"]}},
        ["{d}/data.bin holds token id", "in document 13", "vocabulary has 257 ids"],
        code=EXIT_DATA,
        setup=_wide_ids,
    ),
    config_case(
        "data-config-prefix-missing",
        1,
        {"data": {"data_config": "{d}/blend.json"}},
        [
            "data.data_config='{d}/blend.json'",
            "'valid' blend names '{d}/gone'",
            "shardwork-preprocess",
        ],
        setup=_data_config_missing_prefix,
    ),
    config_case(
        "train-blend-weighs-nothing",
        1,
        {"data": {"data_config": "{d}/blend.json"}},
        ["the 'train' blend of data.data_config='{d}/blend.json'", "docs, weight 0", "weight > 0"],
        code=EXIT_DATA,
        setup=_weightless_train_blend,
    ),
    # the remedy named data.split, which a data config ignores
    config_case(
        "data-config-without-valid-blend",
        1,
        {"data": {"data_config": "{d}/blend.json"}},
        [
            "eval.steps=1",
            "the \"valid\" blend of data.data_config='{d}/blend.json'",
            "eval.interval='none'",
        ],
        setup=_train_only_blend,
    ),
    config_case(
        "empty-dataset",
        1,
        {"data": {"prefixes": ["{d}/empty"]}},
        ["data.prefixes=['{d}/empty']", "gives the train split no documents"],
        code=EXIT_DATA,
        setup=_empty_dataset,
    ),
    config_case(
        "eval-steps-beyond-validation-split",
        1,
        {"data": {"prefixes": ["{d}/data"], "split": "90,10,0"}, "eval": {"steps": 50}},
        ["eval.steps=50", "the validation split holds", "valid: 1.."],
        setup=_plain_dataset,
    ),
    # ---- checkpoints and resume ----
    config_case(
        "resume-missing",
        1,
        {"checkpoint": {"resume": "{d}/ckpt/step_000000009"}},
        ["checkpoint.resume="],
    ),
    config_case(
        "resume-without-checkpoint",
        1,
        {**QUICK, "checkpoint": {"resume": "{d}/junk/step_000000002"}},
        ["cannot resume", "{d}/junk/step_000000002", "no complete checkpoint"],
        code=EXIT_CHECKPOINT,
        setup=_junk_step,
    ),
    config_case(
        "resume-truncated-checkpoint",
        1,
        {**QUICK, "checkpoint": {"resume": "{d}/ckpt/step_000000002"}},
        ["cannot resume", "{d}/ckpt/step_000000002", "{truncated}", "100 bytes"],
        code=EXIT_CHECKPOINT,
        setup=_truncated_checkpoint,
        needs_checkpoint=True,
    ),
    # ---- Hugging Face folders ----
    config_case(
        "hf-init-missing",
        1,
        {"checkpoint": {"hf_init": "{d}/hf"}},
        ["checkpoint.hf_init='{d}/hf'", "no such directory"],
    ),
    config_case(
        "hf-init-no-weights",
        1,
        {"checkpoint": {"hf_init": "{d}/hf"}},
        ["checkpoint.hf_init='{d}/hf'", "not a Hugging Face checkpoint folder"],
        setup=_hf_folder(False, "{}"),
    ),
    config_case(
        "hf-init-config-not-json",
        1,
        {"checkpoint": {"hf_init": "{d}/hf"}},
        ["checkpoint.hf_init='{d}/hf'", "its config.json cannot be imported"],
        setup=_hf_folder(True, "{not json"),
    ),
    config_case(
        "hf-init-weights-not-safetensors",
        1,
        {"checkpoint": {"hf_init": "{d}/hf"}},
        ["checkpoint.hf_init='{d}/hf'", "model.safetensors is not a readable safetensors file"],
        setup=_hf_folder(True, LLAMA_CONFIG),
    ),
    config_case(
        "hf-export-not-empty",
        1,
        {"checkpoint": {"hf_export": "{d}/out"}},
        ["checkpoint.hf_export='{d}/out'", "not an empty directory"],
        setup=_write_text("out/file.txt", "x"),
    ),
    config_case(
        "resume-flipped-byte-explicit-path",
        1,
        {**QUICK, "checkpoint": {"resume": "{d}/ckpt/step_000000002"}},
        ["cannot resume", "{d}/ckpt/step_000000002", "{truncated}: checksum mismatch"],
        code=EXIT_CHECKPOINT,
        setup=_flipped_byte_checkpoint,
        needs_checkpoint=True,
    ),
    config_case(
        "resume-hostile-checkpoint",
        1,
        {**QUICK, "checkpoint": {"resume": "{d}/ckpt/step_000000002"}},
        ["cannot resume", "refused to decode DCP metadata", "posix.system"],
        code=EXIT_CHECKPOINT,
        setup=_hostile_checkpoint,
        needs_checkpoint=True,
    ),
    config_case(
        "resume-newer-format",
        1,
        {**QUICK, "checkpoint": {"resume": "{d}/ckpt/step_000000002"}},
        ["cannot resume", "format_version=99", "valid: [1, 2]"],
        code=EXIT_CHECKPOINT,
        setup=_newer_format_checkpoint,
        needs_checkpoint=True,
    ),
    config_case(
        "resume-other-model-width",
        1,
        {
            **QUICK,
            "model": {"hidden_size": 48, "ffn_hidden_size": 96},
            "checkpoint": {"resume": "{d}/ckpt/step_000000002"},
        },
        ["cannot resume", "with another shape or kind", "--model.hidden_size"],
        code=EXIT_CHECKPOINT,
        setup=_copied_checkpoint,
        needs_checkpoint=True,
    ),
    config_case(
        "resume-with-another-optimizer",
        1,
        {
            **QUICK,
            "optimizer": {"name": "muon"},
            "checkpoint": {"resume": "{d}/ckpt/step_000000002"},
        },
        [
            "cannot resume",
            "optimizer.name='adamw' (this run: 'muon')",
            "--checkpoint.load_optimizer false",
        ],
        code=EXIT_CHECKPOINT,
        setup=_copied_checkpoint,
        needs_checkpoint=True,
    ),
    # ---- shardwork-generate ----
    Case(
        "generate-max-new-tokens-negative",
        "generate",
        ("{d}/ckpt", "--max_new_tokens", "-5"),
        EXIT_USAGE,
        ("--max_new_tokens=-5", ">= 1"),
        needs_checkpoint=True,
        setup=_copied_checkpoint,
    ),
    Case(
        "generate-temperature-negative",
        "generate",
        ("{d}/ckpt", "--temperature", "-1"),
        EXIT_USAGE,
        ("--temperature=-1.0", ">= 0", "greedy"),
        needs_checkpoint=True,
        setup=_copied_checkpoint,
    ),
    Case(
        "generate-top-k-negative",
        "generate",
        ("{d}/ckpt", "--top_k", "-3"),
        EXIT_USAGE,
        ("--top_k=-3", ">= 0"),
        needs_checkpoint=True,
        setup=_copied_checkpoint,
    ),
    Case(
        "generate-checkpoint-missing",
        "generate",
        ("{d}/nowhere",),
        EXIT_USAGE,
        ("CHECKPOINT='{d}/nowhere'", "no such directory"),
    ),
    # an hf_export folder was "no complete checkpoint", with no word of what it is
    Case(
        "generate-hugging-face-folder",
        "generate",
        ("{d}/hf",),
        EXIT_CHECKPOINT,
        ("CHECKPOINT='{d}/hf'", "a Hugging Face model folder", "--checkpoint.hf_init '{d}/hf'"),
        _hf_folder(True, LLAMA_CONFIG),
    ),
    Case(
        "generate-no-complete-checkpoint",
        "generate",
        ("{d}/junk",),
        EXIT_CHECKPOINT,
        ("CHECKPOINT='{d}/junk'", "no complete checkpoint"),
        _junk_step,
    ),
    Case(
        "generate-renamed-checkpoint",
        "generate",
        ("{d}/best",),
        EXIT_CHECKPOINT,
        ("CHECKPOINT='{d}/best': it is a complete checkpoint", "named step_<N>"),
        _renamed_checkpoint,
        needs_checkpoint=True,
    ),
    Case(
        "generate-run-directory",
        "generate",
        ("{d}/run1",),
        EXIT_CHECKPOINT,
        ("CHECKPOINT='{d}/run1': it looks like a run directory: pass '{d}/run1/checkpoints'",),
        _run_directory,
        needs_checkpoint=True,
    ),
    Case(
        "generate-truncated-checkpoint",
        "generate",
        ("{d}/ckpt",),
        EXIT_CHECKPOINT,
        ("{truncated}", "100 bytes"),
        _truncated_checkpoint,
        needs_checkpoint=True,
    ),
    Case(
        "generate-hostile-checkpoint",
        "generate",
        ("{d}/ckpt",),
        EXIT_CHECKPOINT,
        ("refused to decode DCP metadata", "posix.system"),
        _hostile_checkpoint,
        needs_checkpoint=True,
    ),
    # ---- shardwork-preprocess ----
    Case(
        "preprocess-broken-jsonl-line",
        "preprocess",
        ("--input", "{d}/docs.jsonl", "--output", "{d}/out"),
        EXIT_DATA,
        ("{d}/docs.jsonl:3:", "not valid JSON"),
        _jsonl([GOOD, GOOD, '{"text": "cut here']),
    ),
    Case(
        "preprocess-jsonl-missing-key",
        "preprocess",
        ("--input", "{d}/docs.jsonl", "--output", "{d}/out"),
        EXIT_DATA,
        ("{d}/docs.jsonl:2:", "--json_key='text'", "['body']"),
        _jsonl([GOOD, json.dumps({"body": "no text key"})]),
    ),
    Case(
        "preprocess-input-not-utf8",
        "preprocess",
        ("--input", "{d}/docs.txt", "--output", "{d}/out"),
        EXIT_DATA,
        ("{d}/docs.txt:1: not UTF-8 text", "byte 0xff at column 4"),
        lambda scratch, trained: (scratch / "docs.txt").write_bytes(b"ok \xff\xfe\x00 text"),
    ),
    Case(
        "preprocess-input-missing",
        "preprocess",
        ("--input", "{d}/none.jsonl", "--output", "{d}/out"),
        EXIT_USAGE,
        ("--input '{d}/none.jsonl'", "no such file"),
    ),
    Case(
        "preprocess-tokenizer-unreadable",
        "preprocess",
        ("--input", "{d}/docs.jsonl", "--output", "{d}/out", "--tokenizer", "{d}/tok.json"),
        EXIT_USAGE,
        ("--tokenizer='{d}/tok.json'",),
        _write_text("tok.json", '{"model": '),
    ),
    # ---- shardwork-ckpt ----
    Case(
        "ckpt-inspect-missing",
        "ckpt",
        ("inspect", "{d}/nowhere"),
        CKPT_NOT_COMPLETE,
        ("'{d}/nowhere' is not a directory",),
    ),
    Case(
        "ckpt-root-without-complete-checkpoint",
        "ckpt",
        ("inspect", "{d}/junk"),
        CKPT_NOT_COMPLETE,
        ("'{d}/junk' holds no complete checkpoint",),
        _junk_step,
    ),
    Case(
        "ckpt-metadata-not-json",
        "ckpt",
        ("inspect", "{d}/ckpt/step_000000002"),
        CKPT_CORRUPT,
        # the commit marker records shardwork.json's CRC, so the cut file fails that first
        ("shardwork.json: checksum mismatch", "recorded", "in COMMITTED"),
        _broken_metadata,
        needs_checkpoint=True,
        starts_with="CORRUPT: ",
    ),
    Case(
        "ckpt-verify-hostile",
        "ckpt",
        ("verify", "{d}/ckpt/step_000000002"),
        CKPT_CORRUPT,
        ("refused to decode DCP metadata", "posix.system"),
        _hostile_checkpoint,
        needs_checkpoint=True,
        starts_with="CORRUPT: ",
    ),
    Case(
        "ckpt-verify-truncated",
        "ckpt",
        ("verify", "{d}/ckpt/step_000000002"),
        CKPT_CORRUPT,
        ("{truncated}",),
        _truncated_checkpoint,
        needs_checkpoint=True,
        starts_with="CORRUPT: ",
    ),
    # ---- shardwork-plan ----
    Case(
        "plan-unknown-gpu",
        "plan",
        (*PLAN, "--gpu", "b300"),
        EXIT_USAGE,
        ("--gpu='b300'", "unknown GPU", "h100-sxm"),
    ),
    Case(
        "plan-batch-not-divisible-by-dp",
        "plan",
        (*PLAN, "--dp", "16", "--global_batch", "100"),
        EXIT_USAGE,
        ("--global_batch=100 is not divisible by --dp=16",),
    ),
    Case(
        "plan-experts-on-a-dense-model",
        "plan",
        (*PLAN, "--ep", "8"),
        EXIT_USAGE,
        ("--ep=8: expert parallelism needs an MoE model", "is dense"),
    ),
    Case(
        "plan-tp-past-the-heads",
        "plan",
        (*PLAN, "--tp", "64"),
        EXIT_USAGE,
        ("--tp=64: tensor parallelism splits the", "attention heads", "valid: a divisor of"),
    ),
    Case(
        "plan-unknown-preset",
        "plan",
        ("--model", "llama9-1t", *PLAN[2:]),
        EXIT_USAGE,
        ("--model='llama9-1t'", "neither a preset nor a readable config.json", "llama3-8b"),
    ),
    Case(
        "plan-unreadable-config-json",
        "plan",
        ("--model", "{d}/hf/config.json", *PLAN[2:]),
        EXIT_USAGE,
        ("cannot read {d}/hf/config.json as JSON",),
        setup=_plan_bad_json,
    ),
]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under ``root``."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")
    }


def _main(cli: str):
    if cli == "train":
        from shardwork.trainer.cli import train_main

        return train_main
    if cli == "generate":
        from shardwork.trainer.generate import main

        return main
    if cli == "preprocess":
        from shardwork.trainer.data.preprocess import main

        return main
    if cli == "plan":
        from shardwork.trainer.plan.cli import main

        return main
    from shardwork.dist_checkpoint.cli import main

    return main


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_cache) -> Path:
    """A committed checkpoint (``step_000000002``) of a 2-step tiny run, built once."""
    import io

    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    os.environ.setdefault("SHARDWORK_CACHE", corpus_cache)
    run = tmp_path_factory.mktemp("trained") / "run"
    config = tiny_config(
        run, **QUICK, checkpoint={"save_at_end": True}, data={"cache_dir": corpus_cache}
    )
    return Path(train(config, stream=io.StringIO()).checkpoint)


@pytest.fixture
def prepared(request, tmp_path, corpus_cache, monkeypatch):
    """``prepare(case) -> (scratch, argv, needles)``: the case's files written, its world size
    announced, the scratch directory as working directory."""

    def prepare(case: Case):
        monkeypatch.setenv("SHARDWORK_CACHE", corpus_cache)
        # what torchrun gives rank 0 (no process group is ever created by these cases)
        launcher = dict(WORLD_SIZE=str(case.world), RANK="0", LOCAL_RANK="0",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # fmt: skip
        for name, value in [*launcher.items(), *case.env]:
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        for name in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.chdir(tmp_path)
        ckpt = request.getfixturevalue("trained") if case.needs_checkpoint else None
        if case.setup is not None:
            case.setup(tmp_path, ckpt)
        needles = [_fill(n, tmp_path) for n in case.needles]
        if (tmp_path / "truncated-name").exists():
            name = (tmp_path / "truncated-name").read_text()
            needles = [n.replace("{truncated}", name) for n in needles]
        return tmp_path, [_fill(a, tmp_path) for a in case.argv], needles

    return prepare


def _check_message(case: Case, code: int, err: str, needles: list[str]) -> None:
    assert code == case.code, f"exit {code}, expected {case.code}:\n{err}"
    assert "Traceback" not in err, err
    message = err.strip()
    starts = f"{PROGS[case.cli]}: " if case.starts_with is None else case.starts_with
    assert message.startswith(starts), message
    if starts:  # one paragraph (tyro's own usage errors draw a box instead)
        assert "\n\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"
    if case.max_problems is not None:
        problems = [line for line in message.splitlines() if line.startswith("  - ")]
        assert 1 <= len(problems) <= case.max_problems, message


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mistake(case: Case, prepared, capsys):
    scratch, argv, needles = prepared(case)
    capsys.readouterr()
    before = _snapshot(scratch)
    try:
        code = _main(case.cli)(argv)
    except SystemExit as exc:  # argument parsers exit themselves on a usage error
        code = exc.code
    err = capsys.readouterr().err
    _check_message(case, code, err, needles)
    assert _snapshot(scratch) == before  # nothing written, deleted or left half-written


def test_catalogue_ids_are_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


SUBPROCESS_CASES = ["data-bin-truncated", "preprocess-broken-jsonl-line"]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_no_traceback_reaches_the_terminal(case_id, prepared):
    """What a terminal shows: the case as its own process (``python -m ...``)."""
    case = next(c for c in CASES if c.id == case_id)
    scratch, argv, needles = prepared(case)
    before = _snapshot(scratch)
    proc = subprocess.run(
        [sys.executable, "-m", MODULES[case.cli], *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=scratch,
        env=dict(os.environ),
    )
    _check_message(case, proc.returncode, proc.stderr, needles)
    assert proc.stdout == ""
    assert _snapshot(scratch) == before


def test_torchrun_ends_with_the_message(tmp_path, corpus_cache):
    """A layout that does not fit 2 ranks under torchrun: every rank stops before any process
    group exists; torchrun prints its own ChildFailedError traceback and summary and exits 1,
    a rank's entry shows exit code 2, and the summary's last entry (the root cause's error
    file) is our message, naming the field; no traceback frame comes from shardwork's code."""
    env = dict(os.environ, SHARDWORK_CACHE=corpus_cache, OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"):
        env.pop(name, None)
    argv = ["--parallel.tp", "4", "--logging.run_dir", str(tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "shardwork.trainer", *argv],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert not re.search(r'File "[^"]*shardwork[/\\]', out), out
    # The root cause is the failure with the earliest error-file timestamp (whole seconds): a
    # rank that wrote its message and was stopped by torchrun while exiting (-15) may be it.
    assert "exitcode  : 2" in out, out
    root_cause = out[out.index("Root Cause") :]
    assert "shardwork-train: invalid configuration" in root_cause, out
    assert "parallel: " in root_cause and "world size 2" in root_cause, out
    assert not (tmp_path / "run").exists()
