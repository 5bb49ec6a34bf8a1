"""``shardwork-preprocess``: text or JSONL files -> a Megatron-compatible indexed dataset.

- JSONL (``.jsonl``/``.json``): one document per line, text under ``--json-key``.
- Any other file: one document per file, or one per chunk when
  ``--doc-separator`` is given (e.g. ``'\\n\\n'`` for paragraphs).
- Each document gets the tokenizer's end-of-document id appended (as
  Megatron's ``--append-eod``), so concatenated samples never merge two
  documents silently.
- The built-in byte tokenizer needs nothing; ``--tokenizer PATH`` uses a
  Hugging Face ``tokenizers`` JSON file.
- Mistakes end with one paragraph and an exit code (:mod:`..errors`): 2 for an option (a
  missing input file or a directory given as one, an unreadable tokenizer, ``--eod_token``
  with the byte tokenizer, an ``--output`` that is a directory rather than a prefix, lies under
  a file, cannot be created or has a directory in the way of ``OUTPUT.bin``/``.idx``/
  ``.meta.json``, or refuses the write itself: a read-only or pseudo file system that
  ``os.access`` calls writable, a full disk), 5 for bad input data (a file that is not UTF-8,
  named by line and column, or holds no text, a line that is not a JSON object, a record
  without ``--json_key`` or whose text is not a string or holds a lone UTF-16 surrogate
  escape, inputs that yield no token at all), naming the file and line. The options, the output
  location and the input paths are checked before any input is read. The output is written
  under temporary names and renamed only when complete, so a failed run leaves no
  ``OUTPUT.bin``/``OUTPUT.idx`` (nor a directory it created) behind.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from shardwork.trainer.data.dataset_meta import DatasetMeta, meta_path, write_dataset_meta
from shardwork.trainer.data.indexed import (
    IndexedDatasetWriter,
    data_file_paths,
    dataset_exists,
    token_dtype_for,
)
from shardwork.trainer.data.tokenizer import Tokenizer, load_tokenizer
from shardwork.trainer.errors import DataError, UserError, report


def iter_documents(
    paths: Iterable[str | Path], *, json_key: str = "text", doc_separator: str | None = None
) -> Iterator[str]:
    """Yield document texts from text / JSONL files (see module docstring)."""
    for raw in paths:
        path = Path(raw)
        check_input(path)
        if path.suffix in (".jsonl", ".json"):
            yield from _jsonl_texts(path, json_key)
            continue
        data = _read_input(path)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
            raise DataError(
                f"{path}:{line}: not UTF-8 text (byte {data[exc.start]:#04x} at column {column}"
                f", file offset {exc.start}: {exc.reason}); valid: UTF-8 text or JSONL files"
            ) from None
        if not text.strip():
            raise DataError(_no_text(path))
        if doc_separator:
            yield from (chunk for chunk in text.split(doc_separator) if chunk.strip())
        else:
            yield text


def _no_text(path: Path) -> str:
    return (
        f"--input {str(path)!r} holds no text ({path.stat().st_size} bytes, no document to "
        "write); valid: a UTF-8 text or JSONL file with at least one non-blank document"
    )


def check_input(path: Path) -> None:
    """UserError unless ``path`` is an existing file (a directory is named as one); DataError
    when it is empty: each is found before anything is written."""
    if path.is_dir():
        raise UserError(
            f"--input {str(path)!r} is a directory; valid: text or JSONL files (give each file, "
            f"e.g. --input {str(path / '*.txt')!r} expanded by the shell)"
        )
    if not path.is_file():
        raise UserError(f"--input {str(path)!r}: no such file; valid: text or JSONL files")
    if path.stat().st_size == 0:
        raise DataError(_no_text(path))


def check_output(prefix: str) -> None:
    """UserError unless ``prefix`` can take ``.bin``/``.idx``/``.meta.json`` files: it must
    name a file prefix (not end in a directory), no file may stand where its directory goes,
    the nearest existing directory must be writable, and no output name may be a directory.
    Checked before any input is read, so a mistake costs no tokenizing."""
    shown = f"--output {prefix!r}"
    if os.path.basename(prefix) in ("", ".", ".."):
        example = os.path.join(os.path.normpath(prefix), "corpus")
        raise UserError(
            f"{shown} names a directory, not an output prefix (it would write hidden files "
            f"such as {prefix}.bin); valid: a PREFIX such as {example!r} (writes "
            f"{example}.bin, {example}.idx and {example}.meta.json)"
        )
    parent = Path(prefix).parent
    existing = next(p for p in (parent, *parent.parents) if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        raise UserError(
            f"{shown}: {str(existing)!r} is a file, not a directory, so nothing can be written "
            "under it; valid: a prefix in a directory (existing or to be created)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{shown}: directory {str(existing)!r} is not writable")
    for path in (*data_file_paths(prefix), meta_path(prefix)):
        if path.is_dir():
            raise UserError(
                f"{shown}: {str(path)!r} is a directory and would be replaced by an output "
                "file; valid: another prefix, or remove that directory"
            )


def make_output_dirs(prefix: str) -> list[Path]:
    """Create ``prefix``'s missing parent directories; return them, deepest first, so a failed
    run removes what it made. A directory that cannot be made is a UserError naming it."""
    parent = Path(prefix).parent
    missing = [p for p in (parent, *parent.parents) if not p.exists()]
    for path in reversed(missing):
        try:
            path.mkdir()
        except OSError as exc:
            remove_empty_dirs(missing)
            raise UserError(
                f"--output {prefix!r}: cannot create directory {str(path)!r} "
                f"({exc.strerror}); valid: a prefix in a writable directory"
            ) from None
    return missing


def remove_empty_dirs(paths: Iterable[Path]) -> None:
    """Remove ``paths`` (deepest first) while they exist and are empty: a directory that is
    not empty keeps its parents."""
    for path in paths:
        try:
            path.rmdir()
        except OSError:
            return


def _jsonl_texts(path: Path, json_key: str) -> Iterator[str]:
    """The ``json_key`` text of each non-blank line of ``path``; DataError names the line, or
    the file when no line holds a record."""
    records = 0
    # surrogateescape: a byte that is not UTF-8 becomes a lone surrogate, found per line below,
    # so the message names its line (a strict decode fails per 8 KiB read, naming no line)
    with _open_input(path) as f:
        for line_no, line in enumerate(f, 1):
            _check_utf8(path, line_no, line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno}); each "
                    "line must be one JSON object"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}:{line_no}: a JSON {type(record).__name__}, not an object; each line "
                    f'must be one JSON object such as {{"{json_key}": "..."}}'
                )
            if json_key not in record:
                raise DataError(
                    f"{path}:{line_no}: --json_key={json_key!r} not in record keys {sorted(record)}"
                )
            if not isinstance(record[json_key], str):
                raise DataError(
                    f"{path}:{line_no}: --json_key={json_key!r} holds a "
                    f"{type(record[json_key]).__name__}, not a string"
                )
            _check_text(path, line_no, json_key, record[json_key])
            records += 1
            yield record[json_key]
    if not records:
        raise DataError(_no_text(path))


def _read_input(path: Path) -> bytes:
    """The bytes of input ``path``; a file that cannot be read is a UserError naming it."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserError(_unreadable(path, exc)) from None


def _open_input(path: Path):
    """``path`` opened as text, undecodable bytes kept as surrogates (see _check_utf8)."""
    try:
        return open(path, encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise UserError(_unreadable(path, exc)) from None


def _unreadable(path: Path, exc: OSError) -> str:
    return f"--input {str(path)!r} cannot be read ({exc.strerror or exc}); valid: a readable file"


def _check_utf8(path: Path, line_no: int, line: str) -> None:
    """DataError naming ``path``:``line_no`` and the byte when ``line`` (decoded with
    surrogateescape) held bytes that are not UTF-8."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(line[exc.start]) - 0xDC00
        column = len(line[: exc.start].encode("utf-8", "surrogateescape")) + 1
        raise DataError(
            f"{path}:{line_no}: not UTF-8 text (byte {byte:#04x} at column {column}); valid: "
            "UTF-8 text or JSONL files"
        ) from None


def _check_text(path: Path, line_no: int, json_key: str, text: str) -> None:
    """DataError when a record's text holds a lone UTF-16 surrogate (a JSON escape such as
    ``\\ud800`` of half a character pair): it is no character, and no tokenizer encodes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{path}:{line_no}: --json_key={json_key!r} holds a lone surrogate "
            f"\\u{ord(text[exc.start]):04x} at character {exc.start} (a JSON escape of half "
            "a UTF-16 pair), which is not text; valid: complete characters (a pair such as "
            "\\ud83d\\ude00, or the character itself)"
        ) from None


def write_documents(
    documents: Iterable[str], prefix: str | Path, tokenizer: Tokenizer, *, append_eod: bool = True
) -> tuple[int, int]:
    """Tokenize ``documents`` into ``prefix.bin``/``prefix.idx`` (and ``prefix.meta.json``
    naming the tokenizer); returns (documents, tokens)."""
    num_docs = num_tokens = 0
    with IndexedDatasetWriter(prefix, dtype=token_dtype_for(tokenizer.vocab_size)) as writer:
        for text in documents:
            ids = tokenizer.encode(text)
            if append_eod:
                ids.append(tokenizer.eod_id)
            writer.add_document(np.asarray(ids))
            num_docs += 1
            num_tokens += len(ids)
        if num_tokens == 0:  # raised inside the writer: its temporary files are removed
            raise DataError(
                f"the inputs yield {num_docs} documents and 0 tokens (every text is empty and "
                "no end-of-document id is appended): training cannot use an empty dataset; "
                "valid: inputs that hold text"
            )
    meta = DatasetMeta(
        tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id
    )
    write_dataset_meta(prefix, meta)
    return num_docs, num_tokens


@dataclass(kw_only=True)
class PreprocessArgs:
    """Build OUTPUT.bin / OUTPUT.idx from text or JSONL files. Exit codes: 0 ok, 1
    internal error, 2 usage error, 5 bad input data (named as FILE:LINE)."""

    input: list[str]
    """Input files: .jsonl/.json (one JSON document per line) or plain text."""
    output: str
    """Output prefix: writes OUTPUT.bin and OUTPUT.idx."""
    tokenizer: str = "byte"
    """'byte' (built in) or the path of a Hugging Face tokenizers JSON file."""
    json_key: str = "text"
    """Key of the text in each JSONL record."""
    doc_separator: str | None = None
    """Split plain-text files into documents at this string (default: one document per file)."""
    eod_token: str | None = None
    """End-of-document token of a HF tokenizer (default: the first of the usual names found)."""
    append_eod: bool = True
    """Append the end-of-document id to every document."""


def _tokenizer(args: PreprocessArgs) -> Tokenizer:
    """The tokenizer ``--tokenizer`` names; a mistake (as ``shardwork-train`` refuses it) is a
    UserError naming the option."""
    if args.tokenizer == "byte" and args.eod_token is not None:
        raise UserError(
            f"--eod_token={args.eod_token!r} names a token of a tokenizer file, but "
            "--tokenizer='byte' has a fixed end-of-document id (256); valid: leave --eod_token "
            "unset, or give --tokenizer a tokenizer JSON file"
        )
    try:
        return load_tokenizer(args.tokenizer, eod_token=args.eod_token)
    except (ImportError, ValueError, OSError) as exc:
        raise UserError(
            f"--tokenizer={args.tokenizer!r}: {exc}; valid: 'byte' or a tokenizer.json written "
            "by the `tokenizers` library"
        ) from None


def _output_error(prefix: str, exc: BaseException) -> BaseException:
    """A failure to write one of ``prefix``'s files (a directory ``os.access`` calls writable
    but is not: a read-only or pseudo file system, root-squashed NFS; a full disk) as a
    UserError naming ``--output``; any other exception unchanged."""
    if not isinstance(exc, OSError) or exc.filename is None:
        return exc
    name = os.fsdecode(exc.filename)
    if os.path.dirname(os.path.abspath(name)) != os.path.dirname(os.path.abspath(prefix)):
        return exc
    if not os.path.basename(name).startswith(os.path.basename(prefix)):
        return exc
    return UserError(
        f"--output {prefix!r}: cannot write {name!r} ({exc.strerror or exc}); valid: a prefix "
        "in a writable directory with room for the dataset"
    )


def _spell_booleans(argv: list[str]) -> list[str]:
    """``true``/``false`` as tyro reads them, and the earlier ``--no_append_eod`` flag kept as
    ``--append_eod False``."""
    out: list[str] = []
    for arg in argv:
        if arg == "--no_append_eod":
            out += ["--append_eod", "False"]
        else:
            out.append({"true": "True", "false": "False"}.get(arg, arg))
    return out


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(
        PreprocessArgs,
        args=_spell_booleans(sys.argv[1:] if argv is None else argv),
        use_underscores=True,
        prog="shardwork-preprocess",
        # --append_eod true/false, as shardwork-train spells its booleans
        config=(tyro.conf.FlagConversionOff,),
    )
    made: list[Path] = []
    # said after the write: an earlier dataset there is replaced (the files are renamed into
    # place, so a failed run leaves it whole)
    replaces = dataset_exists(args.output)
    try:
        check_output(args.output)
        tokenizer = _tokenizer(args)
        for path in args.input:
            check_input(Path(path))
        made = make_output_dirs(args.output)
        docs = iter_documents(args.input, json_key=args.json_key, doc_separator=args.doc_separator)
        num_docs, num_tokens = write_documents(
            docs, args.output, tokenizer, append_eod=args.append_eod
        )
    except BaseException as exc:
        remove_empty_dirs(made)  # directories this run created for an output it did not write
        exc = _output_error(args.output, exc)
        if not isinstance(exc, UserError):
            raise
        return report("shardwork-preprocess", str(exc), exc.exit_code)
    print(
        f"wrote {args.output}.bin / {args.output}.idx: {num_docs} documents, {num_tokens} tokens "
        f"(tokenizer {tokenizer.name}, vocab {tokenizer.vocab_size})"
        + ("; it replaced the dataset that was there" if replaces else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
