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
- Arguments are checked before any work: shapes always (free); checks that read values
  (indices in range, a routed count) run exactly on CPU tensors only, since on an
  accelerator they would cost a host sync; there the docstrings state the contract.
"""

from __future__ import annotations

import torch

from shardwork.moe_router.checks import check_same_shape, check_tensor, is_int


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
            stable argsort instead of nonzero. It must equal the map's True count: a larger
            value returns rows of unrouted (token, expert) pairs, a smaller one drops routed
            ones. Checked exactly on CPU; on an accelerator only ``0 <= num_out_tokens <=
            T*E`` is checked (the count would need the sync this argument avoids).

    Returns:
        (permuted_NH, permuted_probs_N or None, sorted_indices_N (source token of each row),
        tokens_per_expert_E (int64)).

    Raises ValueError when the map is not [T, E] for the T rows of ``tokens_TH``, when
    ``probs_TE`` is not the map's shape, or for a bad ``num_out_tokens``.
    """
    _check_permute_args(tokens_TH, routing_map_TE, probs_TE, num_out_tokens)
    num_tokens = routing_map_TE.shape[0]
    # [T, E] -> [E, T]: flattening then gives expert-major order, token order inside each expert.
    map_ET = routing_map_TE.bool().t().contiguous()
    tokens_per_expert_E = map_ET.sum(dim=1)
    if num_out_tokens is not None and map_ET.device.type == "cpu":
        routed = int(tokens_per_expert_E.sum())
        if num_out_tokens != routed:
            raise ValueError(
                f"permute: num_out_tokens={num_out_tokens} is invalid: the routing map routes "
                f"{routed} (token, expert) pairs; pass that count or None"
            )
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
    return permuted, permuted_probs, sorted_indices, tokens_per_expert_E


def _check_permute_args(tokens_TH, routing_map_TE, probs_TE, num_out_tokens) -> None:
    """Shape checks of :func:`permute` (no tensor values read)."""
    owner = "permute: "
    check_tensor(owner, "tokens_TH", tokens_TH)
    check_tensor(owner, "routing_map_TE", routing_map_TE, dims=2)
    num_tokens, num_experts = routing_map_TE.shape
    if tokens_TH.dim() < 1 or tokens_TH.shape[0] != num_tokens:
        raise ValueError(
            f"permute: routing_map_TE of shape {tuple(routing_map_TE.shape)} is invalid for "
            f"tokens_TH of shape {tuple(tokens_TH.shape)}: it must have one row per token"
        )
    if probs_TE is not None:
        check_same_shape(owner, "probs_TE", probs_TE, "routing_map_TE", routing_map_TE)
    if num_out_tokens is not None and (
        not is_int(num_out_tokens) or not 0 <= num_out_tokens <= num_tokens * num_experts
    ):
        raise ValueError(
            f"permute: num_out_tokens={num_out_tokens!r} is invalid: it must be None or the "
            f"routed pair count, an integer from 0 to T*E = {num_tokens * num_experts}"
        )


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

    Checked first (ValueError): ``num_tokens`` an integer >= 0, ``sorted_indices_N`` of shape
    [N] for the N rows of ``permuted_NH``, ``probs_N`` of shape [N]; on CPU also every index
    in ``[0, num_tokens)`` (on an accelerator that would cost a host sync: an index out of
    range there fails inside ``index_add``).
    """
    _check_unpermute_args(permuted_NH, sorted_indices_N, num_tokens, probs_N)
    acc = _acc(permuted_NH, probs_N)
    return _Unpermute.apply(permuted_NH, sorted_indices_N, probs_N, num_tokens, acc)


def _check_unpermute_args(permuted_NH, sorted_indices_N, num_tokens, probs_N) -> None:
    """Shape checks of :func:`unpermute`; the index range only on CPU (no sync)."""
    owner = "unpermute: "
    if not is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"{owner}num_tokens={num_tokens!r} is invalid: it must be an integer >= 0")
    check_tensor(owner, "permuted_NH", permuted_NH)
    check_tensor(owner, "sorted_indices_N", sorted_indices_N)
    rows = (permuted_NH.shape[0],) if permuted_NH.dim() >= 1 else ()
    if not rows or sorted_indices_N.shape != rows:
        raise ValueError(
            f"{owner}sorted_indices_N of shape {tuple(sorted_indices_N.shape)} is invalid for "
            f"permuted_NH of shape {tuple(permuted_NH.shape)}: it must be [N], one source "
            "token per row"
        )
    if sorted_indices_N.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"{owner}sorted_indices_N of dtype {sorted_indices_N.dtype} is invalid: it must be "
            "int64 or int32 (token indices)"
        )
    if probs_N is not None:
        check_tensor(owner, "probs_N", probs_N)
        if probs_N.shape != rows:
            raise ValueError(
                f"{owner}probs_N of shape {tuple(probs_N.shape)} is invalid: it must be "
                f"[N] = {rows}, one probability per row of permuted_NH"
            )
    if sorted_indices_N.device.type == "cpu" and sorted_indices_N.numel() > 0:
        low, high = (int(v) for v in torch.aminmax(sorted_indices_N))
        if low < 0 or high >= num_tokens:
            raise ValueError(
                f"{owner}num_tokens={num_tokens} is invalid for sorted_indices_N holding tokens "
                f"{low}..{high}: every index must be in [0, num_tokens)"
            )


def pad_routing_map(routing_map_TE: torch.Tensor, multiple: int) -> torch.Tensor:
    """Round every expert's token count up to a multiple of ``multiple`` (extra slots are the
    earliest tokens not routed to that expert; their probability is zero).

    ``multiple`` must be an integer >= 1. The contract needs, for every expert, its count
    rounded up to ``multiple`` to fit in the T tokens; on CPU a map where it does not raises
    ValueError naming the expert. On an accelerator that check would cost a host sync and is
    skipped: such an expert then gets every free token, a count short of the multiple.
    """
    if not is_int(multiple) or multiple < 1:
        raise ValueError(
            f"pad_routing_map: multiple={multiple!r} is invalid: it must be an integer >= 1"
        )
    check_tensor("pad_routing_map: ", "routing_map_TE", routing_map_TE, dims=2)
    routed = routing_map_TE.bool()
    counts_E = routed.sum(dim=0)
    if routed.device.type == "cpu":
        _check_padding_fits(counts_E, multiple, routed.shape[0])
    # Slots each expert lacks to reach the next multiple: (-count) mod multiple.
    need_E = (-counts_E) % multiple
    free = ~routed
    # Per expert column, the first need_E tokens not routed there become zero-probability slots.
    extra = free & (torch.cumsum(free.to(torch.int32), dim=0) <= need_E)
    return routed | extra


def _check_padding_fits(counts_E: torch.Tensor, multiple: int, num_tokens: int) -> None:
    """ValueError when an expert's count rounded up to ``multiple`` exceeds the T tokens."""
    padded_E = (counts_E + multiple - 1) // multiple * multiple
    over = (padded_E > num_tokens).nonzero().flatten()
    if over.numel():
        e = int(over[0])
        raise ValueError(
            f"pad_routing_map: multiple={multiple} is invalid for this map: expert {e} has "
            f"{int(counts_E[e])} tokens, and the next multiple, {int(padded_E[e])}, exceeds the "
            f"{num_tokens} tokens there are; use a multiple whose round-up fits T={num_tokens} "
            "(e.g. a divisor of T), or more tokens"
        )
