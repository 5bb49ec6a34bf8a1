"""Router replay: record which experts each router picked, and force the same picks later.

For RL-style recomputation (the training forward must route as the rollout did) and for
debugging (freeze routing while something else changes). The idea follows Megatron-Core
0.19's router replay, without its class-level list of instances:

- One :class:`RouterReplay` object, owned by the caller, is handed to every
  :class:`TopKRouter` that takes part (``TopKRouter(..., replay=r, layer_index=i)``); routers
  are told apart by ``layer_index``.
- ``record()``: every routed forward appends its [T, K] expert indices (before capacity
  dropping) to its layer's list, one entry per micro-batch, in call order.
- ``replay()``: each forward takes its layer's next entry (first in, first out) and uses
  those experts instead of selecting; the probabilities are recomputed from the current
  logits at those experts (normalisation and scaling as usual), so gradients flow to the
  gating weight. Capacity dropping, losses and token counts then run as usual.
- ``stop()``: routers select normally again; the records stay for ``indices`` / ``load``.
- ``indices(layer)`` / ``load({layer: [idx_TK, ...]})``: hand records between processes
  (a rollout engine's choices replayed by the trainer); ``rewind()`` replays them again;
  ``seek(i)`` makes micro-batch i's record the next one (activation recomputation, pipeline
  schedules that run micro-batches out of order).

Indices are per token row in the router's [S, B] row-major order (its local tokens). To
replay under another parallel layout (records made at TP 2 with sequence parallelism,
replayed at world 1 or with context parallelism), convert them with
:mod:`shardwork.moe_router.replay_layout` (``gather_records`` / ``merge_record_shards`` to
the global token order, ``shard_records`` to another rank's tokens).
"""

from __future__ import annotations

import torch


def check_replay_supported(config, layer_index: int | None) -> None:
    """Raise ValueError when a router with ``config`` cannot record or replay its choices."""
    if not isinstance(layer_index, int) or isinstance(layer_index, bool) or layer_index < 0:
        raise ValueError(
            f"layer_index={layer_index!r} is invalid with router replay: it keys the records, "
            "pass an integer >= 0"
        )
    if config.load_balancing_type in ("sinkhorn", "quantile_balancing"):
        raise ValueError(
            f"RouterConfig.load_balancing_type={config.load_balancing_type!r} is invalid with "
            "router replay: replay forces the choices of plain top-k routing (Megatron-Core "
            "ignores its replay for these types too)"
        )
    if config.fused_backend is not None:
        raise ValueError(
            f"RouterConfig.fused_backend={config.fused_backend!r} is invalid with router replay: "
            "set fused_backend=None (the replayed probabilities come from this package's path)"
        )


def indices_from_map(map_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, K] expert ids (ascending) of a routing map holding exactly K experts per token."""
    # The dense path returns only the map; it guarantees K experts per row (ties go to topk).
    return map_TE.nonzero()[:, 1].view(map_TE.shape[0], top_k)


class RouterReplay:
    """Per-layer, per-micro-batch record of top-k routing decisions (see module docstring)."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self._records: dict[int, list[torch.Tensor]] = {}
        self._cursor: dict[int, int] = {}

    def record(self) -> None:
        """Drop earlier records; routed forwards from now on append their choices."""
        self._records, self._cursor = {}, {}
        self.mode = "record"

    def replay(self) -> None:
        """Routed forwards from now on reuse the records, each layer from its first entry."""
        self.rewind()
        self.mode = "replay"

    def stop(self) -> None:
        """Routers select normally again; records are kept."""
        self.mode = None

    def rewind(self) -> None:
        """Start each layer's replay again from its first record."""
        self._cursor = dict.fromkeys(self._records, 0)

    def seek(self, entry: int) -> None:
        """Replay record ``entry`` (0-based forward / micro-batch number) next, in every layer.

        Call it where a micro-batch is run again or out of order: inside a function under
        activation checkpointing (``seek(i); return block(x)``), the recomputation in
        backward re-seeks and gets the same experts as the first pass.
        """
        if not isinstance(entry, int) or isinstance(entry, bool) or entry < 0:
            raise ValueError(f"entry={entry!r} is invalid: pass a record number >= 0")
        self._cursor = dict.fromkeys(self._records, entry)

    def records(self) -> dict[int, list[torch.Tensor]]:
        """Every layer's records (``layer`` -> one [T, K] tensor per forward), for
        :meth:`load` elsewhere or :mod:`.replay_layout`'s conversions between layouts."""
        return {layer: list(entries) for layer, entries in self._records.items()}

    def indices(self, layer: int) -> list[torch.Tensor]:
        """The recorded [T, K] indices of ``layer``, one tensor per forward, in order."""
        return list(self._records.get(layer, []))

    def load(self, records: dict[int, list[torch.Tensor]]) -> None:
        """Replace the records (e.g. with another process's ``indices``) and rewind."""
        for layer, entries in records.items():
            for idx in entries:
                if idx.dim() != 2 or idx.dtype != torch.int64:
                    raise ValueError(
                        f"records[{layer}] holds a tensor of shape {tuple(idx.shape)} and dtype "
                        f"{idx.dtype}: expected [T, K] int64 expert indices"
                    )
        self._records = {layer: list(entries) for layer, entries in records.items()}
        self.rewind()

    def put(self, layer: int, top_TK: torch.Tensor) -> None:
        """Append one forward's choices (called by the router while recording)."""
        self._records.setdefault(layer, []).append(top_TK.detach().clone())

    def take(self, layer: int, num_tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
        """The next recorded [T, K] indices of ``layer`` (called by the router while replaying).

        Raises ValueError when the layer has no record left or the record does not fit this
        forward (another token count or K, or an expert id out of range).
        """
        entries, at = self._records.get(layer, []), self._cursor.get(layer, 0)
        if at >= len(entries):
            raise ValueError(
                f"router replay: layer {layer} has {len(entries)} recorded forward(s) and all were "
                "replayed; record this forward, load its indices, or rewind()"
            )
        idx = entries[at]
        if idx.shape != (num_tokens, top_k):
            raise ValueError(
                f"router replay: layer {layer} record {at} has shape {tuple(idx.shape)}, this "
                f"forward needs [{num_tokens}, {top_k}] (tokens, top_k)"
            )
        if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < num_experts:
            raise ValueError(
                f"router replay: layer {layer} record {at} holds expert ids outside "
                f"[0, {num_experts})"
            )
        if top_k > 1 and bool((idx.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise ValueError(
                f"router replay: layer {layer} record {at} names an expert twice for one token"
            )
        self._cursor[layer] = at + 1
        return idx
