"""Store traffic of `init_process_groups` at cluster sizes, counted from torch's own code.

`parallel_state_scale.py` counts ``new_group`` calls with ``torch.distributed`` replaced by
a recorder. Here torch itself runs: one process plays rank r of a world of W with torch's
``fake`` backend (``torch.testing._internal.distributed.fake_pg``), and every key-value store
operation torch issues goes through `CountingStore`, a ``dist.Store`` that delegates to a
``HashStore`` and counts operations and bytes (key + value). Layout tp8 pp16 cp2 ep64 etp1
(dp and edp fill the rest), W = 1,024 ... 100,352, ranks 0, W/2 and W-1.

What is executed and what is modelled:

- Executed torch code: ``init_process_group`` and every ``new_group`` (group naming,
  validation, ``_new_process_group_helper``, and with ``TORCH_DIST_INIT_BARRIER=1`` the
  ``_store_based_barrier`` after each creation). Torch's default is no barrier: the
  creation then makes no store operation at all, which the benchmark measures too.
- Modelled inside the executed run: a store-based barrier ends with ``wait`` on a
  ``...:last_worker`` key that only the last member to arrive writes. One process has no
  other members, so `CountingStore` answers that wait as if the last member had written the
  key (counted as executed ``wait``; the key's one ``set`` is made by one member per group
  and is not in a non-last member's count). A 1-member group is its own last worker, and
  there torch's ``set`` does execute. Rank-0 numbers assume no straggler: a late member
  adds one ``add(key, 0)`` per 10 s + W/1000 s of waiting.
- Analytic (the fake backend opens no connections): the backend's own rendezvous per
  created group of n members. gloo (`torch/csrc/distributed/c10d/ProcessGroupGloo.cpp` ->
  ``gloo::rendezvous::Context::connectFullMesh`` -> the TCP transport's
  ``createAndConnectAllPairs``): each member ``set``s one key with its address and
  ``wait``s on and ``get``s the key of every member. The per-member counts and bytes are
  measured here with real gloo processes (2 and 4 ranks, counting store over a TCPStore)
  and fitted as ``set 1, wait n, get n, get bytes n * b(n)``. NCCL
  (``ProcessGroupNCCL::broadcastUniqueNCCLID``, at the group's first collective): the
  group's rank 0 ``set``s the 128-byte ``ncclUniqueId``, every other member ``get``s it.

``split_group`` (in this torch, implemented by gloo): on 4 real gloo ranks, the store keys
written when two 2-rank groups are made by ``new_group`` (local synchronisation) and by
``split_group``, counted on the TCPStore.

Beside it, "every group on every rank" (Megatron-Core's default and this package's previous
scheme): each rank calls ``new_group`` for every group of the layout without local
synchronisation, executed the same way at each size (rank 0).

Prints a table and writes ``benchmarks/results/parallel_state_store.json`` and ``.md``.
Usage: ``uv run python benchmarks/parallel_state_store.py [--worlds 1024 4096 16384 100352]``
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch registers its "fake" backend only when this module is imported (no public path)
import torch.testing._internal.distributed.fake_pg
from machine import machine_record

from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.layout import GROUP_NAMES, RankLayout

RESULTS = Path(__file__).resolve().parent / "results"
WORLDS = (1024, 4096, 16384, 100352)
CONFIG = ParallelConfig(tp=8, pp=16, cp=2, ep=64, etp=1)
NCCL_UNIQUE_ID_BYTES = 128


def _nbytes(value) -> int:
    return len(value.encode() if isinstance(value, str) else value)


class CountingStore(dist.Store):
    """Delegates to ``inner`` and counts each operation and its bytes (keys and values).

    ``answer_barriers``: a ``wait`` on missing ``...:last_worker`` keys (the end of torch's
    store-based barrier, written by the last member to arrive) returns at once, as if that
    member had written them; counted as a ``wait`` and in ``modelled_waits``.
    """

    def __init__(self, inner: dist.Store, answer_barriers: bool = False) -> None:
        super().__init__()
        self.inner, self.answer_barriers = inner, answer_barriers
        self.ops: Counter = Counter()
        self.bytes: Counter = Counter()

    def _count(self, op: str, nbytes: int) -> None:
        self.ops[op] += 1
        self.bytes[op] += nbytes

    def set(self, key, value):
        self._count("set", len(key) + _nbytes(value))
        self.inner.set(key, value)

    def get(self, key):
        value = self.inner.get(key)
        self._count("get", len(key) + len(value))
        return value

    def add(self, key, amount):
        self._count("add", len(key) + 8)  # the amount travels as an int64
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self._count("compare_set", len(key) + _nbytes(expected) + _nbytes(desired))
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self._count("check", sum(map(len, keys)))
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count("wait", sum(map(len, keys)))
        barrier_end = self.answer_barriers and all(k.endswith(":last_worker") for k in keys)
        if barrier_end and not self.inner.check(keys):
            self.ops["modelled_waits"] += 1
            return None
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):
        self._count("delete_key", len(key))
        return self.inner.delete_key(key)

    def num_keys(self):
        self._count("num_keys", 0)
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


@contextmanager
def init_barrier(enabled: bool):
    """Set ``TORCH_DIST_INIT_BARRIER`` (read by torch at each group creation) for a block."""
    saved = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCH_DIST_INIT_BARRIER"]
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = saved


def _snapshot(store: CountingStore) -> dict:
    ops = {k: v for k, v in store.ops.items() if k != "modelled_waits"}
    return {
        "ops": sum(ops.values()),
        "by_op": dict(sorted(ops.items())),
        "bytes": sum(store.bytes.values()),
        "modelled_waits": store.ops["modelled_waits"],
    }


def every_group(layout: RankLayout) -> int:
    """The previous scheme: every rank creates every group, world-wide synchronisation."""
    calls = 0
    for name in GROUP_NAMES:
        for members in layout.groups[name]:
            dist.new_group(list(members))
            calls += 1
    return calls


def simulate(rank: int, world: int, *, barrier: bool, scheme: str) -> dict:
    """Rank ``rank`` of a fake world of ``world``: store operations of init and of groups."""
    store = CountingStore(dist.HashStore(), answer_barriers=True)
    with init_barrier(barrier):
        dist.init_process_group("fake", store=store, rank=rank, world_size=world)
        try:
            init = _snapshot(store)
            store.ops.clear()
            store.bytes.clear()
            start = time.perf_counter()
            if scheme == "own":
                groups = init_process_groups(CONFIG)
                calls = len(groups.handles)
                sizes = {name: groups.size(name) for name in groups.handles}
            else:
                calls = every_group(RankLayout.build(CONFIG, world))
                sizes = {}
            seconds = time.perf_counter() - start
        finally:
            dist.destroy_process_group()
    return {
        "rank": rank,
        "new_group_calls": calls,
        "init_process_group": init,
        "groups": _snapshot(store),
        "group_sizes": sizes,
        "seconds": seconds,
    }


def _gloo_member(rank: int, world: int, port: int, queue) -> None:
    """One real gloo rank: store traffic of one ``new_group`` over all ``world`` ranks."""
    tcp = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    store = CountingStore(tcp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    store.ops.clear()
    store.bytes.clear()
    dist.new_group(list(range(world)), use_local_synchronization=True)
    queue.put((rank, dict(store.ops), dict(store.bytes)))
    dist.barrier()
    dist.destroy_process_group()


def gloo_calibration(sizes=(2, 3, 4), port: int = 29631) -> dict:
    """Per-member store traffic of a real gloo group creation at each group size."""
    ctx = mp.get_context("spawn")
    out = {}
    for n in sizes:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_gloo_member, args=(r, n, port + n, queue)) for r in range(n)]
        for p in procs:
            p.start()
        members = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join()
        kinds = {(tuple(sorted(o.items())), tuple(sorted(b.items()))) for _, o, b in members}
        assert len(kinds) == 1, f"gloo members differ at n={n}: {members}"
        ops, nbytes = members[0][1], members[0][2]
        out[n] = {"by_op": ops, "bytes": nbytes}
    return out


def gloo_model(calibration: dict):
    """Per-member (ops, bytes) of a gloo rendezvous of n members, from the calibration.

    Checks the executed counts against the source's formula (1 set, n waits, n gets), fits
    the size of one member's key + address record linearly in n on the smallest and largest
    sizes, and checks the fit on the sizes between (within 1 byte per record).
    """
    for n, c in calibration.items():
        expected = {"set": 1, "wait": n, "get": n}
        assert c["by_op"] == expected, f"gloo at n={n}: {c['by_op']} != {expected}"
    points = sorted(calibration.items())
    (n0, c0), (n1, c1) = points[0], points[-1]
    per_get = [c0["bytes"]["get"] / n0, c1["bytes"]["get"] / n1]
    slope = (per_get[1] - per_get[0]) / (n1 - n0)
    base = per_get[0] - slope * n0
    set_slope = (c1["bytes"]["set"] - c0["bytes"]["set"]) / (n1 - n0)
    set_base = c0["bytes"]["set"] - set_slope * n0
    wait_per_key = c0["bytes"]["wait"] / n0
    for n, c in points[1:-1]:
        predicted = base + slope * n
        assert abs(c["bytes"]["get"] / n - predicted) <= 1, f"gloo record at n={n} is not linear"

    def model(n: int) -> tuple[int, float]:
        if n == 1:  # a 1-member gloo group makes no pairs
            return 0, 0.0
        blob = base + slope * n
        return 1 + 2 * n, (set_base + set_slope * n) + n * blob + n * wait_per_key

    return model, {"get_bytes_per_member_key": [base, slope], "set_bytes": [set_base, set_slope]}


def backend_traffic(sizes: dict[str, int], world: int, rank: int, gloo) -> dict:
    """Analytic backend rendezvous of one rank: its groups (and the world group)."""
    groups = list(sizes.values())
    gloo_ops = sum(gloo(n)[0] for n in groups)
    gloo_bytes = sum(gloo(n)[1] for n in groups)
    # NCCL: the group's rank 0 sets the id; the others get it (key ~ 2 bytes).
    nccl_ops = len([n for n in groups if n > 1])
    nccl_bytes = nccl_ops * (NCCL_UNIQUE_ID_BYTES + 2)
    return {
        "gloo_groups": {"ops": gloo_ops, "bytes": round(gloo_bytes)},
        "gloo_world_group": {"ops": gloo(world)[0], "bytes": round(gloo(world)[1])},
        "nccl_groups": {"ops": nccl_ops, "bytes": nccl_bytes},
        "nccl_world_group": {"ops": 1, "bytes": NCCL_UNIQUE_ID_BYTES + 2},
    }


def world_row(world: int, gloo, every_group_ranks: bool) -> dict:
    """All measurements at one world size."""
    ranks = sorted({0, world // 2, world - 1})
    own = []
    for rank in ranks:
        plain = simulate(rank, world, barrier=False, scheme="own")
        barrier = simulate(rank, world, barrier=True, scheme="own")
        assert plain["group_sizes"] == barrier["group_sizes"]
        own.append(
            {
                "rank": rank,
                "new_group_calls": plain["new_group_calls"],
                "group_sizes": plain["group_sizes"],
                "store_default": plain["groups"],
                "store_init_barrier": barrier["groups"],
                "init_process_group_init_barrier": barrier["init_process_group"],
                "seconds": plain["seconds"],
                "backend_model": backend_traffic(plain["group_sizes"], world, rank, gloo),
            }
        )
    row = {"world": world, "own_groups": own}
    if every_group_ranks:
        every = simulate(0, world, barrier=True, scheme="every")
        row["every_group_rank0_init_barrier"] = {
            "new_group_calls": every["new_group_calls"],
            "store": every["groups"],
            "seconds": every["seconds"],
        }
    return row


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        f"# Store traffic of `init_process_groups` (tp8 pp16 cp2 ep64 etp1; torch "
        f"{record['torch']}; {m['cpu']}, load average {m['load_avg'][0]:.1f} on {m['cpus']} CPUs)",
        "",
        "Executed torch code, fake backend, counting store. Per rank (0 / W/2 / W-1). "
        "`TORCH_DIST_INIT_BARRIER=0` is torch's default; `=1` adds a store-based barrier per "
        "group (its final wait answered as if the last member had arrived).",
        "",
        "| world | rank | new_group calls | dp / edp size | store ops (default) | "
        "store ops, bytes (barrier=1) | every group on every rank (rank 0, barrier=1): "
        "calls, store ops, bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        every = row.get("every_group_rank0_init_barrier")
        for i, r in enumerate(row["own_groups"]):
            b = r["store_init_barrier"]
            tail = (
                ""
                if every is None or i
                else (
                    f"{every['new_group_calls']:,}, {every['store']['ops']:,}, "
                    f"{every['store']['bytes']:,}"
                )
            )
            lines.append(
                f"| {row['world']:,} | {r['rank']:,} | {r['new_group_calls']} | "
                f"{r['group_sizes']['dp']} / {r['group_sizes']['edp']} | "
                f"{r['store_default']['ops']} | {b['ops']}, {b['bytes']:,} | {tail} |"
            )
    lines += [
        "",
        "Backend rendezvous, analytic (gloo fitted to real gloo ranks; NCCL from its source). "
        "Per rank: its own groups, and the world group `init_process_group` creates:",
        "",
        "| world | rank | gloo: own groups ops, bytes | gloo: world group ops, bytes | "
        "NCCL: own groups ops, bytes | NCCL: world group ops |",
        "|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        for r in row["own_groups"]:
            b = r["backend_model"]
            lines.append(
                f"| {row['world']:,} | {r['rank']:,} | {b['gloo_groups']['ops']:,}, "
                f"{b['gloo_groups']['bytes']:,} | {b['gloo_world_group']['ops']:,}, "
                f"{b['gloo_world_group']['bytes']:,} | {b['nccl_groups']['ops']}, "
                f"{b['nccl_groups']['bytes']:,} | {b['nccl_world_group']['ops']} |"
            )
    cal = record["gloo_calibration"]
    sg = record["split_group"]
    lines += [
        "",
        "gloo calibration (real processes, one `new_group` over n ranks, per member): "
        + "; ".join(f"n={n}: {c['by_op']}, bytes {c['bytes']}" for n, c in cal.items()),
        "",
        f"split_group ({sg['world']} gloo ranks, {sg['groups']} groups): "
        f"new_group with local synchronisation wrote {sg['new_group_local_sync_keys']} store keys, "
        f"split_group {sg['split_group_keys']}; {sg['note']}",
    ]
    return "\n".join(lines)


def _split_member(rank: int, world: int, port: int, queue) -> None:
    """One real gloo rank: store keys added by ``new_group`` and by ``split_group``.

    ``split_group`` makes gloo clone the store, which a Python ``Store`` cannot do, so keys
    are counted on the TCPStore itself (``num_keys`` between barriers) rather than by
    `CountingStore`.
    """
    tcp = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=world)
    halves = [list(range(world // 2)), list(range(world // 2, world))]
    counts = []
    for create in (
        lambda: dist.new_group(halves[rank >= world // 2], use_local_synchronization=True),
        lambda: dist.split_group(split_ranks=halves),
    ):
        dist.barrier()
        before = tcp.num_keys()
        dist.barrier()
        create()
        dist.barrier()
        counts.append(tcp.num_keys() - before)
        dist.barrier()
    if rank == 0:
        queue.put(counts)
    dist.destroy_process_group()


def split_group_keys(world: int = 4, port: int = 29661) -> dict:
    """Store keys written when two halves of ``world`` gloo ranks get a group each way."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_split_member, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    new_group_keys, split_keys = queue.get(timeout=120)
    for p in procs:
        p.join()
    return {
        "world": world,
        "groups": 2,
        "new_group_local_sync_keys": new_group_keys,
        "split_group_keys": split_keys,
    }


SPLIT_GROUP_NOTE = (
    "this torch has dist.split_group and gloo implements it (its docstring lists NCCL, XCCL, "
    "Gloo); the key counts above are from real gloo ranks. gloo's split runs the same "
    "full-mesh address exchange as new_group (one record per member), so it does not reduce "
    "store traffic. It is also collective over the parent (every parent rank calls it for "
    "every split), and with NCCL it saves the unique-id exchange only when the parent "
    "communicator is eagerly bound to a device (ncclCommSplit). Not adopted."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--out", default=str(RESULTS / "parallel_state_store"))
    args = parser.parse_args()
    calibration = gloo_calibration()
    split = split_group_keys()
    gloo, fit = gloo_model(calibration)
    rows = []
    for world in args.worlds:
        row = world_row(world, gloo, every_group_ranks=True)
        rows.append(row)
        print(f"world {world:,} done", flush=True)
    record = {
        "machine": machine_record(),
        "torch": torch.__version__,
        "layout": "tp8 pp16 cp2 ep64 etp1",
        "gloo_calibration": calibration,
        "gloo_fit": fit,
        "split_group": {**split, "note": SPLIT_GROUP_NOTE},
        "rows": rows,
    }
    text = markdown(record)
    print(text)
    Path(args.out + ".json").write_text(json.dumps(record, indent=1))
    Path(args.out + ".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
