"""How idle OpenMP threads wait: sleep at once, spin briefly, or spin without bound.

``shardwork-train`` sets ``OMP_WAIT_POLICY=PASSIVE`` (``shardwork.trainer.cpu_runtime``) unless
the environment says otherwise. This measures it against a short spin before sleeping
(GNU OpenMP's ``GOMP_SPINCOUNT``, which overrides the passive policy's zero) and unbounded
spinning, each in fresh processes (OpenMP reads them once, when torch loads):

- a small op: ``mul`` + ``clamp_`` on a ``[256, 192]`` float32 tensor at 2 torch threads, so each
  op is one parallel region (microseconds per op, best of 5 loops of 6,000 ops);
- with ``--steps N``: ``shardwork-train --schedule.train_steps N`` (the demo model), wall time;
- with ``--busy K``: the same while K other processes keep a core busy each, the shared-machine
  case that motivated the passive policy.

    uv run python benchmarks/openmp_wait.py --steps 60 --busy 0 2

Writes benchmarks/results/openmp_wait.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_record

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {
    "passive, sleep at once (shardwork-train)": {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "0",
    },
    "passive + 1000 spins": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
    "passive + 3000 spins": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"},
    "passive + 10000 spins": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"},
    "active (spin without bound)": {"OMP_WAIT_POLICY": "ACTIVE"},
}
SMALL_OP = """
import time, torch
torch.set_num_threads(2)
x, y = torch.randn(256, 192), torch.randn(256, 192)
def loop(n=3000):
    start = time.perf_counter()
    for _ in range(n):
        torch.mul(x, y, out=x)
        x.clamp_(-2, 2)
    return (time.perf_counter() - start) / (2 * n) * 1e6
loop(200)
print(min(loop() for _ in range(5)))
"""


def _env(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return env | setting


def small_op_us(setting: dict[str, str]) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SMALL_OP], env=_env(setting), capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def demo_seconds(setting: dict[str, str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "shardwork.trainer", "--schedule.train_steps", str(steps),
               "--logging.run_dir", f"{tmp}/run", "--checkpoint.dir", f"{tmp}/ckpt",
               "--logging.progress", "lines"]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(cmd, env=_env(setting), capture_output=True, check=True)
        return time.perf_counter() - start


def measure(busy: int, steps: int) -> list[dict]:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        rows = []
        for name, setting in SETTINGS.items():
            row = {
                "busy": busy,
                "setting": name,
                "env": setting,
                "small_op_us": small_op_us(setting),
            }
            if steps:
                row["demo_s"] = demo_seconds(setting, steps)
            rows.append(row)
            print(json.dumps(row))
        return rows
    finally:
        for hog in hogs:
            hog.kill()


def markdown(result: dict) -> str:
    lines = [
        "# Idle OpenMP threads: sleep, spin briefly, or spin",
        "",
        "Small op: `mul` + `clamp_` on `[256, 192]` float32, 2 torch threads, µs per op (best "
        "of 5 loops). Demo: `shardwork-train --schedule.train_steps "
        f"{result['steps']}`, wall seconds (one run each). Busy: other processes spinning, one "
        "core each.",
        "",
        "| busy processes | setting | small op µs | demo s |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        demo = f"{r['demo_s']:.1f}" if "demo_s" in r else ""
        lines.append(f"| {r['busy']} | {r['setting']} | {r['small_op_us']:.1f} | {demo} |")
    lines += ["", f"Machine: {json.dumps(result['machine'])}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=0, help="also time the demo for N steps")
    ap.add_argument("--busy", type=int, nargs="+", default=[0], help="busy processes, per pass")
    args = ap.parse_args()
    rows = [row for busy in args.busy for row in measure(busy, args.steps)]
    result = {"benchmark": "openmp_wait", "steps": args.steps, "machine": machine_record(),
              "rows": rows}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "openmp_wait.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "openmp_wait.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
