"""Which tokenizer an indexed dataset was built with: ``PREFIX.meta.json``.

Megatron's ``.bin``/``.idx`` pair does not record its tokenizer, so a dataset
tokenized with one vocabulary and trained with another fails late (an id past
the embedding) or silently (the wrong end-of-document id splits documents in
the wrong places). ``shardwork-preprocess`` writes this small side file next to
the pair; config validation compares it with ``data.tokenizer`` before any
work starts. Datasets built elsewhere have no side file and are not checked;
Megatron ignores the extra file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from shardwork.trainer.data.partial_files import partial_path

META_SUFFIX = ".meta.json"


@dataclass(frozen=True)
class DatasetMeta:
    """The tokenizer behind a dataset's token ids."""

    tokenizer: str
    """The tokenizer's name: ``"byte"`` or the JSON file it was loaded from."""
    vocab_size: int
    eod_id: int


def meta_path(prefix: str | os.PathLike) -> Path:
    return Path(str(prefix) + META_SUFFIX)


def write_dataset_meta(prefix: str | os.PathLike, meta: DatasetMeta) -> None:
    """Write ``PREFIX.meta.json`` (atomically: a reader never sees half a file).

    The temporary name is unique per call (``partial_files``): with one shared name, a rank
    of a fresh torchrun job found the file already renamed by its peer (FileNotFoundError).
    """
    path = meta_path(prefix)
    tmp = partial_path(path)
    tmp.write_text(json.dumps({"format": 1, **asdict(meta)}, indent=1) + "\n")
    os.replace(tmp, path)


def read_dataset_meta(prefix: str | os.PathLike) -> DatasetMeta | None:
    """The recorded tokenizer, or None when the dataset has no (readable) side file."""
    path = meta_path(prefix)
    try:
        record = json.loads(path.read_text())
        return DatasetMeta(
            tokenizer=str(record["tokenizer"]),
            vocab_size=int(record["vocab_size"]),
            eod_id=int(record["eod_id"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
