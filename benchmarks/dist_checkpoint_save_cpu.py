"""CPU cost of a checkpoint save: shardwork.dist_checkpoint.save vs plain torch.distributed.checkpoint.

Saving to tmpfs (``/dev/shm``) takes the disk out: what remains is CPU work (serialising,
checksums, the kernel's copy into the page cache), which on a real disk is what the disk waits
for while it is not being fed. One process, one rank, the mixed state of `dist_checkpoint.py`
(row-sharded, replicated and flat tensors, ``--size-mb`` of float32), saved in interleaved
rounds (the order of the sides reversed every round) by:

- ``plain DCP``: ``torch.distributed.checkpoint.save`` of the same tensors with its
  ``FileSystemWriter`` (``torch.save`` per chunk, whose zip writer computes the records'
  CRC-32), ``sync_files=True``;
- ``shardwork, zlib CRC-32``: `save` with its CRC-32 computed by the standard library's
  ``zlib.crc32`` (as every save did before ISA-L was used);
- ``shardwork, ISA-L CRC-32``: `save` with ``isal``'s CRC-32 (the ``fast-crc`` extra; the same
  checksum values, see `shardwork.dist_checkpoint.checksum`).

Both shardwork sides keep every CRC (per file in ``shardwork.json``, per zip record) and fsync.
Each round measures wall time and the process's CPU time (user + system, all threads,
``resource.getrusage``); the first round is a warm-up and is not counted. Quoted: medians,
and the ratio plain DCP / shardwork (> 1: shardwork costs less). Reference in the same run:
each CRC-32 implementation alone over a 64 MiB buffer. Before every timed save 1.5x the state
of memory is touched and freed (`warm_free_memory`, as in `dist_checkpoint.py`).

Prints a table and writes ``benchmarks/results/dist_checkpoint_save_cpu.json`` and ``.md``.
Usage: ``uv run python benchmarks/dist_checkpoint_save_cpu.py [--size-mb 1024] [--rounds 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from dist_checkpoint import global_tensors, rank_state, warm_free_memory
from machine import machine_record

from shardwork.dist_checkpoint import save
from shardwork.dist_checkpoint.checksum import available_crc32, crc32, select_crc32

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def crc_throughput(name: str) -> float:
    """GB/s of implementation ``name`` over a 64 MiB buffer, 4 MiB per call (best of 5)."""
    previous = select_crc32(name)
    data = memoryview(torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy())
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        value = 0
        for offset in range(0, data.nbytes, 4 << 20):
            value = crc32(data[offset : offset + (4 << 20)], value)
        best = min(best, time.perf_counter() - start)
    select_crc32(previous)
    return data.nbytes / best / 1e9


def sides(tensors: dict[str, torch.Tensor]) -> dict:
    """Name -> function saving the state into a given directory."""
    sharded = rank_state(tensors, 0, 1, fill=True)
    plain = dict(tensors)

    def plain_dcp(path: Path) -> None:
        writer = dcp.FileSystemWriter(str(path), sync_files=True)
        dcp.save(plain, storage_writer=writer, no_dist=True)

    def shardwork(implementation: str):
        def run(path: Path) -> None:
            select_crc32(implementation)
            save(sharded, path, sync_files=True)

        return run

    out = {"plain DCP": plain_dcp, "shardwork, zlib CRC-32": shardwork("zlib")}
    if "isal" in available_crc32():
        out["shardwork, ISA-L CRC-32"] = shardwork("isal")
    return out


def measure(size_mb: int, rounds: int, root: Path) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds of every side: wall and CPU seconds per counted round."""
    tensors = global_tensors(size_mb)
    runs = sides(tensors)
    out = {name: {"wall_s": [], "cpu_s": []} for name in runs}
    for index in range(rounds + 1):
        order = list(runs) if index % 2 == 0 else list(runs)[::-1]
        for name in order:
            target = root / f"r{index}"
            warm_free_memory(size_mb * 3 // 2)
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            runs[name](target)
            wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
            shutil.rmtree(target)
            if index > 0:  # round 0 warms imports, allocators and tmpfs
                out[name]["wall_s"].append(wall)
                out[name]["cpu_s"].append(cpu)
    return out


def table(result: dict) -> str:
    """The markdown table of a result (medians and ratios against plain DCP)."""
    base = result["sides"]["plain DCP"]
    base_wall, base_cpu = statistics.median(base["wall_s"]), statistics.median(base["cpu_s"])
    lines = [
        f"# Checkpoint save CPU cost on tmpfs ({result['size_mb']} MiB, 1 rank, "
        f"median of {result['rounds']} interleaved rounds)",
        "",
        "| side | wall (s) | CPU (s) | plain DCP / side, wall | plain DCP / side, CPU |",
        "|---|---|---|---|---|",
    ]
    for name, runs in result["sides"].items():
        wall, cpu = statistics.median(runs["wall_s"]), statistics.median(runs["cpu_s"])
        lines.append(
            f"| {name} | {wall:.3f} | {cpu:.3f} | {base_wall / wall:.2f} | {base_cpu / cpu:.2f} |"
        )
    crc = ", ".join(f"{k} {v:.1f} GB/s" for k, v in result["crc32_gb_per_s"].items())
    machine = result["machine"]
    lines += [
        "",
        f"CRC-32 alone (4 MiB calls): {crc}. {machine['cpu']}, {machine['cpus']} CPUs, "
        f"load average {machine['load_avg'][0]:.1f} at the end; torch {result['torch']}; "
        f"directory on {result['filesystem']}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    crc_rates = {name: crc_throughput(name) for name in available_crc32()}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        measured = measure(args.size_mb, args.rounds, Path(root))
    result = {
        "size_mb": args.size_mb,
        "rounds": args.rounds,
        "filesystem": "tmpfs (/dev/shm)" if args.dir == "/dev/shm" else str(args.dir),
        "torch": torch.__version__,
        "crc32_gb_per_s": crc_rates,
        "sides": measured,
        "machine": machine_record(),
    }
    text = table(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dist_checkpoint_save_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "dist_checkpoint_save_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
