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
  missing input file, an unreadable tokenizer), 5 for bad input data (a file that is not
  UTF-8, a line that is not a JSON object, a record without ``--json_key`` or whose text is not a string), naming the file
  and line. The output is written under temporary names and renamed only when complete, so a
  failed run leaves no ``OUTPUT.bin``/``OUTPUT.idx`` behind.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from shardwork.trainer.data.dataset_meta import DatasetMeta, write_dataset_meta
from shardwork.trainer.data.indexed import IndexedDatasetWriter, token_dtype_for
from shardwork.trainer.data.tokenizer import Tokenizer, load_tokenizer
from shardwork.trainer.errors import DataError, UserError, report


def iter_documents(
    paths: Iterable[str | Path], *, json_key: str = "text", doc_separator: str | None = None
) -> Iterator[str]:
    """Yield document texts from text / JSONL files (see module docstring)."""
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise UserError(f"--input {str(path)!r}: no such file")
        try:
            if path.suffix in (".jsonl", ".json"):
                yield from _jsonl_texts(path, json_key)
                continue
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path}: not UTF-8 text (byte {exc.start} of a chunk: {exc.reason}); valid: "
                "UTF-8 text or JSONL files"
            ) from None
        if doc_separator:
            yield from (chunk for chunk in text.split(doc_separator) if chunk.strip())
        else:
            yield text


def _jsonl_texts(path: Path, json_key: str) -> Iterator[str]:
    """The ``json_key`` text of each non-blank line of ``path``; DataError names the line."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
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
            yield record[json_key]


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
    try:
        return load_tokenizer(args.tokenizer, eod_token=args.eod_token)
    except (ImportError, ValueError, OSError) as exc:
        raise UserError(
            f"--tokenizer={args.tokenizer!r}: {exc}; valid: 'byte' or a tokenizer.json written "
            "by the `tokenizers` library"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(
        PreprocessArgs,
        args=sys.argv[1:] if argv is None else argv,
        use_underscores=True,
        prog="shardwork-preprocess",
    )
    try:
        tokenizer = _tokenizer(args)
        docs = iter_documents(args.input, json_key=args.json_key, doc_separator=args.doc_separator)
        num_docs, num_tokens = write_documents(
            docs, args.output, tokenizer, append_eod=args.append_eod
        )
    except UserError as exc:
        return report("shardwork-preprocess", str(exc), exc.exit_code)
    print(
        f"wrote {args.output}.bin / {args.output}.idx: {num_docs} documents, {num_tokens} tokens "
        f"(tokenizer {tokenizer.name}, vocab {tokenizer.vocab_size})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
