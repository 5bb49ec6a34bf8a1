"""Preflight: directories, free space, dataset consistency and token ranges, eval.steps; the
CLI's ``none`` spelling and the parallel.order check (the CLI-level catalogue of mistakes is
tests-integration/test_bad_input.py)."""

import io
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.data import integrity
from shardwork.trainer.data.indexed import IndexedDataset, IndexedDatasetWriter
from shardwork.trainer.errors import DataError
from shardwork.trainer.run import preflight as pf

FIXTURE = Path(__file__).with_name("fixtures") / "mcore_small"
QUICK = {"schedule": {"train_steps": 2, "warmup_steps": 1}, "eval": {"interval": None}}


@pytest.fixture
def corpus_env(tmp_path_factory, monkeypatch):
    """The built-in corpus preprocessed into a scratch cache (SHARDWORK_CACHE)."""
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.mktemp("cache")))


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_writable_dirs_are_probed_without_leaving_anything(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "existing").mkdir()
    before = _listing(tmp_path)
    assert pf.writable_dir_problem("f", str(tmp_path / "existing")) is None
    assert pf.writable_dir_problem("f", str(tmp_path / "new" / "deeper")) is None
    problem = pf.writable_dir_problem("checkpoint.dir", str(tmp_path / "file"))
    assert problem.startswith(f"checkpoint.dir='{tmp_path / 'file'}': is a file")
    problem = pf.writable_dir_problem("logging.run_dir", str(tmp_path / "file" / "sub"))
    assert f"would be created under {tmp_path / 'file'}, a file" in problem
    problem = pf.writable_dir_problem("logging.run_dir", "/sys/shardwork-probe/run")
    assert "cannot write there (it would be created in /sys)" in problem
    assert _listing(tmp_path) == before  # no probe file, no created directory


def test_megatron_written_dataset_passes(tmp_path):
    ds = IndexedDataset(FIXTURE)
    integrity.check_index(ds)
    largest = max(int(ds[i].max()) for i in range(len(ds)))
    integrity.check_token_range(ds, largest + 1, field="f")
    with pytest.raises(DataError, match=f"token id {largest} "):
        integrity.check_token_range(ds, largest, field="f")


def test_token_range_finds_the_document_across_chunks(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 100, size=int(rng.integers(5, 30))) for _ in range(30)]
    docs[21][7] = 140  # the one id past a vocabulary of 100
    with IndexedDatasetWriter(tmp_path / "d", dtype=np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    monkeypatch.setattr(integrity, "CHUNK_TOKENS", 16)  # many chunks; the id is in a late one
    ds = IndexedDataset(tmp_path / "d")
    position = sum(len(d) for d in docs[:21]) + 7
    assert position > 16
    with pytest.raises(DataError) as info:
        integrity.check_token_range(ds, 100, field="data.prefixes[0]")
    message = str(info.value)
    assert "token id 140 in document 21 (sequence 21, token 7)" in message, message
    assert "vocabulary has 100 ids (valid ids: 0..99)" in message, message
    integrity.check_token_range(ds, 141, field="f")


def test_index_with_wrong_pointers_is_refused(random_dataset, tmp_path):
    prefix, docs = random_dataset
    idx = Path(prefix + ".idx").read_bytes()
    # the pointers follow the 34-byte header and the int32 lengths: swap sequences 3 and 4's
    start = 34 + 4 * len(docs)
    pointers = np.frombuffer(idx, dtype=np.int64, count=len(docs), offset=start).copy()
    pointers[[3, 4]] = pointers[[4, 3]]
    Path(prefix + ".idx").write_bytes(
        idx[:start] + pointers.tobytes() + idx[start + 8 * len(docs) :]
    )
    with pytest.raises(DataError, match=r"\.idx: sequence 3 points to byte"):
        integrity.check_index(IndexedDataset(prefix))


def test_reader_names_a_truncated_or_foreign_file(random_dataset):
    prefix, docs = random_dataset
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    full = bin_path.read_bytes()
    assert len(full) == 2 * sum(len(d) for d in docs)
    bin_path.write_bytes(full[:-2])
    with pytest.raises(DataError, match=f"{bin_path} is {len(full) - 2} bytes but its index"):
        IndexedDataset(prefix)
    bin_path.write_bytes(full)
    idx_path.write_bytes(idx_path.read_bytes()[:20])
    with pytest.raises(DataError, match="is not an MMIDIDX index"):
        IndexedDataset(prefix)
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 1000, 1001)
    idx_path.write_bytes(header)
    with pytest.raises(DataError, match="describes 1000 sequences and 1001 document indices"):
        IndexedDataset(prefix)


def test_checkpoint_estimate_follows_the_saved_size(tmp_path, corpus_env):
    """The per-checkpoint estimate grows like real checkpoints do: between two model widths
    the saved bytes and the estimate differ by the same amount (within the padded vocabulary
    rows, ~4%, that the parameter count leaves out); fixed costs cancel in the difference."""
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    sizes, estimates = [], []
    for width in (32, 64):
        config = tiny_config(
            tmp_path / f"w{width}",
            **QUICK,
            model={"hidden_size": width, "ffn_hidden_size": 2 * width},
            checkpoint={"save_at_end": True},
        )
        ckpt = Path(train(config, stream=io.StringIO()).checkpoint)
        sizes.append(sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()))
        estimates.append(pf.checkpoint_bytes(config))
    ratio = (sizes[1] - sizes[0]) / (estimates[1] - estimates[0])
    assert 0.95 < ratio < 1.10, (sizes, estimates)


def test_free_space_warning(tmp_path, monkeypatch, corpus_env):
    from shardwork.trainer.testing import tiny_config

    config = tiny_config(tmp_path / "run", checkpoint={"keep_last": 3})
    needed = pf.checkpoint_bytes(config) * 4
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda p: usage._replace(free=needed))
    assert pf.free_space_warning(config) is None
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda p: usage._replace(free=needed - 1))
    warning = pf.free_space_warning(config)
    assert warning.startswith(f"warning: checkpoint.dir='{tmp_path / 'run' / 'checkpoints'}'")
    assert "checkpoint.keep_last=3 checkpoints plus the one being written" in warning
    assert pf.preflight(config) == [warning]
    assert not (tmp_path / "run").exists()


def test_a_fresh_start_among_earlier_checkpoints_is_warned(tmp_path, corpus_env):
    """resume='none' in a checkpoint.dir holding committed checkpoints: a warning naming the
    newest; none for an empty dir, an uncommitted step or resume='auto'."""
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    quick = {"schedule": {"train_steps": 2, "warmup_steps": 1}}
    first = tiny_config(tmp_path / "run", **quick, checkpoint={"save_at_end": True})
    assert pf.earlier_checkpoints_warning(first) is None
    train(first, stream=io.StringIO())
    (tmp_path / "run" / "checkpoints" / "step_000000009").mkdir()  # a save that never finished
    warning = pf.earlier_checkpoints_warning(first)
    assert warning.startswith(
        f"warning: checkpoint.dir='{tmp_path / 'run' / 'checkpoints'}' already holds 1 "
        "checkpoint(s) (newest step_000000002)"
    )
    auto = tiny_config(tmp_path / "run", **quick, checkpoint={"resume": "auto"})
    assert pf.earlier_checkpoints_warning(auto) is None


def test_resuming_another_optimizers_checkpoint_is_refused_before_the_run(tmp_path, corpus_env):
    """A checkpoint trained with Muon, resumed by an AdamW run with load_optimizer on: refused in
    preflight (exit 4, both optimizers and the remedy named), whether found by resume='auto',
    named as a step or as a root (its newest step, 4, not 2); allowed without the optimizer
    state, or by a Muon run."""
    from shardwork.trainer.errors import CheckpointError
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    muon = {"name": "muon", "lr": 3e-3, "min_lr": 3e-3, "muon_lr": 0.03}
    schedule = {"train_steps": 4, "warmup_steps": 1}
    saved = tiny_config(
        tmp_path / "run",
        schedule=schedule,
        eval={"interval": None},
        optimizer=muon,
        checkpoint={"interval": 2, "keep_last": 2, "save_at_end": True},
    )
    train(saved, stream=io.StringIO())
    root = tmp_path / "run" / "checkpoints"
    (root / "step_000000009").mkdir()  # a save that never finished is not a candidate
    for resume, step in (("auto", 4), (str(root / "step_000000002"), 2), (str(root), 4)):
        adamw = tiny_config(tmp_path / "run", schedule=schedule, checkpoint={"resume": resume})
        assert pf.resume_candidate(adamw) == root / f"step_00000000{step}"
        with pytest.raises(CheckpointError) as caught:
            pf.check_resume_optimizer(adamw)
        assert caught.value.exit_code == 4
        assert str(caught.value) == (
            f"cannot resume '{root / f'step_00000000{step}'}': the checkpoint was trained with "
            "optimizer.name='muon' (this run: 'adamw'), whose state this run's optimizer cannot "
            "load: to keep its weights and start a fresh optimizer, pass "
            "--checkpoint.load_optimizer false."
        )
    fresh_state = {"resume": "auto", "load_optimizer": False}
    pf.check_resume_optimizer(tiny_config(tmp_path / "run", checkpoint=fresh_state))
    same = tiny_config(tmp_path / "run", optimizer=muon, checkpoint={"resume": "auto"})
    pf.check_resume_optimizer(same)
    afresh = tiny_config(tmp_path / "run", checkpoint={"resume": "none"})
    assert pf.resume_candidate(afresh) is None


def test_eval_steps_against_the_validation_split(tmp_path, corpus_env):
    """The pydoc corpus's validation split at seq_length 32 and global batch 8: the largest
    accepted eval.steps is its sample count // 8, counted here from the documents."""
    from shardwork.trainer.data.builder import split_components
    from shardwork.trainer.data.indexed import IndexedDataset as Reader
    from shardwork.trainer.testing import tiny_config

    config = tiny_config(tmp_path / "run")
    (valid,) = split_components(config.data)["valid"]
    ds = Reader(valid.prefix)
    tokens = sum(len(ds[int(i)]) for i in valid.documents)
    batches = ((tokens - 1) // 32) // 8  # samples of 32 tokens + 1 label, 8 per global batch
    fits = tiny_config(tmp_path / "run", eval={"steps": batches})
    pf.check_eval_steps(fits)
    beyond = tiny_config(tmp_path / "run", eval={"steps": batches + 1})
    with pytest.raises(ConfigError, match=f"eval.steps={batches + 1}: .* valid: 1..{batches},"):
        pf.check_eval_steps(beyond)


def _dataset(prefix: Path, lengths: list[int]) -> str:
    """A byte-vocabulary dataset of documents of ``lengths`` tokens; its prefix."""
    rng = np.random.default_rng(len(lengths))
    with IndexedDatasetWriter(prefix) as writer:
        for n in lengths:
            writer.add_document(rng.integers(0, 256, size=n))
    return str(prefix)


def test_evaluation_without_a_validation_sample_is_warned(tmp_path, capsys):
    """With evaluation on and eval.steps unset, a validation split that yields no sample of
    seq_length + 1 tokens used to skip every evaluation silently (no valid record, no final
    validation loss): a one-document dataset under split 90,10,0 (round(0.1) = 0 documents),
    a data config without a "valid" blend (which is optional), and a "valid" blend of 2 x 5
    tokens at seq_length 32. Each run trains and says so at start-up, naming what the split
    holds; 33 tokens (one sample) evaluate, and evaluation off says nothing."""
    from shardwork.trainer.cli import train_main
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    seq = tiny_config(tmp_path / "probe").data.seq_length
    one_doc = _dataset(tmp_path / "one", [500])
    short = _dataset(tmp_path / "short", [5, 5])
    exact = _dataset(tmp_path / "exact", [seq + 1])
    off = {"interval": None, "at_end": False, "steps": None}
    whole = {"interval": 1, "steps": None}
    quick = {"train_steps": 1, "warmup_steps": 1}

    def blend(name: str, valid: str | None) -> str:
        path = tmp_path / f"{name}.json"
        splits = {"train": [[1.0, one_doc]], **({"valid": [[1.0, valid]]} if valid else {})}
        path.write_text(json.dumps(splits))
        return str(path)

    def run(data: dict, evaluation: dict):
        stream = io.StringIO()
        config = tiny_config(tmp_path / "run", data=data, eval=evaluation, schedule=quick)
        return train(config, stream=stream), stream.getvalue()

    cases = [
        ({"prefixes": [one_doc], "split": "90,10,0"}, "0 documents, 0 tokens", "data.split"),
        ({"data_config": blend("none", None)}, "0 documents, 0 tokens", '"valid" blend'),
        ({"data_config": blend("short", short)}, "2 documents, 10 tokens", '"valid" blend'),
    ]
    for data, held, remedy in cases:
        result, out = run(data, whole)
        assert result.final_step == 1 and result.valid_losses == {}
        assert "warning: evaluation is on (eval.interval=1, eval.at_end=true)" in out
        assert f"gives the validation split {held}" in out
        assert f"no sample of data.seq_length={seq} tokens (one needs {seq + 1})" in out
        assert remedy in out and "eval.interval='none' and eval.at_end=false" in out
        assert "evaluation is on" not in run(data, off)[1]
    result, out = run({"data_config": blend("ok", exact)}, whole)
    assert set(result.valid_losses) == {1} and "evaluation is on" not in out

    # through the command line: the run trains (exit 0) and says why nothing is evaluated
    cli_run = tmp_path / "cli-run"
    flags = ["--schedule.train_steps", "1", "--schedule.warmup_steps", "1"]
    rc = train_main(["--data.prefixes", one_doc, "--logging.run_dir", str(cli_run), *flags])
    err = capsys.readouterr().err
    assert rc == 0 and "gives the validation split 0 documents" in err, err


def test_none_is_the_cli_spelling_of_null():
    from shardwork.trainer.config.cli import parse_train_args

    config, _ = parse_train_args(
        ["--eval.interval", "none", "--checkpoint.dir=None", "--logging.name", "none"]
    )
    assert config.eval.interval is None and config.checkpoint.dir is None
    assert config.logging.name == "none"  # not optional: the text stays


@pytest.mark.parametrize(
    ("order", "fragment"),
    [("tp-cp-ep-dp", "missing ['pp']"), ("tp-cp-ep-dp-pp-xp", "unknown ['xp']")],
)
def test_order_must_be_a_permutation(tmp_path, corpus_env, order, fragment):
    from shardwork.trainer.testing import tiny_config

    with pytest.raises(ConfigError, match=r"parallel.order=.*exactly once") as info:
        tiny_config(tmp_path, parallel={"order": order})
    assert fragment in str(info.value) and len(info.value.problems) == 1
    tiny_config(tmp_path, parallel={"order": "pp-dp-ep-cp-tp"})
