"""Forward-backward schedules with Megatron's calling convention, for any trainer.

- ``forward_step_func(data_iterator, model_chunk) -> (output, loss_fn)`` and
  ``loss_fn(output) -> (loss_sum, num_tokens, logs)``: the loss is *summed* over the
  microbatch's tokens, never averaged, so means stay exact with unequal token counts.
- Backward starts from ``loss_sum * grad_scale``. With ``grad_scale=1`` (the default)
  gradients are sums over tokens; :func:`finalize_model_grads` with ``num_tokens=``
  divides them by the global token count afterwards, giving exactly the gradient of the
  global per-token mean. A caller that knows the global token count up front may pass
  ``grad_scale=1 / global_tokens`` instead (and an fp16 loss scale multiplies in here).
- Every schedule returns the :class:`MicrobatchLoss` of each microbatch on the last
  pipeline stage (an empty list on other stages); ``forward_only=True`` runs no backward.
- Model chunks receive activations through ``set_input_tensor(tensor)``; with ``vpp``
  chunks per rank, ``model`` and ``data_iterator`` are lists with one entry per chunk.
- Gradient accumulation: all but a chunk's last microbatch backward run under the chunk's
  ``no_sync()`` when it has one (DDP wrappers), so gradients are reduced once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwork.models.pipeline.execute import (
    ForwardStepFunc,
    evaluate_loss,
    no_sync,
    run_pipeline,
    set_input_tensor,
)
from shardwork.models.pipeline.losses import MicrobatchLoss

Schedule = Callable[..., list[MicrobatchLoss]]


def _chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ValueError(
            f"model={model!r} is invalid: it must be an nn.Module or a non-empty list of them "
            "(one per virtual pipeline chunk)"
        )
    return chunks


def _iterators(data_iterator: Any, num_chunks: int) -> list[Any]:
    if data_iterator is None:  # stages whose forward step reads no data (middle stages)
        return [None] * num_chunks
    if isinstance(data_iterator, list | tuple):
        if len(data_iterator) != num_chunks:
            raise ValueError(
                f"data_iterator is a list of {len(data_iterator)} but the model has {num_chunks} "
                "chunks: give one iterator per chunk"
            )
        return list(data_iterator)
    if num_chunks > 1:
        raise ValueError(
            f"data_iterator must be a list of {num_chunks} iterators (one per model chunk) with "
            "virtual pipeline chunks; each yields the microbatches in order"
        )
    return [data_iterator]


def _check_microbatches(num_microbatches: object) -> None:
    if (
        not isinstance(num_microbatches, int)
        or isinstance(num_microbatches, bool)
        or num_microbatches < 1
    ):
        raise ValueError(
            f"num_microbatches={num_microbatches!r} is invalid: it must be an integer >= 1"
        )


def _first_param(chunks: Sequence[nn.Module]) -> torch.Tensor | None:
    for chunk in chunks:
        for param in chunk.parameters():
            if param.is_floating_point():
                return param
    return None


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    pp_group=None,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    forward_only: bool = False,
    grad_scale: float = 1.0,
) -> list[MicrobatchLoss]:
    """Gradient accumulation over ``num_microbatches`` without pipeline parallelism.

    The first ``num_microbatches - 1`` forward/backward passes run inside
    ``model.no_sync()`` (if the model has it); the last one outside, so a DDP wrapper
    reduces gradients once. ``pp_group``, ``tensor_shape``, ``dtype`` and ``device`` are
    accepted for a uniform signature; ``pp_group`` must be None or of size 1.
    """
    del tensor_shape, dtype, device
    _check_microbatches(num_microbatches)
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"forward_backward_no_pipelining takes one model chunk, got {len(chunks)}")
    if pp_group is not None and dist.get_world_size(pp_group) != 1:
        raise ValueError(
            f"forward_backward_no_pipelining needs pp size 1, got {dist.get_world_size(pp_group)}: "
            "use get_schedule(pp_size, vpp)"
        )
    (chunk,) = chunks
    (iterator,) = _iterators(data_iterator, 1)
    losses: list[MicrobatchLoss] = []

    def step(m: int) -> None:
        set_input_tensor(chunk, None)
        with torch.no_grad() if forward_only else torch.enable_grad():
            output, loss_fn = forward_step_func(iterator, chunk)
            loss_sum, record = evaluate_loss(loss_fn, output, microbatch=m)
        losses.append(record)
        if not forward_only:
            (loss_sum if grad_scale == 1.0 else loss_sum * grad_scale).backward()

    if forward_only:
        for m in range(num_microbatches):
            step(m)
        return losses
    with no_sync(chunk):
        for m in range(num_microbatches - 1):
            step(m)
    step(num_microbatches - 1)
    return losses


def _pipelined(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    chunks: list[nn.Module],
    num_microbatches: int,
    pp_group,
    tensor_shape: Sequence[int] | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    forward_only: bool,
    grad_scale: float,
) -> list[MicrobatchLoss]:
    _check_microbatches(num_microbatches)
    iterators = _iterators(data_iterator, len(chunks))
    if pp_group is None:
        raise ValueError("pp_group=None is invalid for a pipelined schedule: pass the pp group")
    param = _first_param(chunks)
    if dtype is None:
        dtype = param.dtype if param is not None else torch.get_default_dtype()
    if device is None:
        device = param.device if param is not None else torch.device("cpu")
    if tensor_shape is not None and (
        not all(isinstance(s, int) and s >= 1 for s in tensor_shape) or not tensor_shape
    ):
        raise ValueError(
            f"tensor_shape={tensor_shape!r} is invalid: it must be a non-empty sequence of "
            "positive ints (e.g. (seq, micro_batch, hidden)) or None to exchange shapes"
        )
    return run_pipeline(
        forward_step_func=forward_step_func,
        data_iterators=iterators,
        chunks=chunks,
        num_microbatches=num_microbatches,
        pp_group=pp_group,
        tensor_shape=tensor_shape,
        dtype=dtype,
        device=torch.device(device),
        forward_only=forward_only,
        grad_scale=grad_scale,
    )


def forward_backward_1f1b(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    pp_group,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    forward_only: bool = False,
    grad_scale: float = 1.0,
) -> list[MicrobatchLoss]:
    """One-forward-one-backward pipeline over the ``pp_group`` (one model chunk per rank).

    ``tensor_shape``/``dtype``: shape and dtype of every activation sent between stages
    (default dtype: the model's first floating parameter's); ``tensor_shape=None``
    exchanges each activation's shape with it. ``device``: where received activations
    are placed (default: the model's). Every rank of the pp group calls this with the
    same ``num_microbatches``, ``tensor_shape`` and ``forward_only``.
    """
    chunks = _chunks(model)
    if len(chunks) != 1:
        raise ValueError(
            f"forward_backward_1f1b takes one model chunk per rank, got {len(chunks)}: use "
            "forward_backward_interleaved_1f1b for virtual pipeline chunks"
        )
    return _pipelined(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        chunks=chunks,
        num_microbatches=num_microbatches,
        pp_group=pp_group,
        tensor_shape=tensor_shape,
        dtype=dtype,
        device=device,
        forward_only=forward_only,
        grad_scale=grad_scale,
    )


def forward_backward_interleaved_1f1b(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    pp_group,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    forward_only: bool = False,
    grad_scale: float = 1.0,
) -> list[MicrobatchLoss]:
    """Interleaved 1F1B: ``model`` is a list of ``vpp`` chunks, chunk ``c`` of rank ``r``
    being virtual stage ``c·pp + r``; ``data_iterator`` is a list with one iterator per
    chunk. ``num_microbatches`` must be a multiple of the pp size. Other arguments as in
    :func:`forward_backward_1f1b`. The pipeline bubble shrinks by a factor ``vpp``.
    """
    return _pipelined(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        chunks=_chunks(model),
        num_microbatches=num_microbatches,
        pp_group=pp_group,
        tensor_shape=tensor_shape,
        dtype=dtype,
        device=device,
        forward_only=forward_only,
        grad_scale=grad_scale,
    )


def get_schedule(pp_size: int, vpp: int | None = None) -> Schedule:
    """The schedule for a layout: no pipelining (pp 1), 1F1B, or interleaved (vpp > 1).

    All three take the same keyword arguments, so a trainer calls the result uniformly.
    """
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"pp_size={pp_size!r} is invalid: it must be an integer >= 1")
    if vpp is not None and (not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1):
        raise ValueError(f"vpp={vpp!r} is invalid: it must be None or an integer >= 1")
    if pp_size == 1:
        if vpp not in (None, 1):
            raise ValueError(f"vpp={vpp} needs pp_size > 1 (got pp_size=1)")
        return forward_backward_no_pipelining
    if vpp is not None and vpp > 1:
        return forward_backward_interleaved_1f1b
    return forward_backward_1f1b
