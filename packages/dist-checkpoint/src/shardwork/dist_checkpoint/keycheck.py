"""Comparing a load's template with what a checkpoint holds, before any data is read.

`find_keys` lists this rank's findings: *missing* (in the template, not saved), *mismatched*
(saved with another global shape, as another kind of leaf, or with a dtype of another kind,
see `dtype_kind`; as ``(key, checkpoint has, template has)``) and the keys the template wants.
`load` all-gathers them, so every rank judges the union and raises the same
`CheckpointMismatchError`.

The error's message is a summary a person can act on: the count of each finding and the
first few of each (a model of another width differs in dozens of keys; listing all of them
made one unreadable line of thousands of characters). Callers that know a better remedy
(the trainer's command-line options) read the structured fields instead of the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorStorageMetadata,
)

from shardwork.dist_checkpoint.plan import LocalState
from shardwork.dist_checkpoint.tree import path_str

__all__ = ["CheckpointMismatchError", "KeyFindings", "dtype_kind", "find_keys"]

#: findings of each kind shown in a message; the rest are counted
SHOWN = 3


class CheckpointMismatchError(ValueError):
    """A load's template does not fit the checkpoint (strict key check; see `load`).

    Attributes:
        checkpoint: the checkpoint directory.
        mismatched: ``(key, what the checkpoint has, what the template has)``, e.g.
            ``("w", "global shape (8, 6)", "global shape (4, 6)")``.
        missing: keys in the template that were not saved.
        unexpected: saved keys in no rank's template (reported with ``strict=True`` only).
    """

    def __init__(
        self,
        checkpoint: str,
        strict: Any,
        mismatched: list[tuple[str, str, str]],
        missing: list[str],
        unexpected: list[str],
    ) -> None:
        self.checkpoint = checkpoint
        self.strict = strict
        self.mismatched = mismatched
        self.missing = missing
        self.unexpected = unexpected
        super().__init__(self.summary("template") + "\n" + _ADVICE)

    def __reduce__(self) -> tuple:
        args = (self.checkpoint, self.strict, self.mismatched, self.missing, self.unexpected)
        return CheckpointMismatchError, args

    def summary(self, ours: str) -> str:
        """The findings, counted, with the first `SHOWN` of each; ``ours`` names the side that
        is not the checkpoint (``"template"``, ``"this run"``)."""
        counts = [
            f"{len(self.mismatched)} with another shape or kind",
            f"{len(self.missing)} missing from the checkpoint",
            f"{len(self.unexpected)} unexpected (saved, in no rank's template)",
        ]
        lines = [f"cannot load {self.checkpoint!r} (strict={self.strict!r}): " + ", ".join(counts)]
        for key, saved, wanted in self.mismatched[:SHOWN]:
            lines.append(f"  {key!r}: checkpoint has {saved}, {ours} has {wanted}")
        lines += _first("missing", self.missing)
        lines += _first("unexpected", self.unexpected)
        return "\n".join(lines)


_ADVICE = (
    "valid: a template with the saved keys, global shapes and kinds of dtype (a load casts "
    "float32 to bfloat16, never floating point to integer or bool), or strict='missing' / "
    "strict=False / key_filter to load a subset"
)


def _first(kind: str, keys: list[str]) -> list[str]:
    if not keys:
        return []
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return [f"  {kind}: " + ", ".join(repr(k) for k in keys[:SHOWN]) + more]


def dtype_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"integer"``, ``"floating point"`` or ``"complex"``: a load casts between
    dtypes of one kind (float32 into bfloat16), never across kinds, where the copy would
    truncate (float into int), saturate (into bool) or drop a part (complex into real)."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating point"
    return "integer"


@dataclass
class KeyFindings:
    """This rank's view of its template against the saved metadata (see the module doc)."""

    missing: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)
    wanted: set[str] = field(default_factory=set)
    #: per tensor key, the template's rectangles to read and the views they go into
    chunks: dict[str, list[ChunkStorageMetadata]] = field(default_factory=dict)
    views: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: unique keys of the objects to read
    object_reads: set[str] = field(default_factory=set)


def find_keys(local: LocalState, saved: dict[str, Any], info: dict[str, Any]) -> KeyFindings:
    """Compare ``local`` (already filtered) with DCP's ``saved`` metadata and ``info``."""
    found = KeyFindings()
    for _, st, pieces in local.tensors:
        found.wanted.add(st.key)
        meta = saved.get(st.key)
        if meta is None:
            found.missing.append(st.key)
        elif not isinstance(meta, TensorStorageMetadata):
            found.mismatched.append((st.key, "an object", "a ShardedTensor"))
        elif tuple(meta.size) != st.global_shape:
            found.mismatched.append(
                (st.key, f"global shape {tuple(meta.size)}", f"global shape {st.global_shape}")
            )
        elif dtype_kind(meta.properties.dtype) != dtype_kind(st.data.dtype):
            saved_dtype, wanted_dtype = meta.properties.dtype, st.data.dtype
            found.mismatched.append(
                (
                    st.key,
                    f"dtype {saved_dtype} ({dtype_kind(saved_dtype)})",
                    f"dtype {wanted_dtype} ({dtype_kind(wanted_dtype)})",
                )
            )
        else:
            for piece in pieces:
                # A zero-element piece has nothing to read.
                if any(s == 0 for s in piece.box[1]):
                    continue
                found.chunks.setdefault(st.key, []).append(
                    ChunkStorageMetadata(torch.Size(piece.box[0]), torch.Size(piece.box[1]))
                )
                found.views.setdefault(st.key, []).append(piece.view)
    for _, obj in local.objects:
        found.wanted.add(obj.key)
        meta = saved.get(obj.unique_key)
        if meta is None:
            known = info["keys"].get(obj.key)
            if known is not None and tuple(known["global_shape"]) != obj.global_shape:
                found.mismatched.append(
                    (
                        obj.key,
                        f"an object grid {tuple(known['global_shape'])}",
                        f"cell {obj.global_offset} of a grid {obj.global_shape}",
                    )
                )
            else:
                found.missing.append(obj.unique_key)
        elif not isinstance(meta, BytesStorageMetadata):
            found.mismatched.append((obj.key, "a tensor", "a ShardedObject"))
        else:
            found.object_reads.add(obj.unique_key)
    plain_saved = set(info.get("plain_paths", []))
    for p, _ in local.plain:
        found.wanted.add(path_str(p))
        if path_str(p) not in plain_saved:
            found.missing.append(path_str(p))
    return found
