"""What decoding a checkpoint without running its code costs on load (one process, one rank).

`load` decodes DCP's ``.metadata`` with an allow-list unpickler, checks every recorded file
name and byte range against the checkpoint directory (one ``stat`` per file), and decodes
object records with ``torch.load(weights_only=True)``. Before, it used plain ``pickle.load``
and ``torch.load(weights_only=False)`` and checked nothing. This benchmark times both in the
same process on the same checkpoint, interleaved round by round:

- ``metadata``: decoding ``.metadata`` alone (allow-list + range check vs ``pickle.load``);
- ``objects``: decoding the object records alone (``weights_only`` True vs False);
- ``load``: a whole `load` into a template, files in the page cache (so the decoding is not
  hidden behind disk time), with the old decoders swapped in for the "before" side.

The state has ``--keys`` small tensors (many keys make the metadata large, the case where
decoding matters most) and ``--objects`` per-rank objects shaped like the trainer's RNG state.
Prints a table and writes ``benchmarks/results/dist_checkpoint_decode.json`` and ``.md``.

Usage: ``uv run python benchmarks/dist_checkpoint_decode.py [--keys 4000] [--rounds 15]``
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from machine import cpu_model, machine_record

from shardwork.dist_checkpoint import (
    ShardedObject,
    ShardedTensor,
    decode,
    load,
    planners,
    reader,
    save,
)

RESULTS = Path(__file__).resolve().parent / "results"


def build_state(keys: int, objects: int, *, fill: bool) -> dict:
    """``keys`` tensors of 32x32 fp32 and ``objects`` RNG-like objects (a tensor + ints)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for k in range(keys):
        data = torch.randn(32, 32, generator=gen) if fill else torch.empty(32, 32)
        tensors[f"layers.{k}.weight"] = ShardedTensor.from_rank_offsets(f"layers.{k}.weight", data)
    rng = {"torch_cpu": torch.get_rng_state(), "trackers": [{"seed": 1234, "offset": 7}]}
    objs = {
        f"rng{i}": ShardedObject(f"rng{i}", rng if fill else None, (1,), (0,))
        for i in range(objects)
    }
    return {"model": tensors, "rng": objs, "trainer": {"step": 100, "seed": 5}}


def plain_decode_metadata(raw, *, name):  # the reader's decoder before the allow-list
    return pickle.loads(raw)


def plain_decode_object(data, *, name):
    return torch.load(io.BytesIO(data) if isinstance(data, bytes) else data, weights_only=False)


@contextmanager
def old_decoders():
    """Swap the load path's decoders back to plain pickle and drop the range check."""
    saved = (reader.decode_metadata, reader.check_storage_ranges, planners.decode_object)
    reader.decode_metadata = plain_decode_metadata
    reader.check_storage_ranges = lambda directory, storage: None
    planners.decode_object = plain_decode_object
    try:
        yield
    finally:
        reader.decode_metadata, reader.check_storage_ranges, planners.decode_object = saved


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def object_records(path: Path) -> list[bytes]:
    with open(path / ".metadata", "rb") as f:
        storage = pickle.load(f).storage_data
    blobs = []
    for index, info in storage.items():
        if index.fqn.startswith("rng") or index.fqn.startswith("_shardwork"):
            data = (path / info.relative_path).read_bytes()
            blobs.append(data[info.offset : info.offset + info.length])
    return blobs


def measure(path: Path, args) -> dict:
    metadata_bytes = (path / ".metadata").read_bytes()
    blobs = object_records(path)

    def new_metadata():
        meta = decode.decode_metadata(metadata_bytes, name="m")
        reader.check_storage_ranges(path, meta.storage_data)

    def new_objects():
        for blob in blobs:
            decode.decode_object(blob, name="o")

    def old_objects():
        for blob in blobs:
            plain_decode_object(blob, name="o")

    def new_load():
        load(build_state(args.keys, args.objects, fill=False), path)

    def old_load():
        with old_decoders():
            load(build_state(args.keys, args.objects, fill=False), path)

    pairs = {
        "metadata": (new_metadata, lambda: pickle.loads(metadata_bytes)),
        "objects": (new_objects, old_objects),
        "load": (new_load, old_load),
    }
    rows = {}
    for name, (new, old) in pairs.items():
        new(), old()  # warm both paths (imports, page cache)
        times_new, times_old = [], []
        for _ in range(args.rounds):
            times_new.append(timed(new))
            times_old.append(timed(old))
        rows[name] = {
            "allow_list_s": statistics.median(times_new),
            "plain_pickle_s": statistics.median(times_old),
            "ratio_new_over_old": statistics.median(times_new) / statistics.median(times_old),
        }
    rows["sizes"] = {"metadata_bytes": len(metadata_bytes), "object_records": len(blobs)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=4000)
    parser.add_argument("--objects", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS / "dist_checkpoint_decode"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        path = Path(tmp) / "ckpt"
        save(build_state(args.keys, args.objects, fill=True), path)
        rows = measure(path, args)
    result = {
        "machine": machine_record() | {"torch": torch.__version__},
        "keys": args.keys,
        "objects": args.objects,
        "rounds": args.rounds,
        "results": rows,
    }
    lines = [
        f"# dist-checkpoint: allow-list decoding on load ({args.keys} keys, {args.objects} "
        f"objects, median of {args.rounds} interleaved rounds, torch {torch.__version__})",
        "",
        "| what | allow-list (ms) | plain pickle (ms) | ratio |",
        "|---|---|---|---|",
    ]
    for name in ("metadata", "objects", "load"):
        r = rows[name]
        lines.append(
            f"| {name} | {r['allow_list_s'] * 1e3:.2f} | {r['plain_pickle_s'] * 1e3:.2f} | "
            f"{r['ratio_new_over_old']:.3f} |"
        )
    lines.append("")
    lines.append(
        f"metadata file: {rows['sizes']['metadata_bytes']} bytes; {cpu_model()}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end"
    )
    text = "\n".join(lines)
    print(text)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    Path(args.out + ".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
