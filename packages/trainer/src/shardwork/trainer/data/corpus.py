"""The built-in demo corpus: Python's own ``pydoc_data.topics`` (no download needed).

The standard library ships the text of the language reference topics that
``help()`` shows (~465 KB, 79 documents, PSF licence). :func:`builtin_corpus`
tokenizes it once with the byte tokenizer into an indexed dataset under the
cache directory and returns its prefix; later runs reuse it.
"""

from __future__ import annotations

import os
import sys
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
    return [topics[key] for key in sorted(topics)]


def corpus_prefix(name: str, cache_dir: str | Path) -> Path:
    """Where the built-in corpus ``name`` is (or will be) preprocessed under ``cache_dir``."""
    if name not in BUILTIN_CORPORA:
        raise ValueError(f"data.corpus={name!r} is not built in; valid: {list(BUILTIN_CORPORA)}")
    return Path(cache_dir) / f"{name}-py{sys.version_info.major}{sys.version_info.minor}-byte"


def builtin_corpus(name: str, cache_dir: str | Path) -> str:
    """Prefix of the byte-tokenized built-in corpus ``name`` (built on first use)."""
    prefix = corpus_prefix(name, cache_dir)
    if not dataset_exists(prefix):
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_documents(pydoc_documents(), prefix, ByteTokenizer())
    return str(prefix)
