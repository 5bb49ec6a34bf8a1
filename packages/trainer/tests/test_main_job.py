"""The README's first command, through the installed scripts in real subprocesses (slow).

``shardwork-train`` with the default config, shortened to 20 steps (the full default, 300
steps, is recorded in docs/trainer.md: validation 1.47 nats/token against the 2.45 bigram
baseline). It must exit 0, print the corpus's bigram-entropy baseline (checked against a
computation from ``pydoc_data`` here), end with a validation loss below the unigram entropy of
the training tokens (20 steps do not reach the bigram baseline: ~2.75 nats), and print where
the metrics, TensorBoard events, plots and checkpoint went, which must exist. Then
``shardwork-generate CHECKPOINT --prompt ...`` prints text that begins with the prompt, the
same text for the same seed (another process) and other text for another seed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SHORT = ["--schedule.train_steps", "20", "--schedule.warmup_steps", "4", "--eval.steps", "4"]
"""The default run, shortened: 20 steps, warmup 4, validation on 4 global batches."""


def _script(name: str) -> str:
    """The console script installed beside this interpreter (as `uv run NAME` finds it)."""
    path = Path(sys.executable).with_name(name)
    assert path.is_file(), f"{name} is not installed next to {sys.executable}"
    return str(path)


def _pydoc_documents() -> list[np.ndarray]:
    """The corpus as the byte tokenizer sees it, built here from ``pydoc_data`` directly: the
    topics in key order, UTF-8 bytes plus end-of-document id 256 each."""
    from pydoc_data.topics import topics

    return [np.array([*topics[k].encode("utf-8"), 256], dtype=np.int64) for k in sorted(topics)]


def _bigram_entropy(tokens: np.ndarray) -> float:
    """``-Σ p(a,b) ln p(b|a)`` over adjacent pairs, from a dense 257 × 257 count table."""
    pairs = np.zeros((257, 257), dtype=np.float64)
    np.add.at(pairs, (tokens[:-1], tokens[1:]), 1.0)
    seen = pairs > 0
    conditional = pairs / pairs.sum(axis=1, keepdims=True).clip(min=1)
    return float(-(pairs[seen] / pairs.sum() * np.log(conditional[seen])).sum())


def _unigram_entropy(tokens: np.ndarray) -> float:
    p = np.bincount(tokens, minlength=257) / tokens.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def _printed(pattern: str, text: str) -> re.Match:
    match = re.search(pattern, text, re.M)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return match


def test_default_run_then_generate(tmp_path, monkeypatch, capsys):
    import torch

    env = {
        **os.environ,
        "SHARDWORK_CACHE": str(tmp_path / "cache"),
        # the same intra-op threads as this process, for the in-process generation below
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    run = subprocess.run(
        [_script("shardwork-train"), *SHORT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text

    documents = _pydoc_documents()
    baseline = float(_printed(r"corpus bigram-entropy baseline: ([\d.]+) nats/token", text)[1])
    assert baseline == pytest.approx(_bigram_entropy(np.concatenate(documents)), abs=1e-4)
    final = _printed(
        r"final validation loss ([\d.]+) nats/token, (below|NOT below) the bigram", text
    )
    loss = float(final[1])
    assert final[2] == ("below" if loss < baseline else "NOT below")
    training_tokens = np.concatenate(documents[: round(0.9 * len(documents))])  # split 90,10,0
    assert loss < _unigram_entropy(training_tokens)  # ~2.75 < 3.27: more than byte frequencies

    metrics = tmp_path / _printed(r"^metrics: +(\S+)$", text)[1]
    assert metrics.is_file()
    from shardwork.trainer.observe.metrics import read_metrics

    valid = [r for r in read_metrics(metrics) if r["kind"] == "valid"]
    assert valid[-1]["step"] == 20 and f"{valid[-1]['loss']:.4f}" == final[1]
    assert (tmp_path / _printed(r"^tensorboard: +(\S+)$", text)[1]).is_dir()
    plots = _printed(r"^plots: +(\S+)/ \(([^)]*)\)$", text)
    for name in plots[2].split(", "):
        assert (tmp_path / plots[1] / name).is_file(), name
    checkpoint = _printed(r"^checkpoint: +(\S+)$", text)[1]
    assert checkpoint.endswith("step_000000020")
    assert (tmp_path / checkpoint / "COMMITTED").is_file()
    assert f"shardwork-generate {checkpoint} --prompt" in text

    args = [checkpoint, "--prompt", "def ", "--max_new_tokens", "40", "--seed", "3"]
    generated = subprocess.run(
        [_script("shardwork-generate"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generated.returncode == 0, generated.stderr
    sample = generated.stdout
    assert sample.startswith("def ") and len(sample.rstrip("\n")) > len("def ")

    from shardwork.trainer.generate import main as generate_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main() sets these; restore afterwards
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", os.environ.get("THP_MEM_ALLOC_ENABLE", "0"))
    capsys.readouterr()
    assert generate_main(args) == 0
    assert capsys.readouterr().out == sample  # same seed, another process: the same text
    assert generate_main([*args[:-1], "4"]) == 0
    other = capsys.readouterr().out
    assert other.startswith("def ") and other != sample  # the seed drives the sampling
