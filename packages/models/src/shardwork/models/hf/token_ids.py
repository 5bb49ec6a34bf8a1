"""Token ids between a Hugging Face folder and :class:`~shardwork.models.token_ids.TokenIds`.

transformers keeps ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` in ``config.json``
and, for ``generate()``, in ``generation_config.json`` (which wins when both exist). Import
reads both; export writes the ids into ``config.json`` and writes ``generation_config.json``
(the one read on import, verbatim, or one holding the ids).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwork.models.token_ids import TokenIds

__all__ = ["GENERATION_CONFIG", "read_token_ids", "token_id_fields", "write_generation_config"]

GENERATION_CONFIG = "generation_config.json"
_FIELDS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id"))


def _ids_of(hf: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for ours, theirs in _FIELDS:
        value = hf.get(theirs)
        out[ours] = tuple(value) if isinstance(value, list) else value
    return out


def read_token_ids(folder: str | Path, hf_config: dict[str, Any]) -> TokenIds:
    """The ids of the checkpoint in ``folder`` whose ``config.json`` is ``hf_config``."""
    path = Path(folder) / GENERATION_CONFIG
    generation = json.loads(path.read_text()) if path.is_file() else None
    try:
        return TokenIds(**_ids_of(hf_config), generation_config=generation)
    except ValueError as err:
        raise ValueError(f"{path.parent / 'config.json'}: {err}") from None


def token_id_fields(ids: TokenIds | None) -> dict[str, Any]:
    """The ``config.json`` fields of ``ids`` (all three, None where unset, as transformers
    writes them; nothing when the model has no ids)."""
    if ids is None:
        return {}
    return {
        theirs: list(v) if isinstance(v := getattr(ids, ours), tuple) else v
        for ours, theirs in _FIELDS
    }


def write_generation_config(folder: Path, ids: TokenIds | None) -> None:
    """Write ``generation_config.json``: the kept one, else the ids (none without ids)."""
    if ids is None:
        return
    if ids.generation_config is not None:
        text = ids.generation_config
    else:
        text = {k: v for k, v in token_id_fields(ids).items() if v is not None}
    (folder / GENERATION_CONFIG).write_text(json.dumps(text, indent=2))
