"""Trainer overhead: shardwork-train vs a hand-written PyTorch loop; 4 vs 1 CPU ranks.

1. Overhead. The same tiny GPT (shardwork.models, same layout-independent init), the same
   AdamW hyper-parameters, the same micro-batches (read from the trainer's own dataset),
   trained for N steps by ``shardwork.trainer.run.trainer.train`` (world size 1: ZeRO-1
   DistributedOptimizer over DDP buffers, pipeline schedule, finalize_model_grads, global
   grad-norm clipping, logging) and by a plain loop (forward, ``(loss_sum / n).backward()``,
   ``clip_grad_norm_``, ``torch.optim.AdamW.step``). Runs alternate A/B/A/B... and the median
   loop tokens/s of each is compared: overhead = plain / trainer − 1 (goal ≤ 3 %).
2. Scaling. ``torchrun`` with 4 ranks (dp = 4) vs 1 rank on the same global batch; tokens/s
   of the training loop from each run's metrics (on a 2-core machine 4 ranks share 2 cores).

    uv run python benchmarks/trainer_overhead.py [--steps 30] [--repeats 3] [--no-scaling]

Writes benchmarks/results/trainer_overhead.json (machine, load average, every sample).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what shardwork-train sets, for both sides

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "trainer_overhead.json"
MODEL = {
    "num_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "ffn_hidden_size": 352,
}


def sections(steps: int) -> dict:
    return {
        "model": MODEL,
        "data": {"seq_length": 128},
        "schedule": {
            "train_steps": steps,
            "global_batch_size": 16,
            "micro_batch_size": 8,
            "warmup_steps": 0,
            "lr_schedule": "constant",
        },
        "optimizer": {"lr": 1e-3, "min_lr": 1e-3, "clip_grad": 1.0},
        "eval": {"interval": None, "at_end": False},
        "logging": {"interval": steps, "progress": "none", "tensorboard": False, "plot": False},
    }


def run_trainer(run_dir: Path, steps: int) -> tuple[float, list[float]]:
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    result = train(tiny_config(run_dir, **sections(steps)), stream=io.StringIO())
    return result.tokens / result.loop_seconds, [result.train_losses[s] for s in range(steps)]


def run_plain(run_dir: Path, steps: int) -> tuple[float, list[float]]:
    """The hand-written loop on the same model, optimizer settings and micro-batches."""
    from shardwork.models import GPTModel
    from shardwork.trainer.data.builder import build_blend, micro_batch, split_components
    from shardwork.trainer.model_factory import gpt_config
    from shardwork.trainer.testing import tiny_config

    config = tiny_config(run_dir, **sections(steps))
    model = GPTModel(gpt_config(config))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    o = config.optimizer
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    s = config.schedule
    data = build_blend(
        split_components(config.data)["train"],
        size=steps * s.global_batch_size,
        seq_length=config.data.seq_length,
        seed=config.seed,
        shuffle=True,
    )
    micro = s.global_batch_size // s.micro_batch_size
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        batches = [
            micro_batch(
                data,
                consumed=step * s.global_batch_size,
                index=m,
                micro_batch_size=s.micro_batch_size,
                dp_rank=0,
                dp_size=1,
            )
            for m in range(micro)
        ]
        total_tokens = sum(b[:, 1:].numel() for b in batches)
        loss_total = 0.0
        for rows in batches:
            loss_sum, _ = model(input_ids=rows[:, :-1], labels=rows[:, 1:])
            (loss_sum / total_tokens).backward()
            loss_total += float(loss_sum.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_total / total_tokens)
    elapsed = time.perf_counter() - start
    return steps * s.global_batch_size * config.data.seq_length / elapsed, losses


def run_torchrun(ranks: int, run_dir: Path, steps: int) -> float:
    """Loop tokens/s of shardwork-train under torchrun with ``ranks`` data-parallel ranks."""
    sec = sections(steps)
    sec["schedule"]["micro_batch_size"] = 4
    sec["logging"]["interval"] = max(1, steps // 2)
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "shardwork.trainer",
        "--logging.run_dir",
        str(run_dir),
        "--checkpoint.save_at_end",
        "false",
        "--checkpoint.resume",
        "none",
    ]
    for name, values in sec.items():
        for key, value in values.items():
            if isinstance(value, dict):
                continue
            args += [
                f"--{name}.{key}",
                str(value).lower() if isinstance(value, bool) else str(value),
            ]
    for key, value in MODEL.items():
        args += [f"--model.{key}", str(value)]
    subprocess.run(args, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    return float(train[-1]["tokens_per_s"])  # second half of the run: past warm-up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-scaling", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("SHARDWORK_CACHE", str(Path(tempfile.gettempdir()) / "shardwork-bench"))
    out: dict = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_avg_start": os.getloadavg(),
        },
        "config": {"model": MODEL, "seq_length": 128, "global_batch": 16, "steps": args.steps},
    }
    trainer_tps, plain_tps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            tps, trainer_losses = run_trainer(Path(tmp) / f"t{r}", args.steps)
            trainer_tps.append(tps)
            tps, plain_losses = run_plain(Path(tmp) / f"p{r}", args.steps)
            plain_tps.append(tps)
        max_diff = max(abs(a - b) for a, b in zip(trainer_losses, plain_losses))
        t_med, p_med = statistics.median(trainer_tps), statistics.median(plain_tps)
        out["overhead"] = {
            "trainer_tokens_per_s": trainer_tps,
            "plain_tokens_per_s": plain_tps,
            "trainer_median": t_med,
            "plain_median": p_med,
            "overhead": p_med / t_med - 1.0,
            "goal": 0.03,
            "max_abs_loss_difference": max_diff,
        }
        print(f"{'loop':<28}{'tokens/s (median)':>20}{'samples':>40}")
        print(
            f"{'shardwork-train (world 1)':<28}{t_med:>20.0f}{[round(x) for x in trainer_tps]!s:>40}"
        )
        print(
            f"{'hand-written PyTorch loop':<28}{p_med:>20.0f}{[round(x) for x in plain_tps]!s:>40}"
        )
        print(
            f"overhead = plain / trainer - 1 = {100 * (p_med / t_med - 1):+.1f}% (goal <= 3%); "
            f"max |loss difference| over {args.steps} steps: {max_diff:.2e}"
        )
        if not args.no_scaling:
            one = run_torchrun(1, Path(tmp) / "r1", args.steps)
            four = run_torchrun(4, Path(tmp) / "r4", args.steps)
            out["scaling"] = {
                "ranks_1_tokens_per_s": one,
                "ranks_4_tokens_per_s": four,
                "speedup": four / one,
            }
            print(
                f"torchrun dp: 1 rank {one:.0f} tok/s, 4 ranks {four:.0f} tok/s, "
                f"speed-up {four / one:.2f}x on {os.cpu_count()} cores"
            )
    out["machine"]["load_avg_end"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
