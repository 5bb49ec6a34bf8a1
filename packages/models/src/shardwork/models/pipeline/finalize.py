"""``finalize_model_grads``: the gradient reductions that follow the last backward of a step.

In this order, every rank of the layout calling it:

1. Data parallel: ``chunk.finish_grad_sync()`` on chunks that have it (a DDP wrapper,
   duck-typed). Chunks without it (plain modules) get a summing all-reduce of their
   gradients over dp×cp (expert parameters over edp), unless
   ``reduce_unwrapped_grads=False``.
2. Sequence parallel: gradients of parameters whose ``ParamMeta.sequence_parallel`` is
   True (replicated over TP but fed sequence-sharded activations: norms, QK-norm) are
   summed over the TP group.
3. Shared embedding: with pp > 1, gradients of ``ParamMeta.shared_embedding`` parameters
   (tied embedding / LM head on the first and last stage) are summed over the embedding
   group. Both stages of that group must agree on whether they hold such parameters.
4. MoE: ``moe_tracker.reduce(pp_group=, tp_cp_group=, dp_group=)`` (any object with that
   method; every stage joins), then each of ``moe_hooks`` is called (e.g. an expert-bias
   update).
5. Token scaling: with ``num_tokens`` (this rank's token count: the schedule's total on
   the last stage, 0 elsewhere) the global count is summed over pp and dp×cp and every
   gradient is divided by it, so gradients are those of the global per-token mean loss
   when backward started from loss sums. The data-parallel reduction must then *sum*
   (shardwork's DDP: ``DDPConfig(average_gradients=False)``; an averaging wrapper raises).

Gradients are read from ``param.main_grad`` when a parameter has one, else ``param.grad``;
the collectives are coalesced per (group, dtype, device) into one flat buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwork.parallel_state import ProcessGroups, get_param_meta


def _grad(param: nn.Parameter) -> torch.Tensor | None:
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _grads_or_zeros(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Gradients of ``params``; a missing ``.grad`` becomes zeros so every rank's
    coalesced buffer has the same layout."""
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        g = _grad(p)
        # Zeros instead of skipping: every rank of the group must flatten the same parameters into
        # the coalesced buffer, or the all-reduce would sum misaligned elements (or mismatch in
        # size).
        if g is None:
            p.grad = torch.zeros_like(p)
            g = p.grad
        grads.append(g)
    return grads


def all_reduce_coalesced(grads: Sequence[torch.Tensor], group) -> None:
    """Sum ``grads`` in place over ``group``, one flat all-reduce per (dtype, device)."""
    if group is None or dist.get_world_size(group) == 1 or not grads:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    # Sorted buckets: every rank issues its all-reduces in the same order, or they pair wrongly.
    for _, bucket in sorted(buckets.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _unique_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    params = []
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _embedding_group(groups: ProcessGroups):
    if groups.size("pp") == 1 or "embedding" not in groups.members:
        return None
    return groups.group("embedding")


def finalize_model_grads(
    model_chunks: nn.Module | Sequence[nn.Module],
    groups: ProcessGroups | None,
    *,
    num_tokens: torch.Tensor | float | None = None,
    moe_tracker: Any | None = None,
    moe_hooks: Sequence[Callable[[], None]] = (),
    reduce_unwrapped_grads: bool = True,
) -> torch.Tensor | None:
    """Finish this step's gradient reductions (see the module docstring for the order).

    Returns the global token count (float64 0-dim tensor) when ``num_tokens`` is given,
    else None. ``groups=None`` means one process: only the token scaling (by
    ``num_tokens`` itself) and the MoE hooks apply.
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if num_tokens is not None:
        for chunk in chunks:
            averaging = getattr(getattr(chunk, "config", None), "average_gradients", False)
            if averaging is True and getattr(chunk, "grad_divisor", 1) > 1:
                raise ValueError(
                    f"num_tokens={num_tokens!r} divides gradients by the global token count, but "
                    f"model chunk {type(chunk).__name__} averages them over "
                    f"{chunk.grad_divisor} data-parallel replicas too: build it with "
                    "DDPConfig(average_gradients=False), or pass num_tokens=None"
                )
    if groups is None:
        groups = ProcessGroups.single()
    params = _unique_params(chunks)

    for chunk in chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if callable(finish):
            finish()
        elif reduce_unwrapped_grads:
            own = _unique_params([chunk])
            dense = [p for p in own if not get_param_meta(p).is_expert]
            expert = [p for p in own if get_param_meta(p).is_expert]
            all_reduce_coalesced(_grads_or_zeros(dense), groups.group("dp_cp"))
            # Expert weights are distinct across ep ranks; only their expert-data-parallel replicas
            # hold the same ones.
            all_reduce_coalesced(_grads_or_zeros(expert), groups.group("edp"))

    if groups.size("tp") > 1:
        # Replicated over TP but fed only this rank's tokens (or heads): each TP rank has a partial
        # sum.
        sp = [p for p in params if get_param_meta(p).sequence_parallel]
        all_reduce_coalesced(_grads_or_zeros(sp), groups.group("tp"))

    embedding_group = _embedding_group(groups)
    if embedding_group is not None:
        shared = [p for p in params if get_param_meta(p).shared_embedding]
        all_reduce_coalesced(_grads_or_zeros(shared), embedding_group)

    if moe_tracker is not None:
        moe_tracker.reduce(
            pp_group=groups.group("pp"),
            tp_cp_group=groups.group("tp_cp"),
            dp_group=groups.group("dp"),
        )
    for hook in moe_hooks:
        hook()

    if num_tokens is None:
        return None
    device = params[0].device if params else torch.device("cpu")
    total = torch.as_tensor(num_tokens, dtype=torch.float64).to(device).reshape(())
    # Clone: the all-reduce below is in place and must not overwrite the caller's tensor.
    total = total.clone()
    # Only the last pp stage counts tokens (0 elsewhere), so summing over pp gives every stage the
    # count; then over dp×cp for all replicas. float64 keeps the count exact.
    for group in (groups.group("pp"), groups.group("dp_cp")):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    scale = 1.0 / total
    for g in _grads_or_zeros(params):
        g.mul_(scale.to(g.dtype))
    return total
