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
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"GroupedMLP.{name}={value!r} is invalid: it must be an integer >= 1"
                )
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
        experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``, ffn slice ``etp_rank`` of ``etp_size``."""
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
        this rank's ffn slice when ETP > 1)."""
        counts = tokens_per_expert_L.to(device=tokens_NH.device, dtype=torch.int64)
        L = self.w_up.shape[0]
        if counts.numel() != L:
            raise ValueError(
                f"tokens_per_expert has {counts.numel()} entries, expected {L} local experts"
            )
        n = tokens_NH.shape[0]
        if n == 0:
            # Keep the (empty) input in the graph: the dispatcher's all-to-all backward must run
            # on this rank too, or its peers wait in a collective this rank never joins.
            empty = tokens_NH.new_zeros((0, self.w_down.shape[-1]))
            return empty + 0 * self.w_down.sum() + 0 * tokens_NH.sum()
        expert_N = torch.repeat_interleave(torch.arange(L, device=tokens_NH.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot_N = torch.arange(n, device=tokens_NH.device) - starts[expert_N]
        max_rows = int(counts.max())
        padded = tokens_NH.new_zeros((L, max_rows, tokens_NH.shape[1]))
        padded = padded.index_put((expert_N, slot_N), tokens_NH)
        up = torch.bmm(padded, self.w_up)
        if self.gated:
            h = self.activation(torch.bmm(padded, self.w_gate)) * up
        else:
            h = self.activation(up)
        out = torch.bmm(h, self.w_down)
        return out[expert_N, slot_N]
