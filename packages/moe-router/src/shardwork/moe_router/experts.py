"""``GroupedMLP``: the reference expert layer (this rank's experts, optionally ETP-sharded).

Legend: N rows (token copies sorted by expert), L local experts, H hidden, F ffn size per
expert, F_loc = F / etp.

- Batched, no loop over tokens or experts: rows are placed into a zero-padded
  [L, max_rows, H] buffer, two ``bmm`` calls run every expert at once, and rows are read back.
  Padding rows are zeros and never read back, so the result and gradients are exact.
- Gated (SwiGLU: silu(x W_gate) * (x W_up)) or plain (act(x W_up)) MLP without biases.
- Expert tensor parallelism: each ETP rank holds a slice of F for every local expert
  (gate/up columns, down rows) and returns a *partial* sum over its slice; the dispatcher's
  reduce-scatter over ``etp_group`` completes it. ``from_full`` cuts the slices from full
  weights so tests and checkpoint loaders can build any layout.
- Every parameter carries ``is_expert = True`` so optimizers and gradient reduction can
  route expert parameters to the expert data-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwork.moe_router.checks import check_bool, check_same_shape, check_tensor, is_int


class GroupedMLP(torch.nn.Module):
    """``num_local_experts`` MLPs of hidden ``hidden_size`` and ffn ``ffn_hidden_size // etp_size``."""

    def __init__(
        self,
        *,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        etp_size: int = 1,
        gated: bool = True,
        activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_local_experts", num_local_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
            ("etp_size", etp_size),
        ):
            if not is_int(value):
                raise TypeError(
                    f"GroupedMLP.{name}={value!r} is invalid: it must be an integer >= 1 "
                    f"(got {type(value).__name__})"
                )
            if value < 1:
                raise ValueError(
                    f"GroupedMLP.{name}={value!r} is invalid: it must be an integer >= 1"
                )
        check_bool("GroupedMLP.", "gated", gated)
        if ffn_hidden_size % etp_size:
            raise ValueError(
                f"GroupedMLP.ffn_hidden_size={ffn_hidden_size} is invalid: it must be divisible by "
                f"etp_size={etp_size}"
            )
        f_loc = ffn_hidden_size // etp_size
        kw = {"device": device, "dtype": dtype}
        L, H = num_local_experts, hidden_size
        self.gated = gated
        self.activation = activation
        self.w_up = torch.nn.Parameter(torch.empty(L, H, f_loc, **kw))
        self.w_gate = torch.nn.Parameter(torch.empty(L, H, f_loc, **kw)) if gated else None
        self.w_down = torch.nn.Parameter(torch.empty(L, f_loc, H, **kw))
        for p in self.parameters():
            p.is_expert = True
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, init_std)

    @classmethod
    def from_full(
        cls,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        w_gate: torch.Tensor | None = None,
        *,
        ep_rank: int = 0,
        ep_size: int = 1,
        etp_rank: int = 0,
        etp_size: int = 1,
        activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu,
    ) -> GroupedMLP:
        """This rank's shard of full weights ``w_up``/``w_gate`` [E, H, F], ``w_down`` [E, F, H]:
        experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``, ffn slice ``etp_rank`` of ``etp_size``.
        Shapes and ranks are checked first (ValueError naming the argument)."""
        _check_full_weights(w_up, w_down, w_gate)
        _check_rank("ep", ep_rank, ep_size)
        _check_rank("etp", etp_rank, etp_size)
        E, H, F = w_up.shape
        if E % ep_size or F % etp_size:
            raise ValueError(
                f"GroupedMLP.from_full: {E} experts / ffn {F} cannot be split over ep_size={ep_size}, "
                f"etp_size={etp_size}"
            )
        L, f = E // ep_size, F // etp_size
        e_sl, f_sl = slice(ep_rank * L, (ep_rank + 1) * L), slice(etp_rank * f, (etp_rank + 1) * f)
        mlp = cls(
            num_local_experts=L,
            hidden_size=H,
            ffn_hidden_size=F,
            etp_size=etp_size,
            gated=w_gate is not None,
            activation=activation,
            dtype=w_up.dtype,
        )
        with torch.no_grad():
            mlp.w_up.copy_(w_up[e_sl, :, f_sl])
            mlp.w_down.copy_(w_down[e_sl, f_sl, :])
            if w_gate is not None:
                mlp.w_gate.copy_(w_gate[e_sl, :, f_sl])
        return mlp

    def forward(self, tokens_NH: torch.Tensor, tokens_per_expert_L: torch.Tensor) -> torch.Tensor:
        """Run each expert on its consecutive block of rows; returns [N, H] (a partial sum over
        this rank's ffn slice when ETP > 1).

        ``tokens_NH``: [N, H] in the weights' dtype; ``tokens_per_expert_L``: [L] integer
        counts, >= 0, summing to N. The counts are read once, with the largest count that sizes
        the expert buffer: no sync for CPU counts (the dispatchers'), one device-to-host copy
        for device counts (skipped, and the counts unchecked, when N = 0).
        """
        self._check_inputs(tokens_NH, tokens_per_expert_L)
        L = self.w_up.shape[0]
        n = tokens_NH.shape[0]
        if n > 0 or tokens_per_expert_L.device.type == "cpu":
            low, max_rows, total = _count_stats(tokens_per_expert_L)
            _check_counts(low, max_rows, total, n)
        counts = tokens_per_expert_L.to(device=tokens_NH.device, dtype=torch.int64)
        if n == 0:
            # Keep the (empty) input in the graph: the dispatcher's all-to-all backward must run
            # on this rank too, or its peers wait in a collective this rank never joins.
            empty = tokens_NH.new_zeros((0, self.w_down.shape[-1]))
            return empty + 0 * self.w_down.sum() + 0 * tokens_NH.sum()
        # output_size: the checked total, so repeat_interleave needs no sync of its own.
        arange_L = torch.arange(L, device=tokens_NH.device)
        expert_N = torch.repeat_interleave(arange_L, counts, output_size=n)
        starts = torch.cumsum(counts, 0) - counts
        slot_N = torch.arange(n, device=tokens_NH.device) - starts[expert_N]
        padded = tokens_NH.new_zeros((L, max_rows, tokens_NH.shape[1]))
        padded = padded.index_put((expert_N, slot_N), tokens_NH)
        up = torch.bmm(padded, self.w_up)
        if self.gated:
            h = self.activation(torch.bmm(padded, self.w_gate)) * up
        else:
            h = self.activation(up)
        out = torch.bmm(h, self.w_down)
        return out[expert_N, slot_N]

    def _check_inputs(self, tokens_NH: torch.Tensor, tokens_per_expert_L: torch.Tensor) -> None:
        """Shapes and dtypes of :meth:`forward`'s inputs (free: no values read)."""
        L, H = self.w_up.shape[0], self.w_up.shape[1]
        check_tensor("GroupedMLP.forward: ", "tokens_NH", tokens_NH)
        check_tensor("GroupedMLP.forward: ", "tokens_per_expert", tokens_per_expert_L)
        if tokens_NH.dim() != 2 or tokens_NH.shape[1] != H:
            raise ValueError(
                f"GroupedMLP.forward: tokens_NH of shape {tuple(tokens_NH.shape)} is invalid: "
                f"expected [N, H] with H = hidden_size = {H}"
            )
        autocast = torch.is_autocast_enabled(tokens_NH.device.type)  # it casts both operands
        if tokens_NH.dtype != self.w_up.dtype and not autocast:
            raise TypeError(
                f"GroupedMLP.forward: tokens_NH of dtype {tokens_NH.dtype} is invalid: it must "
                f"match the weights' dtype {self.w_up.dtype} (cast the tokens or the module, or "
                "run under torch.autocast)"
            )
        if tokens_per_expert_L.shape != (L,):
            raise ValueError(
                f"GroupedMLP.forward: tokens_per_expert of shape "
                f"{tuple(tokens_per_expert_L.shape)} is invalid: expected ({L},), one count per "
                "local expert"
            )
        if tokens_per_expert_L.is_floating_point() or tokens_per_expert_L.is_complex():
            raise TypeError(
                f"GroupedMLP.forward: tokens_per_expert of dtype {tokens_per_expert_L.dtype} is "
                "invalid: it must hold integer counts"
            )


def _count_stats(counts: torch.Tensor) -> tuple[int, int, int]:
    """(smallest, largest, total) of the counts in one device-to-host copy (none on CPU)."""
    counts = counts.to(torch.int64)
    return tuple(torch.stack((counts.min(), counts.max(), counts.sum())).tolist())


def _check_counts(low: int, high: int, total: int, num_rows: int) -> None:
    """The counts must be >= 0 and cover exactly the ``num_rows`` token rows."""
    if low < 0 or total != num_rows:
        raise ValueError(
            f"GroupedMLP.forward: tokens_per_expert (min {low}, max {high}, sum {total}) is "
            f"invalid for {num_rows} token rows: counts must be >= 0 and sum to the rows of "
            "tokens_NH"
        )


def _check_full_weights(w_up, w_down, w_gate) -> None:
    """``w_up`` [E, H, F], ``w_down`` [E, F, H] and ``w_gate`` (if any) of ``w_up``'s shape."""
    owner = "GroupedMLP.from_full: "
    check_tensor(owner, "w_up", w_up, dims=3)
    check_tensor(owner, "w_down", w_down)
    E, H, F = w_up.shape
    if w_down.shape != (E, F, H):
        raise ValueError(
            f"{owner}w_down of shape {tuple(w_down.shape)} is invalid: expected [E, F, H] = "
            f"{(E, F, H)} from w_up's shape {tuple(w_up.shape)} = [E, H, F]"
        )
    if w_gate is not None:
        check_same_shape(owner, "w_gate", w_gate, "w_up", w_up)


def _check_rank(kind: str, rank: object, size: object) -> None:
    """``size`` an integer >= 1 and ``0 <= rank < size``."""
    if not is_int(size) or size < 1:
        raise ValueError(
            f"GroupedMLP.from_full: {kind}_size={size!r} is invalid: it must be an integer >= 1"
        )
    if not is_int(rank) or not 0 <= rank < size:
        raise ValueError(
            f"GroupedMLP.from_full: {kind}_rank={rank!r} is invalid: it must be an integer in "
            f"[0, {kind}_size={size})"
        )
