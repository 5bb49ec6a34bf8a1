"""Token permutation: group token copies by expert, and the exact inverse (with probabilities).

Legend: T tokens, H hidden, E experts, N routed (token, expert) pairs = routing_map.sum().

- ``permute``: rows of the output are expert-major, token order inside each expert (the
  order Megatron-Core uses). Works for dropless maps, maps with dropped tokens and maps padded
  to capacity (padded slots are just extra True entries with zero probability).
- ``unpermute``: scatter-adds each copy back to its token, optionally weighted by its
  probability (computed in the probabilities' dtype, result cast back).
- Both are index_select / index_add with exact gradients: permute through autograd,
  unpermute through a small hand-written backward (the same operations autograd would run)
  that keeps no row-sized product alive for backward.
- ``pad_routing_map`` rounds each expert's count up to a multiple (FP8/FP4 GEMM alignment)
  by marking the earliest unrouted tokens as zero-probability slots.
"""

from __future__ import annotations

import torch


def permute(
    tokens_TH: torch.Tensor,
    routing_map_TE: torch.Tensor,
    *,
    probs_TE: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Group token copies by expert.

    Args:
        tokens_TH: token vectors.
        routing_map_TE: bool map, True where token t goes to expert e.
        probs_TE: optional combine weights; the selected ones are returned in permuted order.
        num_out_tokens: N when known (e.g. T*K when dropless): avoids a host sync by using a
            stable argsort instead of nonzero.

    Returns:
        (permuted_NH, permuted_probs_N or None, sorted_indices_N (source token of each row),
        tokens_per_expert_E (int64)).
    """
    num_tokens = routing_map_TE.shape[0]
    # [T, E] -> [E, T]: flattening then gives expert-major order, token order inside each expert.
    map_ET = routing_map_TE.bool().t().contiguous()
    if num_out_tokens is None:
        flat = map_ET.reshape(-1).nonzero().squeeze(1)
    else:
        # A stable descending sort of the 0/1 map puts the routed entries first, still in [E, T]
        # order; knowing N in advance avoids nonzero()'s device-to-host sync.
        flat = map_ET.reshape(-1).to(torch.int8).argsort(descending=True, stable=True)
        flat = flat[:num_out_tokens]
    # Flat index e * T + t -> source token t.
    sorted_indices = flat % num_tokens
    permuted_probs = None
    if probs_TE is not None:
        # Same [E, T] flattening as the map, so ``flat`` indexes the matching probabilities.
        permuted_probs = probs_TE.t().reshape(-1).index_select(0, flat)
    permuted = tokens_TH.index_select(0, sorted_indices)
    return permuted, permuted_probs, sorted_indices, map_ET.sum(dim=1)


class _Unpermute(torch.autograd.Function):
    """``out[t] = Σ_rows of t (x_n · p_n)``: index_add forward; backward gathers the output
    gradient per row (and its dot with the row for ``p``). Saves the index (and, with
    probabilities, the rows and probabilities), never a row-sized product."""

    @staticmethod
    def forward(ctx, rows_NH, index_N, probs_N, num_tokens, acc_dtype):
        x = rows_NH if probs_N is None else rows_NH * probs_N.unsqueeze(-1)
        out = torch.zeros((num_tokens, *rows_NH.shape[1:]), dtype=acc_dtype, device=x.device)
        # index_add sums the K copies of each token; tokens dropped for every expert stay zero.
        out.index_add_(0, index_N, x.to(acc_dtype))
        ctx.rows_dtype, ctx.acc_dtype = rows_NH.dtype, acc_dtype
        keep = probs_N is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(index_N, rows_NH if keep else None, probs_N)
        return out.to(rows_NH.dtype)

    @staticmethod
    def backward(ctx, grad_TH):
        index_N, rows_NH, probs_N = ctx.saved_tensors
        # What autograd did through index_add: each row receives its token's gradient (in the
        # summation dtype), times its probability; the probability gets the row's dot with it.
        g_NH = grad_TH.to(ctx.acc_dtype).index_select(0, index_N)
        grad_probs = None
        if rows_NH is not None:
            grad_probs = (g_NH * rows_NH).sum(dim=-1).to(probs_N.dtype)
        grad_rows = g_NH if probs_N is None else g_NH * probs_N.unsqueeze(-1)
        return grad_rows.to(ctx.rows_dtype), None, grad_probs, None, None


def _acc(rows: torch.Tensor, probs_N: torch.Tensor | None) -> torch.dtype:
    """The summation dtype: the product's (type promotion with the probabilities), or float32
    for bf16/fp16 rows without probabilities."""
    if probs_N is not None:
        return torch.promote_types(rows.dtype, probs_N.dtype)
    return torch.float32 if rows.dtype in (torch.bfloat16, torch.float16) else rows.dtype


def unpermute(
    permuted_NH: torch.Tensor,
    sorted_indices_N: torch.Tensor,
    *,
    num_tokens: int,
    probs_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum each token's expert outputs back into token order, weighted by ``probs_N`` if given.

    With probabilities the products are formed in the probabilities' dtype (fp32 when the
    router runs in fp32) and summed there; without them, bf16/fp16 rows are summed in fp32.
    The result has ``permuted_NH``'s dtype. Backward saves only the index (plus the rows and
    probabilities when the probabilities need a gradient).
    """
    acc = _acc(permuted_NH, probs_N)
    return _Unpermute.apply(permuted_NH, sorted_indices_N, probs_N, num_tokens, acc)


def pad_routing_map(routing_map_TE: torch.Tensor, multiple: int) -> torch.Tensor:
    """Round every expert's token count up to a multiple of ``multiple`` (extra slots are the
    earliest tokens not routed to that expert; their probability is zero)."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} is invalid: it must be >= 1")
    routed = routing_map_TE.bool()
    # Slots each expert lacks to reach the next multiple: (-count) mod multiple.
    need_E = (-routed.sum(dim=0)) % multiple
    free = ~routed
    # Per expert column, the first need_E tokens not routed there become zero-probability slots.
    extra = free & (torch.cumsum(free.to(torch.int32), dim=0) <= need_E)
    return routed | extra
