"""What verifying on load costs: shardwork.dist_checkpoint.load with ``verify=True`` vs ``False``.

One process saves a state of ``--size-mb`` float32 bytes (the mix of `dist_checkpoint.py`:
row-sharded, replicated and flat tensors) and loads it back, alternating verify on and off
(``--repeats`` times each, on first in odd repetitions, off first in even ones), in three
cases:

- ``same layout, page cache warm``: every byte of every file is read; verification adds the
  CRC-32 of the bytes read (and reading the few header bytes between chunks), so this is the
  pure CPU cost;
- ``same layout, page cache dropped`` (``posix_fadvise(DONTNEED)`` before each load): the
  reads come from the disk, as on a resume after a reboot;
- ``half of each tensor, page cache warm``: the template is rank 0's of a 2-rank layout (half
  the rows, half of each flat shard, the replicated tensors whole), as in a resharded load;
  verification must also read the rest of each file (the recorded CRC is of the whole file).

Reference in the same run: the CRC-32 in use (`shardwork.dist_checkpoint.checksum`: ISA-L's
with the ``fast-crc`` extra, else zlib's) over a 64 MiB buffer (the checksum's throughput).
Each figure is the best and the median of the repetitions; the ratio quoted is verify-on /
verify-off of the medians. Prints a table and writes
``benchmarks/results/dist_checkpoint_verify.json`` and ``.md`` (the machine named in both).

Usage: ``uv run python benchmarks/dist_checkpoint_verify.py [--size-mb 256] [--repeats 5]``
(about 30 s at the defaults on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from dist_checkpoint import evict, global_tensors, rank_state, warm_free_memory
from machine import cpu_model

from shardwork.dist_checkpoint import load, save
from shardwork.dist_checkpoint.checksum import crc32, crc32_implementation

RESULTS = Path(__file__).resolve().parent / "results"


def crc_throughput() -> float:
    """GB/s of the CRC-32 in use over a 64 MiB buffer (best of 3)."""
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    best = min(_timed(lambda: crc32(data)) for _ in range(3))
    return len(data) / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(ckpt: Path, template: dict, repeats: int, *, cold: bool) -> dict[str, list[float]]:
    """Seconds per load with verify on and off, alternating which goes first."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    size_mb = sum(f.stat().st_size for f in ckpt.iterdir()) >> 20
    for rep in range(repeats):
        for verify in (True, False) if rep % 2 == 0 else (False, True):
            if cold:
                evict(ckpt)
            warm_free_memory(size_mb + size_mb // 2)
            seconds = _timed(lambda v=verify: load(template, ckpt, verify=v))
            times["on" if verify else "off"].append(seconds)
    return times


def summarise(times: dict[str, list[float]], nbytes: int) -> dict:
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "seconds": times,
        "median_s": {"on": on, "off": off},
        "best_s": {"on": min(times["on"]), "off": min(times["off"])},
        "bytes_loaded": nbytes,
        "ratio_on_off": on / off,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="state size (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", default=str(RESULTS / "dist_checkpoint_verify"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    tensors = global_tensors(args.size_mb)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt = Path(tmp) / "ckpt"
        save(rank_state(tensors, 0, 1, fill=True), ckpt)
        whole = rank_state(tensors, 0, 1, fill=False)
        half = rank_state(tensors, 0, 2, fill=False)
        nbytes = {
            name: sum(st.data.nbytes for st in state["model"].values())
            for name, state in (("whole", whole), ("half", half))
        }
        cases = {
            "same layout, page cache warm": summarise(
                measure(ckpt, whole, args.repeats, cold=False), nbytes["whole"]
            ),
            "same layout, page cache dropped": summarise(
                measure(ckpt, whole, args.repeats, cold=True), nbytes["whole"]
            ),
            "half of each tensor, page cache warm": summarise(
                measure(ckpt, half, args.repeats, cold=False), nbytes["half"]
            ),
        }
    result = {
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg_end": os.getloadavg(),
        },
        "size_mb": args.size_mb,
        "repeats": args.repeats,
        "crc32_gb_s": crc_throughput(),
        "crc32_implementation": crc32_implementation(),
        "cases": cases,
    }
    write(result, Path(args.out))


def write(result: dict, out: Path) -> None:
    lines = [
        "# dist-checkpoint: cost of verification on load",
        "",
        f"machine: {result['machine']['cpu']}, {result['machine']['cpus']} CPUs, load average "
        f"at the end {result['machine']['load_avg_end'][0]:.1f}; state {result['size_mb']} MiB, "
        f"{result['repeats']} repetitions each; CRC-32 ({result['crc32_implementation']}) alone: "
        f"{result['crc32_gb_s']:.2f} GB/s",
        "",
        "| case | verify off (median s) | verify on (median s) | on / off | best off / on (s) |",
        "|---|---|---|---|---|",
    ]
    for name, c in result["cases"].items():
        lines.append(
            f"| {name} | {c['median_s']['off']:.3f} | {c['median_s']['on']:.3f} | "
            f"{c['ratio_on_off']:.2f} | {c['best_s']['off']:.3f} / {c['best_s']['on']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
