"""Mistakes given to ``shardwork-preprocess`` and ``shardwork-generate`` end with one line on
stderr and a nonzero exit (2: an option or path, 5: input data), no traceback, found before
any work and with nothing written or left behind.

- preprocess: an output under a file, in an uncreatable folder, named by a directory
  (``d/``) or with a directory in the way of ``OUTPUT.bin``/``.idx``/``.meta.json``; an input
  that is a directory or holds no text; ``--eod_token`` with the byte tokenizer; the dataset
  writer removes its temporary files when its own rename fails.
- generate: a prompt that is not UTF-8, bad shardwork environment variables, a run whose
  tokenizer (a relative path) is not found from here (``--tokenizer`` replaces it, and must
  match the model's vocabulary), and text handed out as it is generated.
"""

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from shardwork.trainer.data.indexed import IndexedDataset, IndexedDatasetWriter
from shardwork.trainer.data.preprocess import main as preprocess_main


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _random_text(seed: int, words: int = 60) -> str:
    rng = np.random.default_rng(seed)
    vocab = ["cat", "dog", "mat", "log", "sat", "on", "the", "a", "and", "ran", "café"]
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), size=words))


def _refused(capsys, code: int, rc: int, *patterns: str) -> str:
    """Assert exit ``code``, nothing on stdout and one stderr line matching every pattern;
    return the line."""
    out, err = capsys.readouterr()
    assert rc == code, err
    assert out == "", out
    assert "Traceback" not in err and err.count("\n") == 1, err
    for pattern in patterns:
        assert re.search(pattern, err), (pattern, err)
    return err


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A folder with one random text file; the test runs there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(_random_text(1), encoding="utf-8")
    return tmp_path


def test_output_under_a_file_or_in_an_uncreatable_folder(corpus, capsys):
    before = _listing(corpus)
    rc = preprocess_main(["--input", "d/a.txt", "--output", "d/a.txt/o16"])
    _refused(capsys, 2, rc, r"--output 'd/a\.txt/o16': 'd/a\.txt' is a file, not a directory")
    assert _listing(corpus) == before
    if Path("/proc/self").is_dir():  # a pseudo filesystem: no folder can be made in it
        rc = preprocess_main(["--input", "d/a.txt", "--output", "/proc/x/y"])
        _refused(capsys, 2, rc, r"--output '/proc/x/y': cannot create directory '/proc/x'")
        assert not Path("/proc/x").exists()


@pytest.mark.parametrize("suffix", [".bin", ".idx", ".meta.json"])
def test_output_file_name_taken_by_a_directory(corpus, capsys, suffix):
    (corpus / "d" / f"o17{suffix}").mkdir()
    before = _listing(corpus)
    rc = preprocess_main(["--input", "d/a.txt", "--output", "d/o17"])
    _refused(capsys, 2, rc, rf"--output 'd/o17': 'd/o17{re.escape(suffix)}' is a directory")
    assert _listing(corpus) == before


def test_writer_removes_its_temporary_files_when_its_rename_fails(tmp_path):
    (tmp_path / "o.idx").mkdir()  # the second rename fails
    rng = np.random.default_rng(5)
    with pytest.raises(IsADirectoryError), IndexedDatasetWriter(tmp_path / "o") as writer:
        writer.add_document(rng.integers(0, 300, size=17))
    assert _listing(tmp_path) == ["o.idx"]  # no partial file, no .bin without its .idx


@pytest.mark.parametrize("output", ["d/", "d/.", "new/"])
def test_output_naming_a_directory_is_refused(corpus, capsys, output):
    before = _listing(corpus)
    rc = preprocess_main(["--input", "d/a.txt", "--output", output])
    example = str(Path(output) / "corpus")
    _refused(
        capsys,
        2,
        rc,
        rf"--output {re.escape(repr(output))} names a directory, not an output prefix",
        rf"valid: a PREFIX such as {re.escape(repr(example))}",
    )
    assert _listing(corpus) == before


@pytest.mark.parametrize(
    ("name", "content", "extra"),
    [
        ("empty.txt", "", []),
        ("empty.txt", "", ["--append_eod", "false"]),
        ("blank.txt", " \n\n\t", []),
        ("blank.jsonl", "\n\n", []),
    ],
)
def test_input_without_text_is_refused(corpus, capsys, name, content, extra):
    (corpus / name).write_text(content)
    before = _listing(corpus)
    rc = preprocess_main(["--input", "d/a.txt", name, "--output", "new/sub/o", *extra])
    size = len(content.encode())
    _refused(capsys, 5, rc, rf"--input '{re.escape(name)}' holds no text \({size} bytes")
    assert _listing(corpus) == before  # not even the folders new/sub


@pytest.mark.parametrize("no_eod", [["--append_eod", "false"], ["--no_append_eod"]])
def test_inputs_that_yield_no_token_are_refused(corpus, capsys, no_eod):
    (corpus / "e.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}))
    before = _listing(corpus)
    rc = preprocess_main(["--input", "e.jsonl", "--output", "new/o", *no_eod])
    _refused(capsys, 5, rc, r"the inputs yield 2 documents and 0 tokens")
    assert _listing(corpus) == before
    # with the end-of-document id each empty record is one token: a usable dataset
    assert preprocess_main(["--input", "e.jsonl", "--output", "new/o"]) == 0
    assert IndexedDataset("new/o").tokens.tolist() == [256, 256]


def test_input_that_is_not_utf8_is_named_by_line(corpus, capsys):
    """A byte that is not UTF-8 is named by file, line, column and value (exit 5): a JSONL
    file was decoded per 8 KiB read, so the message said 'byte N of a chunk' with N counted
    from an unnamed read, and no line; a text file's offset was called the same. A JSON escape
    of half a UTF-16 pair (a lone surrogate) is refused by its line: it had reached the
    tokenizer, whose UnicodeEncodeError was a traceback (exit 1)."""
    good = json.dumps({"text": _random_text(2, words=2000)})  # > 8 KiB: the bad line reads later
    (corpus / "bad.jsonl").write_bytes(
        (good + "\n" + good + "\n").encode() + b'{"text": "caf\xe9 au lait"}\n'
    )
    (corpus / "bad.txt").write_bytes(b"first line\nsecond \x80 line\n")
    (corpus / "half.jsonl").write_text(good + "\n" + '{"text": "smile \\ud83d"}\n')
    before = _listing(corpus)
    rc = preprocess_main(["--input", "bad.jsonl", "--output", "new/o"])
    _refused(
        capsys,
        5,
        rc,
        r"^shardwork-preprocess: bad\.jsonl:3: not UTF-8 text \(byte 0xe9 at column 14\)",
    )
    rc = preprocess_main(["--input", "bad.txt", "--output", "new/o"])
    _refused(capsys, 5, rc, r"bad\.txt:2: not UTF-8 text \(byte 0x80 at column 8, file offset 18")
    rc = preprocess_main(["--input", "half.jsonl", "--output", "new/o"])
    _refused(
        capsys,
        5,
        rc,
        r"half\.jsonl:2: --json_key='text' holds a lone surrogate \\ud83d at character 6",
    )
    assert _listing(corpus) == before


def test_output_that_cannot_be_written_is_named(corpus, capsys, monkeypatch):
    """A directory that passes the os.access check but refuses the write (a read-only or
    pseudo file system, root on /sys, root-squashed NFS) or a full disk: exit 2 naming
    --output and the file, not a PermissionError traceback from the dataset writer."""
    import errno

    from shardwork.trainer.data import indexed

    real_open = open

    def refusing_open(file, mode="r", *args, **kwargs):
        if "w" in mode and "o18.bin" in str(file):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(indexed, "open", refusing_open, raising=False)
    before = _listing(corpus)
    rc = preprocess_main(["--input", "d/a.txt", "--output", "d/o18"])
    _refused(
        capsys,
        2,
        rc,
        r"--output 'd/o18': cannot write 'd/o18\.bin\.partial-",
        r"\(Permission denied\)",
    )
    assert _listing(corpus) == before


def test_input_directory_is_named_as_one(corpus, capsys):
    before = _listing(corpus)
    rc = preprocess_main(["--input", "d", "--output", "o"])
    _refused(capsys, 2, rc, r"--input 'd' is a directory; valid: text or JSONL files")
    assert _listing(corpus) == before


def test_eod_token_with_the_byte_tokenizer_is_refused(corpus, capsys):
    before = _listing(corpus)
    rc = preprocess_main(["--input", "d/a.txt", "--output", "o", "--eod_token", "<eos>"])
    _refused(
        capsys,
        2,
        rc,
        r"--eod_token='<eos>' names a token of a tokenizer file, but --tokenizer='byte' has a "
        r"fixed end-of-document id \(256\)",
    )
    assert _listing(corpus) == before


# ---- shardwork-generate ---------------------------------------------------------------------

NO_EVAL = {"interval": None, "at_end": False}


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    """The checkpoint root of a one-step tiny run with the byte tokenizer."""
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    base = tmp_path_factory.mktemp("byte_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDWORK_CACHE", str(base / "cache"))
        config = tiny_config(
            base / "run",
            schedule={"train_steps": 1, "warmup_steps": 0},
            eval=NO_EVAL,
            checkpoint={"save_at_end": True},
        )
        train(config, stream=io.StringIO())
    return base / "run" / "checkpoints"


@pytest.fixture
def generate_env(monkeypatch):
    """main() sets these for OpenMP; restore them after the test."""
    import os

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", os.environ.get("THP_MEM_ALLOC_ENABLE", "0"))
    for name in ("SHARDWORK_CPU_GEMM", "SHARDWORK_KERNEL_BACKEND", "SHARDWORK_CKPT_FAULT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_prompt_that_is_not_utf8_is_refused(byte_run, generate_env, capsys):
    from shardwork.trainer.generate import main

    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # as Python decodes such an argv
    rc = main([str(byte_run), "--prompt", prompt])
    _refused(capsys, 2, rc, r"--prompt: not valid UTF-8 \(byte 0xe9 at character 3\)")


@pytest.mark.parametrize(
    ("name", "valid"),
    [("SHARDWORK_CPU_GEMM", "auto, mkl, onednn"), ("SHARDWORK_KERNEL_BACKEND", "auto, torch")],
)
def test_bad_environment_is_refused_before_loading(byte_run, generate_env, capsys, name, valid):
    from shardwork.trainer.generate import main

    generate_env.setenv(name, "bogus")
    rc = main([str(byte_run), "--prompt", "a", "--max_new_tokens", "2"])
    _refused(capsys, 2, rc, rf"environment: {name}='bogus'", re.escape(valid))


def _fake_model(script: list[int], vocab: int):
    """A model whose next-token logits pick ``script`` in order; counts its calls."""
    import torch

    class Fake:
        config = type("C", (), {"vocab_size": vocab})()
        calls = 0

        def __call__(self, input_ids):
            logits = torch.zeros(input_ids.shape[1], 1, vocab + 7)
            logits[-1, 0, script[Fake.calls]] = 1.0
            Fake.calls += 1
            return logits

    return Fake()


def test_sample_hands_out_text_as_it_grows():
    import torch

    from shardwork.trainer.data.tokenizer import ByteTokenizer
    from shardwork.trainer.inference import sample

    rng = np.random.default_rng(11)
    text = "".join(rng.choice(list("abc é€xyz"), size=40))
    script = [*text.encode("utf-8"), 256]
    model = _fake_model(script, 257)
    pieces: list[tuple[int, str]] = []
    out = sample(
        model,
        ByteTokenizer(),
        "p",
        max_new_tokens=len(script) + 5,
        temperature=0.0,
        top_k=0,
        context=8,
        generator=torch.Generator().manual_seed(0),
        on_text=lambda piece: pieces.append((type(model).calls, piece)),
    )
    assert out == text
    assert "".join(p for _, p in pieces) == text
    assert all("\ufffd" not in p for _, p in pieces)  # a partial character waits
    assert pieces[0][0] == 1 and len(pieces) == len(text)  # one piece per character, at once


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """``(checkpoint root, training folder, tokenizer vocab)`` of a one-step run trained from
    its folder with ``data.tokenizer='tok.json'`` (a relative path)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from shardwork.trainer.data.preprocess import write_documents
    from shardwork.trainer.data.tokenizer import load_tokenizer
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    folder = tmp_path_factory.mktemp("hf_run")
    docs = [_random_text(seed) for seed in range(40)]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=60, special_tokens=["</s>"]))
    tok.save(str(folder / "tok.json"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        write_documents(docs, "corpus", load_tokenizer("tok.json"))
        config = tiny_config(
            "run",
            data={"tokenizer": "tok.json", "prefixes": ["corpus"], "split": "100,0,0"},
            schedule={"train_steps": 1, "warmup_steps": 0},
            eval=NO_EVAL,
            checkpoint={"save_at_end": True},
        )
        train(config, stream=io.StringIO())
    return folder / "run" / "checkpoints", folder, tok.get_vocab_size()


def test_tokenizer_not_found_from_here_and_the_override(hf_run, generate_env, tmp_path, capsys):
    from shardwork.trainer.generate import main

    root, folder, vocab = hf_run
    generate_env.chdir(tmp_path)  # another folder: 'tok.json' is not here
    rc = main([str(root), "--prompt", "cat ", "--max_new_tokens", "3"])
    _refused(
        capsys,
        2,
        rc,
        r"the checkpoint's run used tokenizer data\.tokenizer='tok\.json', which is not found "
        rf"from here \({re.escape(str(tmp_path))}\)",
        rf"pass --tokenizer PATH \(that tokenizer's JSON file, {vocab} ids\)",
    )
    rc = main([str(root), "--prompt", "cat ", "--tokenizer", "byte"])
    _refused(
        capsys,
        2,
        rc,
        rf"--tokenizer='byte' has 257 ids but the checkpoint's model has a vocabulary of {vocab}",
    )
    assert _listing(tmp_path) == []  # nothing written
    moved = tmp_path / "moved.json"  # the file, somewhere else: --tokenizer finds it
    moved.write_bytes((folder / "tok.json").read_bytes())
    rc = main([str(root), "--prompt", "cat ", "--max_new_tokens", "3", "--tokenizer", str(moved)])
    assert rc == 0
    assert capsys.readouterr().out.startswith("cat ")


def test_tokenizer_at_an_absolute_path_that_is_gone(tmp_path, generate_env, capsys):
    """A run given an absolute data.tokenizer whose file was moved or deleted: the message
    says so; it said "not found from here" and advised running from the training's folder,
    which cannot help (an absolute path is the same from every folder)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from shardwork.trainer.data.preprocess import write_documents
    from shardwork.trainer.data.tokenizer import load_tokenizer
    from shardwork.trainer.generate import main
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    docs = [_random_text(seed) for seed in range(40)]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=60, special_tokens=["</s>"]))
    path = tmp_path / "tok.json"
    tok.save(str(path))
    write_documents(docs, tmp_path / "corpus", load_tokenizer(str(path)))
    config = tiny_config(
        tmp_path / "run",
        data={"tokenizer": str(path), "prefixes": [str(tmp_path / "corpus")], "split": "100,0,0"},
        schedule={"train_steps": 1, "warmup_steps": 0},
        eval=NO_EVAL,
        checkpoint={"save_at_end": True},
    )
    train(config, stream=io.StringIO())
    path.unlink()
    generate_env.chdir(tmp_path)  # the training's own folder: still no file
    rc = main([str(tmp_path / "run" / "checkpoints"), "--prompt", "cat "])
    err = _refused(
        capsys,
        2,
        rc,
        rf"used tokenizer data\.tokenizer={re.escape(repr(str(path)))}, which no longer exists "
        r"\(moved or deleted\); valid: restore that file, or pass --tokenizer PATH",
    )
    assert "from here" not in err and "folder the training ran in" not in err
