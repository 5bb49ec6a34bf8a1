"""Router-replay records independent of the parallel layout that made them.

A router records the [T, K] experts of the tokens it holds, T = S_local·B rows in its
[S_local, B] row-major order. When the sequence is split over ranks (sequence-parallel TP,
context parallelism), each rank holds some global sequence positions: its *layout* is the
[S_local] tensor of those positions, in local order (a contiguous block for sequence
parallelism; chunks r and 2·CP−1−r for load-balanced context parallelism; ``arange(S)`` for
the whole sequence). A record is *global* when its rows are the whole micro-batch's tokens in
[S, B] order, i.e. as an unsplit run at world 1 would record them.

- :func:`merge_record_shards`: the local records of every rank of a layout → global records
  (no communication; e.g. records gathered from a rollout engine's ranks).
- :func:`gather_records`: the same as a collective over the ranks that split the sequence.
- :func:`shard_records`: global records → this rank's local records under another layout,
  ready for :meth:`RouterReplay.load`.

So a run recorded at one layout (say TP 2 with sequence parallelism) replays at another (world
1, or CP 2) with each token getting its recorded experts. Records map ``layer`` → list (one
entry per micro-batch) of int64 [T, K] tensors, as :meth:`RouterReplay.records` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwork.moe_router.comm import group_size

Records = dict[int, list[torch.Tensor]]


def local_token_rows(sequence_positions: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows of the global [S·B] token order that a rank with this layout holds, in its order."""
    positions = torch.as_tensor(sequence_positions, dtype=torch.int64).reshape(-1, 1)
    return (positions * batch + torch.arange(batch)).reshape(-1)


def _batch_of(rows: int, sequence_positions: torch.Tensor, what: str) -> int:
    local_len = int(torch.as_tensor(sequence_positions).numel())
    if local_len == 0 or rows % local_len != 0:
        raise ValueError(
            f"{what} has {rows} token rows, which is not a multiple of the layout's "
            f"{local_len} sequence positions: the layout does not describe this record"
        )
    return rows // local_len


def merge_record_shards(
    shards: Sequence[Records], sequence_positions: Sequence[torch.Tensor]
) -> Records:
    """Global records from the local records of every rank of one layout.

    ``shards[r]`` and ``sequence_positions[r]`` are rank r's records and layout; together the
    layouts must cover positions 0..S-1 exactly once, and every rank must hold the same layers
    and micro-batch count.
    """
    if len(shards) != len(sequence_positions) or not shards:
        raise ValueError(
            f"{len(shards)} record shards and {len(sequence_positions)} layouts: pass one "
            "layout per shard (at least one)"
        )
    covered = torch.cat([torch.as_tensor(p, dtype=torch.int64) for p in sequence_positions])
    if not torch.equal(covered.sort().values, torch.arange(covered.numel())):
        raise ValueError(
            "the layouts do not cover the sequence positions 0..S-1 exactly once: "
            f"got {covered.tolist()}"
        )
    layers = set(shards[0])
    if any(set(s) != layers for s in shards):
        raise ValueError("the record shards hold different layers: merge shards of one run")
    merged: Records = {}
    for layer in sorted(layers):
        counts = {len(s[layer]) for s in shards}
        if len(counts) != 1:
            raise ValueError(f"layer {layer}: the shards hold {sorted(counts)} micro-batches")
        merged[layer] = []
        for mb in range(counts.pop()):
            parts = [s[layer][mb] for s in shards]
            batch = _batch_of(parts[0].shape[0], sequence_positions[0], f"layer {layer} record")
            out = parts[0].new_empty((covered.numel() * batch, parts[0].shape[1]))
            for part, positions in zip(parts, sequence_positions):
                rows = local_token_rows(positions, batch)
                if part.shape[0] != rows.numel():
                    raise ValueError(
                        f"layer {layer} micro-batch {mb}: a shard has {part.shape[0]} rows, its "
                        f"layout needs {rows.numel()}"
                    )
                out[rows] = part
            merged[layer].append(out)
    return merged


def shard_records(records: Records, *, sequence_positions: torch.Tensor, seq_len: int) -> Records:
    """This rank's local records, for layout ``sequence_positions``, from global records of
    sequences of ``seq_len`` positions."""
    local: Records = {}
    for layer, entries in records.items():
        local[layer] = []
        for idx in entries:
            if idx.shape[0] % seq_len != 0:
                raise ValueError(
                    f"layer {layer}: a global record has {idx.shape[0]} rows, not a multiple of "
                    f"seq_len={seq_len}"
                )
            rows = local_token_rows(sequence_positions, idx.shape[0] // seq_len)
            local[layer].append(idx[rows.to(idx.device)].clone())
    return local


def gather_records(records: Records, *, sequence_positions: torch.Tensor, group=None) -> Records:
    """Global records on every rank of ``group`` (the ranks splitting the sequence: sequence-
    parallel TP × CP), from each rank's local ``records`` and layout. A collective."""
    if group_size(group) == 1:
        return merge_record_shards([records], [sequence_positions])
    mine = (
        {k: [t.cpu() for t in v] for k, v in records.items()},
        torch.as_tensor(sequence_positions).cpu(),
    )
    everyone: list = [None] * group_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return merge_record_shards([e[0] for e in everyone], [e[1] for e in everyone])
