"""The built-in demo corpus: Python's own ``pydoc_data.topics`` (no download needed).

The standard library ships the text of the language reference topics that
``help()`` shows (~465 KB, 79 documents, PSF licence). :func:`builtin_corpus`
tokenizes it once with the byte tokenizer into an indexed dataset under the
cache directory and returns its prefix; later runs reuse it.

The text is the running Python's own and changes between patch releases (CPython 3.11.2 and
3.11.7: the same 79 topics, 467,176 and 466,117 bytes). The cached dataset is therefore named
by a digest of the text (:func:`corpus_digest`), not by the Python version: a run never trains
on another Python's copy left in a shared cache, and the same Python always finds its own.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from pydoc_data.topics import topics

from shardwork.trainer.data.indexed import dataset_exists
from shardwork.trainer.data.preprocess import write_documents
from shardwork.trainer.data.tokenizer import ByteTokenizer

BUILTIN_CORPORA = ("pydoc",)


def default_cache_dir() -> Path:
    """``$SHARDWORK_CACHE`` or ``$XDG_CACHE_HOME/shardwork`` or ``~/.cache/shardwork``."""
    if "SHARDWORK_CACHE" in os.environ:
        return Path(os.environ["SHARDWORK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardwork"


def pydoc_documents() -> list[str]:
    """This Python's ``pydoc_data`` topics, one document each, in key order."""
    return [topics[key] for key in sorted(topics)]


@functools.cache
def corpus_digest(name: str) -> str:
    """The first 12 hex digits of the SHA-256 of the built-in corpus ``name``: its documents'
    UTF-8 bytes, each followed by a NUL byte (which no document contains)."""
    if name not in BUILTIN_CORPORA:
        raise ValueError(f"data.corpus={name!r} is not built in; valid: {list(BUILTIN_CORPORA)}")
    sha = hashlib.sha256()
    for document in pydoc_documents():
        sha.update(document.encode("utf-8"))
        sha.update(b"\0")
    return sha.hexdigest()[:12]


def corpus_prefix(name: str, cache_dir: str | Path) -> Path:
    """Where the built-in corpus ``name`` is (or will be) preprocessed under ``cache_dir``:
    named by :func:`corpus_digest`, so each version of the text has its own dataset."""
    return Path(cache_dir) / f"{name}-{corpus_digest(name)}-byte"


def builtin_corpus(name: str, cache_dir: str | Path) -> str:
    """Prefix of the byte-tokenized built-in corpus ``name`` (built on first use)."""
    prefix = corpus_prefix(name, cache_dir)
    if not dataset_exists(prefix):
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_documents(pydoc_documents(), prefix, ByteTokenizer())
    return str(prefix)
