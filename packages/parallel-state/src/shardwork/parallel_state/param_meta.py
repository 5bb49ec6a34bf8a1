"""``ParamMeta``: the one description of a parameter's parallel layout.

Every model attaches it to each parameter it creates; the optimizer, the
gradient finaliser and checkpointing read only this (never module types or
parameter names) to decide how a parameter is reduced, sharded and saved.

It is a plain Python attribute of the Parameter object. So is everything else shardwork
packages describe a parameter with (the models' fused-block names, init rule, expert
shards): every such attribute is named ``_shardwork_<what>``. Code that replaces a Parameter
by a new object (FSDP's ``fully_shard`` swaps in DTensor parameters, ``to_empty`` allocates
new ones) must carry them over with :func:`carry_param_attributes`, or
:func:`get_param_meta` silently answers "replicated dense" for the new object;
:func:`has_param_meta` tells the two apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTRIBUTE_PREFIX = "_shardwork_"
"""Prefix of every attribute a shardwork package sets on a Parameter object."""
_ATTRIBUTE = ATTRIBUTE_PREFIX + "param_meta"


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


def has_param_meta(param: torch.Tensor) -> bool:
    """Whether ``param`` carries a :class:`ParamMeta` of its own (:func:`get_param_meta` would
    otherwise return the replicated default)."""
    return isinstance(getattr(param, _ATTRIBUTE, None), ParamMeta)


def carry_param_attributes(source: torch.Tensor, target: torch.Tensor) -> int:
    """Copy every shardwork attribute (``_shardwork_*``: the ParamMeta and the packages' own
    descriptions) of ``source`` onto ``target``, the object that replaces it; returns how many.

    Attributes ``target`` already has are overwritten: the replaced parameter's description is
    the truth about the tensor both stand for."""
    carried = 0
    for name, value in vars(source).items():
        if name.startswith(ATTRIBUTE_PREFIX):
            setattr(target, name, value)
            carried += 1
    return carried
