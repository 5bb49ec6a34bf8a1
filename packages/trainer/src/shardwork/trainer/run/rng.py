"""Random state of a run: saved per rank, restored at the same layout, re-derived otherwise.

- A rank's *role* is its position in the layout (pp, tp, cp, dp, ep ranks).
  At the same layout a resumed rank gets back exactly the state it saved
  (torch CPU and CUDA generators, plus the model's dropout tracker via the
  caller), so a resumed run continues bit-for-bit.
- RNG state cannot be resharded: after a layout change each rank re-derives
  its state from (seed, step, role) with :func:`derived_seed`, and the
  trainer logs a notice saying so.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def rank_role(groups) -> dict[str, int]:
    return {name: groups.rank(name) for name in ("pp", "tp", "cp", "dp", "ep")}


def derived_seed(seed: int, step: int, role: dict[str, int]) -> int:
    """A 63-bit seed that depends on the run seed, the step and the rank's role."""
    # Sorted names: the seed does not depend on the role dict's insertion order.
    text = f"{seed}|{step}|" + "|".join(f"{k}={role[k]}" for k in sorted(role))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def seed_everything(seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def capture_rng(device: torch.device) -> dict[str, Any]:
    state = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)
