"""``ParamMeta``: the one description of a parameter's parallel layout.

Every model attaches it to each parameter it creates; the optimizer, the
gradient finaliser and checkpointing read only this (never module types or
parameter names) to decide how a parameter is reduced, sharded and saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTRIBUTE = "_shardwork_param_meta"


@dataclass(frozen=True, kw_only=True)
class ParamMeta:
    """Layout of one parameter across the parallel dimensions."""

    tp_axis: int | None = None
    """Tensor dim split across the tensor-parallel group (``etp`` for experts); None: replicated."""
    tp_partition_sizes: tuple[int, ...] | None = None
    """If the TP axis is a concatenation of independently split blocks (fused [gate | up],
    fused QKV), their global sizes along ``tp_axis``; each rank holds its slice of each block."""
    is_expert: bool = False
    """Expert parameter: gradients reduce over the expert-data-parallel group, not dp×cp."""
    sequence_parallel: bool = False
    """Replicated across TP but fed by sequence-parallel activations (norm weights, QK-norm):
    its gradient must be all-reduced over the TP group."""
    shared_embedding: bool = False
    """Shared between the first and last pipeline stage (tied embedding / LM head, MTP):
    its gradient is all-reduced over the embedding group."""

    def __post_init__(self) -> None:
        if self.tp_partition_sizes is not None and self.tp_axis is None:
            raise ValueError(
                "ParamMeta.tp_partition_sizes needs tp_axis: fused blocks are split along it"
            )
        if self.sequence_parallel and self.tp_axis is not None:
            raise ValueError(
                f"ParamMeta.sequence_parallel=True with tp_axis={self.tp_axis}: a sequence-parallel "
                "parameter is replicated across TP, so tp_axis must be None"
            )


_DEFAULT = ParamMeta()


def set_param_meta(param: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """Attach ``meta`` to ``param`` (replacing any previous one); returns ``param``."""
    if not isinstance(meta, ParamMeta):
        raise TypeError(f"set_param_meta: meta must be a ParamMeta, got {type(meta).__name__}")
    setattr(param, _ATTRIBUTE, meta)
    return param


def get_param_meta(param: torch.Tensor) -> ParamMeta:
    """The parameter's :class:`ParamMeta`; a replicated dense parameter if none was set."""
    return getattr(param, _ATTRIBUTE, _DEFAULT)
