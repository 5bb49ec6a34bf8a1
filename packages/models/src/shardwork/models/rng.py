"""``RNGTracker``: dropout randomness that is right under tensor parallelism, owned by a model.

- Two named streams: ``"replicated"`` is identical on every TP rank (dropout on activations
  that every TP rank holds whole: the hidden states without sequence parallelism), and
  ``"tensor_parallel"`` differs per TP rank (dropout on sharded activations: attention
  probabilities of local heads, hidden states under sequence parallelism).
- ``fork(name)`` swaps the stream into torch's global RNG of the tracker's device, runs the
  block (so ``F.dropout`` and SDPA's ``dropout_p`` draw from it), saves the advanced state
  and restores the global RNG. Nothing is module-level: each model owns its tracker.
- ``get_states``/``set_states`` let activation recompute replay the exact draws
  (see :mod:`shardwork.models.recompute`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["REPLICATED", "TENSOR_PARALLEL", "RNGTracker"]

REPLICATED = "replicated"
TENSOR_PARALLEL = "tensor_parallel"
# The TP and PP offsets are Megatron-LM's: model_parallel_cuda_manual_seed uses seed + 2718 +
# tp_rank for the tensor-parallel stream, _set_random_seed adds 100·pp_rank.
_TP_OFFSET = 2718
_PP_OFFSET = 100
_LAYER_OFFSET = 7919


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Per-model RNG streams for dropout (see module docstring).

    Seeds: replicated = ``seed + 100·pp_rank + 7919·first_layer``; tensor-parallel = that +
    2718 + tp_rank. ``first_layer`` (the stage's first global layer) keeps the virtual
    pipeline chunks of one rank on different streams.
    """

    def __init__(
        self,
        seed: int,
        *,
        tp_rank: int = 0,
        pp_rank: int = 0,
        first_layer: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        base = seed + _PP_OFFSET * pp_rank + _LAYER_OFFSET * first_layer
        self._states: dict[str, torch.Tensor] = {}
        self._seed_stream(REPLICATED, base)
        self._seed_stream(TENSOR_PARALLEL, base + _TP_OFFSET + tp_rank)

    def _seed_stream(self, name: str, seed: int) -> None:
        if self.device.type == "cuda":
            gen = torch.Generator(device=self.device).manual_seed(seed)
        else:
            gen = torch.Generator().manual_seed(seed)
        self._states[name] = gen.get_state()

    def to(self, device: str | torch.device) -> RNGTracker:
        """Re-seed nothing; move the streams' home device (call before the first draw)."""
        self.device = torch.device(device)
        return self

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL) -> Iterator[None]:
        """Run the block with stream ``name`` as torch's global RNG of the tracker's device."""
        if name not in self._states:
            raise ValueError(f"unknown RNG stream {name!r}; valid: {sorted(self._states)}")
        # Save the caller's global RNG so code outside the block draws as if the fork never
        # happened.
        outer = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            # In finally: the stream keeps its advanced state even if the block raised (or a
            # checkpoint stopped its recompute early), so later draws never repeat a mask.
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outer)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace every stream's state (from :meth:`get_states` or a checkpoint)."""
        if set(states) != set(self._states):
            raise ValueError(f"RNG states {sorted(states)} must name {sorted(self._states)}")
        self._states = {k: v.clone() for k, v in states.items()}
