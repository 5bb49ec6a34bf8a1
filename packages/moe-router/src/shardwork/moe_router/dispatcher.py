"""Token dispatchers for expert parallelism (EP) combined with expert tensor parallelism (ETP).

Legend: T local tokens, H hidden, E experts, L = E / ep local experts, N rows for local experts.

Layout: EP rank r holds experts [r*L, (r+1)*L); the ETP ranks of an EP rank hold slices of
those experts' ffn dimension and hold *different tokens* (as with sequence parallelism).
Both dispatchers have the same two calls::

    dispatched, handle = dispatcher.dispatch(hidden, probs_TE, routing_map_TE)
    expert_out_NH = experts(dispatched.tokens, dispatched.tokens_per_expert)
    out = dispatcher.combine(expert_out_NH, handle)     # probs applied here

  or, with experts that weight their own outputs (Megatron's ``per_token_scale``: the probs
  multiply an ``[N, F]`` activation inside the expert instead of an ``[N, H]`` output)::

    dispatched, handle = dispatcher.dispatch(hidden, probs_TE, routing_map_TE, with_probs=True)
    expert_out_NH = experts(dispatched.tokens, dispatched.tokens_per_expert, dispatched.probs)
    out = dispatcher.combine(expert_out_NH, handle, apply_probs=False)

- ``AllGatherDispatcher``: all-gather tokens, probs and map over ETP then EP, keep the rows for
  local experts; combine = unpermute then reduce-scatter over EP then ETP (which also sums the
  ETP partial outputs). Simple, static shapes; moves every token to every rank.
- ``AllToAllDispatcher``: permute by expert, exchange token counts (one small all-gather over
  ETP and EP, a host sync), all-to-all over EP, all-gather (uneven) over ETP, sort rows by
  local expert; combine runs the exact reverse (reduce-scatter over ETP sums the partials).
- ``tp_group`` (optional): a dense tensor-parallel group over which ``hidden`` is *replicated*
  (no sequence parallelism). Each TP rank then dispatches only its 1/TP share of the tokens and
  the output is all-gathered back; gradients stay exact.
- The handle keeps per-call state, so several micro-batches can be in flight.
- The first ``dispatch`` of each dispatcher checks, in one small all-gather over ETP and one
  over EP, that every rank uses the same number of experts, hidden size and dtypes: a rank
  that differs would otherwise abort the process inside a collective (gloo: "Received data
  size doesn't match"). Every rank then raises the same ValueError. Later calls skip it.
- Only torch.distributed collectives, wrapped in the autograd ops of ``comm.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwork.moe_router.checks import check_tensor, is_int
from shardwork.moe_router.comm import (
    all_gather_rows,
    all_to_all_rows,
    gather_rows_replicated,
    group_rank,
    group_size,
    reduce_scatter_rows,
    split_rows,
)
from shardwork.moe_router.permute import permute, unpermute


@dataclass
class Dispatched:
    """What the local experts receive."""

    tokens: torch.Tensor
    """[N, H] token copies, grouped by local expert (expert-major)."""
    tokens_per_expert: torch.Tensor
    """[L] int64 rows per local expert (on CPU)."""
    probs: torch.Tensor | None = None
    """[N] routing probability of each row, aligned with ``tokens`` (``dispatch(...,
    with_probs=True)``; None otherwise): for experts that weight their own outputs, after which
    ``combine(..., apply_probs=False)`` must not weight them again."""


@dataclass
class DispatchHandle:
    """Per-call state that ``combine`` needs (opaque to callers)."""

    hidden_shape: torch.Size
    num_rows: int
    sorted_indices: torch.Tensor
    permuted_probs: torch.Tensor
    ep_input_sizes: list[int] | None = None
    ep_output_sizes: list[int] | None = None
    etp_sizes: list[int] | None = None
    row_order: torch.Tensor | None = None


# Every torch dtype, in a fixed order: a dtype's index is the same number on every rank.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


class _Dispatcher:
    def __init__(self, num_experts: int, *, ep_group=None, etp_group=None, tp_group=None) -> None:
        ep = group_size(ep_group)
        if not is_int(num_experts):
            raise TypeError(
                f"{type(self).__name__}: num_experts={num_experts!r} is invalid: it must be an "
                f"integer (got {type(num_experts).__name__})"
            )
        if num_experts < 1 or num_experts % ep:
            raise ValueError(
                f"num_experts={num_experts!r} is invalid: it must be a positive multiple of the "
                f"ep_group size ({ep})"
            )
        self.num_experts = num_experts
        self.ep_group, self.etp_group, self.tp_group = ep_group, etp_group, tp_group
        self.ep_size, self.ep_rank = ep, group_rank(ep_group)
        self.etp_size, self.etp_rank = group_size(etp_group), group_rank(etp_group)
        self.num_local_experts = num_experts // ep
        self.local_start = self.ep_rank * self.num_local_experts
        self._ranks_agree = False  # set by the first dispatch's check

    @property
    def local_expert_indices(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.local_start, self.local_start + self.num_local_experts)

    def _flatten(self, hidden, probs_TE, routing_map_TE):
        if routing_map_TE.shape != probs_TE.shape or probs_TE.shape[-1] != self.num_experts:
            raise ValueError(
                f"probs {tuple(probs_TE.shape)} / routing_map {tuple(routing_map_TE.shape)} are "
                f"invalid: both must be [T, num_experts={self.num_experts}]"
            )
        h = hidden.reshape(-1, hidden.shape[-1])
        if h.shape[0] != probs_TE.shape[0]:
            raise ValueError(
                f"hidden has {h.shape[0]} tokens but probs has {probs_TE.shape[0]} rows"
            )
        if not self._ranks_agree:
            self._check_ranks_agree(h, probs_TE)
        if self.tp_group is not None and group_size(self.tp_group) > 1:
            # hidden is replicated over TP: each TP rank dispatches only its 1/TP of the tokens (so
            # no token is processed TP times); _finish gathers the outputs back.
            h = split_rows(h, self.tp_group)
            probs_TE = split_rows(probs_TE, self.tp_group)
            routing_map_TE = routing_map_TE.chunk(group_size(self.tp_group))[
                group_rank(self.tp_group)
            ]
        return h, probs_TE, routing_map_TE

    def _check_ranks_agree(self, h: torch.Tensor, probs_TE: torch.Tensor) -> None:
        """One all-gather of (num_experts, hidden size, dtype codes) over ETP and over EP; every
        rank raises the same ValueError when they differ (instead of a collective that aborts
        the process on mismatched sizes). Run once per dispatcher."""
        mine = (
            self.num_experts,
            h.shape[-1],
            _DTYPES.index(h.dtype),
            _DTYPES.index(probs_TE.dtype),
        )
        for name, group in (("etp_group", self.etp_group), ("ep_group", self.ep_group)):
            world = group_size(group)
            if world == 1:
                continue
            local = torch.tensor(mine, dtype=torch.int64, device=h.device)
            every = torch.empty(world * len(mine), dtype=torch.int64, device=h.device)
            dist.all_gather_into_tensor(every, local, group=group)
            values = [tuple(v) for v in every.view(world, len(mine)).tolist()]
            if len(set(values)) > 1:
                raise ValueError(self._disagreement(name, values))
        self._ranks_agree = True

    def _disagreement(self, group_name: str, values: list[tuple[int, ...]]) -> str:
        """The error naming each distinct setting and the ranks (in the group) that use it."""
        ranks: dict[tuple[int, ...], list[int]] = {}
        for rank, value in enumerate(values):
            ranks.setdefault(value, []).append(rank)
        settings = "; ".join(
            f"ranks {r}: num_experts={e}, hidden size={hs}, hidden dtype={_DTYPES[hd]}, "
            f"probs dtype={_DTYPES[pd]}"
            for (e, hs, hd, pd), r in ranks.items()
        )
        return (
            f"{type(self).__name__}.dispatch: the ranks of {group_name} disagree ({settings}): "
            "every rank must dispatch with the same num_experts, hidden size and dtypes"
        )

    def _expert_rows(self, handle: DispatchHandle) -> int:
        """Rows the local experts received from the dispatch that made ``handle``."""
        return handle.sorted_indices.shape[0]

    def _check_combine_input(self, expert_out_NH: torch.Tensor, handle: DispatchHandle) -> None:
        """``expert_out_NH`` must be [N, H]: the rows this handle's dispatch returned."""
        name = f"{type(self).__name__}.combine: "
        if not isinstance(handle, DispatchHandle):
            raise TypeError(
                f"{name}handle={handle!r} is invalid: pass the DispatchHandle that dispatch "
                "returned"
            )
        check_tensor(name, "expert_out_NH", expert_out_NH)
        expected = (self._expert_rows(handle), handle.hidden_shape[-1])
        if expert_out_NH.shape != expected:
            raise ValueError(
                f"{name}expert_out_NH of shape {tuple(expert_out_NH.shape)} is invalid: "
                f"expected [N, H] = {expected}, one row per row dispatch returned for this "
                "handle, H the dispatched hidden size"
            )

    def _finish(self, out_TH: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        if self.tp_group is not None:
            out_TH = gather_rows_replicated(out_TH, self.tp_group)
        return out_TH.view(handle.hidden_shape)


class AllGatherDispatcher(_Dispatcher):
    """All-gather based dispatch over ETP × EP (see module docstring)."""

    def dispatch(
        self,
        hidden: torch.Tensor,
        probs_TE: torch.Tensor,
        routing_map_TE: torch.Tensor,
        *,
        with_probs: bool = False,
    ) -> tuple[Dispatched, DispatchHandle]:
        """Gather all tokens of the ETP×EP ranks and keep those routed to local experts
        (``with_probs``: also return each row's probability, ``Dispatched.probs``)."""
        h, probs_TE, map_TE = self._flatten(hidden, probs_TE, routing_map_TE)
        # Gather ETP then EP: rows end up [ep][etp][T], the order combine's reduce-scatters (EP then
        # ETP) undo, so each rank gets back exactly its own tokens.
        h = all_gather_rows(all_gather_rows(h, self.etp_group), self.ep_group)
        probs_TE = all_gather_rows(all_gather_rows(probs_TE, self.etp_group), self.ep_group)
        with torch.no_grad():
            m = map_TE.to(torch.uint8)
            map_TE = all_gather_rows(all_gather_rows(m, self.etp_group), self.ep_group).bool()
        local = slice(self.local_start, self.local_start + self.num_local_experts)
        permuted, pprobs, idx, counts = permute(h, map_TE[:, local], probs_TE=probs_TE[:, local])
        handle = DispatchHandle(hidden.shape, h.shape[0], idx, pprobs)
        # The gathered rows are permuted here, so the permuted probs are already row-aligned.
        return Dispatched(permuted, counts.cpu(), pprobs if with_probs else None), handle

    def combine(
        self, expert_out_NH: torch.Tensor, handle: DispatchHandle, *, apply_probs: bool = True
    ) -> torch.Tensor:
        """Weight by probs, sum back to tokens, reduce-scatter over EP then ETP."""
        self._check_combine_input(expert_out_NH, handle)
        out = unpermute(
            expert_out_NH,
            handle.sorted_indices,
            num_tokens=handle.num_rows,
            probs_N=handle.permuted_probs if apply_probs else None,
        )
        # Reverse of dispatch's gathers; the ETP sum also adds the partial outputs of the ETP ranks'
        # ffn slices.
        out = reduce_scatter_rows(reduce_scatter_rows(out, self.ep_group), self.etp_group)
        return self._finish(out, handle)


class AllToAllDispatcher(_Dispatcher):
    """All-to-all over EP plus all-gather over ETP (see module docstring)."""

    def _expert_rows(self, handle: DispatchHandle) -> int:
        # After an exchange the expert rows are the received ones (row_order sorts them).
        if handle.row_order is not None:
            return handle.row_order.shape[0]
        return handle.sorted_indices.shape[0]

    def _counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """[ep, etp, E] token counts of every rank of the ETP×EP grid (host copy)."""
        with torch.no_grad():
            c = all_gather_rows(counts_E.view(1, -1), self.etp_group)
            c = all_gather_rows(c, self.ep_group)
        return c.view(self.ep_size, self.etp_size, self.num_experts).cpu()

    def dispatch(
        self,
        hidden: torch.Tensor,
        probs_TE: torch.Tensor,
        routing_map_TE: torch.Tensor,
        *,
        with_probs: bool = False,
    ) -> tuple[Dispatched, DispatchHandle]:
        """Send each token copy to the EP rank of its expert, share rows across ETP
        (``with_probs``: the rows' probabilities travel with them, ``Dispatched.probs``)."""
        h, probs_TE, map_TE = self._flatten(hidden, probs_TE, routing_map_TE)
        permuted, pprobs, idx, counts_E = permute(h, map_TE, probs_TE=probs_TE)
        handle = DispatchHandle(hidden.shape, h.shape[0], idx, pprobs)
        L = self.num_local_experts
        # Nothing to exchange: the permuted rows are already this rank's expert inputs.
        if self.ep_size == 1 and self.etp_size == 1:
            return Dispatched(permuted, counts_E.cpu(), pprobs if with_probs else None), handle
        C = self._counts(counts_E)  # [ep, etp, E]
        local = C[:, :, self.local_start : self.local_start + L]  # [ep, etp, L]
        # permute's output is expert-major, so the rows for each EP rank's L experts are contiguous.
        handle.ep_input_sizes = counts_E.cpu().view(self.ep_size, L).sum(1).tolist()
        # Rows received from each EP rank: its count (at this ETP rank) for this rank's L experts.
        handle.ep_output_sizes = local[:, self.etp_rank].sum(-1).tolist()
        # Rows each ETP rank got from its all-to-all, the block sizes of the uneven all-gather.
        handle.etp_sizes = local.sum(dim=(0, 2)).tolist()
        # Rows arrive as chunks ordered (src etp, src ep, local expert); reorder to
        # (local expert, src etp, src ep) with one stable sort of a per-row key.
        sizes_iJl = local.permute(1, 0, 2).reshape(-1)
        new_order = torch.arange(sizes_iJl.numel()).view(self.etp_size, self.ep_size, L)
        chunk_key = _rank_of(new_order.permute(2, 0, 1).reshape(-1))
        row_key = torch.repeat_interleave(chunk_key, sizes_iJl)
        handle.row_order = torch.argsort(row_key, stable=True).to(permuted.device)
        x = self._exchange(permuted, handle)
        # [N] -> [N, 1] -> exchanged exactly like the token rows (differentiable) -> [N].
        probs = self._exchange(pprobs.unsqueeze(-1), handle).squeeze(-1) if with_probs else None
        return Dispatched(x, local.sum(dim=(0, 1)), probs), handle

    def _exchange(self, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Permuted rows -> this rank's expert rows: all-to-all over EP, all-gather over ETP,
        sorted by local expert (``handle``'s sizes and order)."""
        x = all_to_all_rows(
            rows,
            self.ep_group,
            output_sizes=handle.ep_output_sizes,
            input_sizes=handle.ep_input_sizes,
        )
        x = all_gather_rows(x, self.etp_group, handle.etp_sizes)
        return x.index_select(0, handle.row_order)

    def combine(
        self, expert_out_NH: torch.Tensor, handle: DispatchHandle, *, apply_probs: bool = True
    ) -> torch.Tensor:
        """Reverse of dispatch; probs are applied on the way back to the source tokens."""
        self._check_combine_input(expert_out_NH, handle)
        y = expert_out_NH
        if handle.row_order is not None:
            # inverse = argsort(row_order): undoes the (local expert, src etp, src ep) sort.
            inverse = torch.empty_like(handle.row_order)
            inverse[handle.row_order] = torch.arange(
                handle.row_order.numel(), device=inverse.device
            )
            y = y.index_select(0, inverse)
            # Reduce-scatter over ETP sums the ffn-slice partial outputs and keeps this rank's rows.
            y = reduce_scatter_rows(y, self.etp_group, handle.etp_sizes)
            # The reverse exchange: the dispatch's input and output sizes swap roles.
            y = all_to_all_rows(
                y,
                self.ep_group,
                output_sizes=handle.ep_input_sizes,
                input_sizes=handle.ep_output_sizes,
            )
        out = unpermute(
            y,
            handle.sorted_indices,
            num_tokens=handle.num_rows,
            probs_N=handle.permuted_probs if apply_probs else None,
        )
        return self._finish(out, handle)


def _rank_of(order: torch.Tensor) -> torch.Tensor:
    """``rank[order[k]] = k``: the position each chunk takes in the new order."""
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return rank
