"""Test kit: an independent dense MoE reference that integrations can check themselves against.

``dense_moe_reference`` runs *every* expert on *every* token with plain einsums and weights
the results by the router's probabilities — no permutation, no dispatch, no communication —
so any router + dispatcher + experts pipeline (ours or another framework's) can be compared
with it, outputs and gradients, at any parallel layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def dense_moe_reference(
    hidden_TH: torch.Tensor,
    probs_TE: torch.Tensor,
    *,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu,
) -> torch.Tensor:
    """out[t] = sum_e probs[t, e] * MLP_e(hidden[t]) with weights [E, H, F] / [E, F, H].

    Zero probabilities contribute nothing, so dropped or unrouted experts need no mask.
    """
    up_TEF = torch.einsum("th,ehf->tef", hidden_TH, w_up)
    if w_gate is not None:
        h_TEF = activation(torch.einsum("th,ehf->tef", hidden_TH, w_gate)) * up_TEF
    else:
        h_TEF = activation(up_TEF)
    out_TEH = torch.einsum("tef,efh->teh", h_TEF, w_down)
    return torch.einsum("te,teh->th", probs_TE.to(out_TEH.dtype), out_TEH)
