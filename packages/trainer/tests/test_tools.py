"""shardwork-preprocess (text, JSONL, HF tokenizer), shardwork-plot, metrics files, and a few
shardwork-train command-line cases through a real subprocess."""

import json
import subprocess
import sys

import numpy as np
import pytest

from shardwork.trainer.data.indexed import IndexedDataset
from shardwork.trainer.data.preprocess import main as preprocess_main
from shardwork.trainer.observe.metrics import MetricsWriter, read_metrics
from shardwork.trainer.observe.plot import main as plot_main


def test_preprocess_jsonl_with_byte_tokenizer(tmp_path):
    docs = ["héllo world", "second\ndocument", "x"]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"body": d}) for d in docs) + "\n\n")
    assert (
        preprocess_main(
            ["--input", str(src), "--output", str(tmp_path / "o"), "--json_key", "body"]
        )
        == 0
    )
    ds = IndexedDataset(tmp_path / "o")
    assert len(ds) == 3
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], [*d.encode("utf-8"), 256])


def test_preprocess_says_when_it_replaces_a_dataset(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "first"}) + "\n")
    out = ["--input", str(src), "--output", str(tmp_path / "o")]
    assert preprocess_main(out) == 0
    assert "replaced" not in capsys.readouterr().out
    src.write_text(json.dumps({"text": "second, longer"}) + "\n")
    assert preprocess_main(out) == 0
    assert capsys.readouterr().out.rstrip().endswith("; it replaced the dataset that was there")
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "o")[0], [*b"second, longer", 256])


def test_preprocess_text_split_and_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    text = "the cat sat on the mat.\n\nthe dog sat on the log.\n\n" * 20
    src = tmp_path / "in.txt"
    src.write_text(text)
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(src)], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"]))
    tok_path = tmp_path / "tok.json"
    tok.save(str(tok_path))
    args = [
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o"),
        "--tokenizer",
        str(tok_path),
        "--doc_separator",
        "\n\n",
    ]
    assert preprocess_main(args) == 0
    ds = IndexedDataset(tmp_path / "o")
    assert len(ds) == 40
    eod = tok.token_to_id("</s>")
    want = [*tok.encode("the cat sat on the mat.", add_special_tokens=False).ids, eod]
    np.testing.assert_array_equal(ds[0], want)


def test_metrics_and_plots(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write("event", 0, {"bigram_nats": 2.4})
    for step in range(1, 6):
        writer.write(
            "train",
            step,
            {
                "loss": 5.0 - step,
                "lr": 0.1,
                "grad_norm": 1.0,
                "tokens_per_s": 100.0,
                "load_balancing_loss": 0.01,
                "expert_load": [[0.5, 0.5], [0.25, 0.75]],
            },
        )
    writer.write("valid", 5, {"loss": float("nan")})
    writer.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 7 and records[-1]["loss"] == "nan"
    assert plot_main([str(tmp_path)]) == 0
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {
        "loss.png",
        "lr.png",
        "grad_norm.png",
        "throughput.png",
        "aux_losses.png",
        "expert_load.png",
    } <= names
    assert plot_main([str(tmp_path / "nothing")]) == 2


def _cli(*args, env_extra=None, cwd=None):
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "shardwork.trainer", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def test_cli_rejects_bad_config_before_starting(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nlr = -1.0\n[parallel]\ntp = 3\n")
    out = _cli(
        "--config",
        str(bad),
        "--schedule.train_steps",
        "0",
        env_extra={"SHARDWORK_CACHE": str(tmp_path)},
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "optimizer.lr=-1.0: must be > 0" in out.stderr
    assert "schedule.train_steps=0: must be an integer >= 1" in out.stderr
    assert (
        "num_attention_heads=4 is not divisible by tp=3" in out.stderr or "tp*cp*pp" in out.stderr
    )
    assert not (tmp_path / "runs").exists()


def test_cli_names_bad_shardwork_variables_before_starting(tmp_path):
    """The variables the run would read at its first step or first save are checked with the
    configuration: one line each (variable, value, valid values), exit 2, no traceback."""
    out = _cli(
        "--schedule.train_steps",
        "2",
        env_extra={
            "SHARDWORK_CACHE": str(tmp_path),
            "SHARDWORK_KERNEL_BACKEND": "cuda",
            "SHARDWORK_CPU_GEMM": "blas",
            "SHARDWORK_CKPT_FAULT": "mid_save",
        },
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    problems = [line for line in out.stderr.splitlines() if line.startswith("  - environment: ")]
    assert problems == [
        "  - environment: SHARDWORK_KERNEL_BACKEND='cuda' is not a backend; valid: auto, torch, "
        "triton, te (unset: auto)",
        "  - environment: SHARDWORK_CPU_GEMM='blas' is not a choice; valid: auto, mkl, onednn "
        "(unset: auto)",
        "  - environment: SHARDWORK_CKPT_FAULT='mid_save' is not valid; valid: "
        "'<point>[@<rank>][:raise]' with point in ('before_data', 'mid_file', 'before_metadata', "
        "'before_commit')",
    ]
    assert not (tmp_path / "runs").exists()


def test_cli_print_config_is_loadable_toml(tmp_path):
    import tomllib

    out = _cli(
        "--print-config",
        "--optimizer.lr",
        "3e-4",
        "--eval.at_end",
        "false",
        env_extra={"SHARDWORK_CACHE": str(tmp_path)},
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    table = tomllib.loads(out.stdout)
    assert table["optimizer"]["lr"] == 3e-4 and table["eval"]["at_end"] is False
    assert table["model"]["num_layers"] == 4 and table["model"]["vocab_size"] == 257
    assert not (tmp_path / "runs").exists()
