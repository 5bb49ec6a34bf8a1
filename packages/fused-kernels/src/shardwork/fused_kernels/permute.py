"""Token permutation for MoE: group token rows by expert, and the weighted inverse.

- ``permute_tokens`` orders the (token, expert) pairs of ``routing_map [N, E]`` by
  expert, tokens ascending within an expert (Megatron's argsort layout), and keeps
  the first ``num_out_tokens`` of them (default: all routed pairs). Row ``j`` of
  the output is ``tokens[sorted_indices[j]]``.
- ``unpermute_tokens`` sums each token's expert outputs back into ``[N, H]``,
  weighted by ``probs`` when given: permuted probs ``[M]`` (as returned by
  ``permute_tokens``), or dense ``[N, E]`` probs together with ``routing_map``.
  Accumulation is in float32; tokens routed nowhere get zeros.
- The torch reference uses ``index_select`` / ``index_add_`` (autograd differentiates
  them). The Triton backend gathers rows and, for the inverse, sums through a
  per-token table of destination rows (deterministic, no atomics).
"""

from __future__ import annotations

import numbers

import torch

from shardwork.fused_kernels._checks import acc_dtype, check_float, check_int, check_same_device
from shardwork.fused_kernels.backend import resolve_backend

__all__ = ["permute_tokens", "sort_by_expert", "unpermute_tokens"]


def sort_by_expert(routing_map: torch.Tensor, num_out_tokens: int | None = None) -> torch.Tensor:
    """Flat indices into ``routing_map.T`` ([E, N] row-major) of the kept (expert, token) pairs, ``[M]``."""
    flat = routing_map.T.contiguous().reshape(-1).to(torch.int8)
    if num_out_tokens is None:
        num_out_tokens = int(routing_map.sum())
    return flat.argsort(descending=True, stable=True)[:num_out_tokens]


def _check_num_out_tokens(num_out_tokens: int, routing_map: torch.Tensor) -> None:
    """``num_out_tokens`` is an int in ``[0, routed pairs]``; more rows than routed pairs would
    be unrouted (token, expert) pairs. Counting the pairs reads the map: exact on a CPU map,
    only the bound ``N*E`` elsewhere (counting there would be a host-device sync)."""
    check_int("num_out_tokens", num_out_tokens)
    total = routing_map.numel()
    if not 0 <= num_out_tokens <= total:
        raise ValueError(f"num_out_tokens={num_out_tokens} must be in [0, N*E={total}]")
    if routing_map.device.type == "cpu" and not torch.compiler.is_compiling():
        routed = int(routing_map.sum())
        if num_out_tokens > routed:
            raise ValueError(
                f"num_out_tokens={num_out_tokens} exceeds the {routed} routed (token, expert) "
                f"pairs of routing_map; valid: 0 to {routed} (more would return unrouted rows)"
            )


def permute_tokens(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Group ``tokens [N, H]`` by expert: returns (permuted ``[M, H]``, permuted probs ``[M]`` or None, sorted_indices ``[M]``).

    ``num_out_tokens``: keep the first M pairs (default: all routed pairs); at most the number
    of routed pairs (checked on a CPU ``routing_map``; on other devices a larger value is not
    detected, to avoid a host-device sync, and returns rows of unrouted pairs).
    """
    check_float("tokens", tokens)
    if tokens.dim() != 2:
        raise ValueError(f"tokens.shape={tuple(tokens.shape)} must be 2-D [N, H]")
    if (
        routing_map.dtype != torch.bool
        or routing_map.dim() != 2
        or routing_map.shape[0] != tokens.shape[0]
    ):
        raise ValueError(
            f"routing_map (dtype={routing_map.dtype}, shape={tuple(routing_map.shape)}) must be "
            f"bool [N={tokens.shape[0]}, E]"
        )
    if probs is not None and tuple(probs.shape) != tuple(routing_map.shape):
        raise ValueError(
            f"probs.shape={tuple(probs.shape)} must equal routing_map.shape={tuple(routing_map.shape)}"
        )
    check_same_device(tokens=tokens, routing_map=routing_map, probs=probs)
    if num_out_tokens is not None:
        _check_num_out_tokens(num_out_tokens, routing_map)
    chosen = resolve_backend("permute", backend, tokens.device, dtype=tokens.dtype)
    flat = sort_by_expert(routing_map, num_out_tokens)
    sorted_indices = flat % tokens.shape[0]
    permuted_probs = None if probs is None else probs.T.reshape(-1)[flat]
    if chosen == "triton":
        from shardwork.fused_kernels import triton_permute

        permuted = triton_permute.gather_rows(tokens, sorted_indices)
    else:
        permuted = tokens.index_select(0, sorted_indices)
    return permuted, permuted_probs, sorted_indices


def _checked_restore_shape(restore_shape) -> tuple[int, int]:
    """``restore_shape`` as ``(N, H)``: two non-negative ints (a tuple, list or torch.Size)."""
    if not isinstance(restore_shape, (tuple, list, torch.Size)):
        raise TypeError(
            f"restore_shape={restore_shape!r} must be a tuple (N, H) of two ints, e.g. "
            f"tokens.shape, not {type(restore_shape).__name__}"
        )
    if len(restore_shape) != 2:
        raise ValueError(
            f"restore_shape={tuple(restore_shape)!r} must be (N, H): two ints, e.g. tokens.shape"
        )
    for axis, size in zip(("N", "H"), restore_shape):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(
                f"restore_shape={tuple(restore_shape)!r}: {axis}={size!r} must be an int, not "
                f"{type(size).__name__}"
            )
        if size < 0:
            raise ValueError(
                f"restore_shape={tuple(restore_shape)!r}: {axis}={size} must be >= 0 (the shape "
                "of the tokens before permute_tokens)"
            )
    return int(restore_shape[0]), int(restore_shape[1])


def _check_sorted_indices(sorted_indices, num_rows: int, num_tokens: int) -> None:
    """``sorted_indices``: an int64/int32 ``[M]`` tensor of token rows ``[0, N)``. The values are
    checked on a CPU tensor only (elsewhere reading them would be a host-device sync)."""
    if not isinstance(sorted_indices, torch.Tensor) or sorted_indices.dtype not in (
        torch.int64,
        torch.int32,
    ):
        raise ValueError(
            "sorted_indices must be an int64/int32 tensor (as permute_tokens returns), got "
            f"{getattr(sorted_indices, 'dtype', type(sorted_indices).__name__)}"
        )
    if tuple(sorted_indices.shape) != (num_rows,):
        raise ValueError(
            f"sorted_indices.shape={tuple(sorted_indices.shape)} must be ({num_rows},)"
        )
    if sorted_indices.device.type != "cpu" or torch.compiler.is_compiling() or not num_rows:
        return
    bad = (sorted_indices < 0) | (sorted_indices >= num_tokens)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"sorted_indices[{position}]={int(sorted_indices[position])} is not a token row of "
            f"restore_shape[0]={num_tokens}; valid: 0 <= index < {num_tokens}"
        )


def unpermute_tokens(
    permuted: torch.Tensor,
    sorted_indices: torch.Tensor,
    *,
    restore_shape: tuple[int, int] | torch.Size,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Sum rows of ``permuted [M, H]`` back to ``restore_shape = (N, H)``, weighted by ``probs`` if given.

    ``probs``: ``[M]`` permuted probs, or ``[N, E]`` dense probs with ``routing_map``
    (then ``M`` must be the number of routed pairs). Output dtype: ``permuted.dtype``.
    ``sorted_indices``: int64/int32 ``[M]`` token rows, each in ``[0, N)`` (checked on a CPU
    tensor; on other devices an index outside is not detected here, to avoid a host-device
    sync, and fails inside the kernel or ``index_add``).
    """
    check_float("permuted", permuted)
    restore_shape = _checked_restore_shape(restore_shape)
    if permuted.dim() != 2 or permuted.shape[1] != restore_shape[1]:
        raise ValueError(
            f"permuted.shape={tuple(permuted.shape)} must be [M, H] with H = restore_shape[1] "
            f"(restore_shape={restore_shape})"
        )
    _check_sorted_indices(sorted_indices, permuted.shape[0], restore_shape[0])
    sorted_indices = sorted_indices.long()
    if probs is not None and probs.dim() == 2:
        if routing_map is None or tuple(routing_map.shape) != tuple(probs.shape):
            raise ValueError("dense probs [N, E] need routing_map of the same shape")
        probs = probs.T.reshape(-1)[sort_by_expert(routing_map, permuted.shape[0])]
    if probs is not None and tuple(probs.shape) != (permuted.shape[0],):
        raise ValueError(
            f"probs.shape={tuple(probs.shape)} must be ({permuted.shape[0]},) or [N, E]"
        )
    check_same_device(permuted=permuted, sorted_indices=sorted_indices, probs=probs)
    chosen = resolve_backend("unpermute", backend, permuted.device, dtype=permuted.dtype)
    if chosen == "triton":
        from shardwork.fused_kernels import triton_permute

        return triton_permute.scatter_rows(permuted, sorted_indices, probs, restore_shape[0])
    rows = permuted.to(acc_dtype(permuted))
    if probs is not None:
        rows = rows * probs.to(rows.dtype).unsqueeze(-1)
    out = torch.zeros(restore_shape, dtype=rows.dtype, device=permuted.device)
    out = out.index_add(0, sorted_indices, rows)
    return out.to(permuted.dtype)
