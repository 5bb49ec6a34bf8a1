"""Bytes per rank of DDP buffers, fp32 master weights and AdamW state, with and without LoRA.

A tiny Llama-3-style model (``tiny-llama3-8b`` preset, bf16 parameters) on 2 gloo ranks at
DP=2 with the ZeRO-1 ``DistributedOptimizer`` (and at TP=2), after one real training step
(forward, backward, optimizer step), so every number is what was actually allocated:

- param buffer / grad buffer: DDP's contiguous buffers (bf16 params, fp32 gradients), which
  hold trainable parameters only (frozen ones are left out);
- masters: fp32 copies of this rank's shard of the bf16 parameters;
- optimizer state: AdamW's ``exp_avg`` / ``exp_avg_sq`` (fp32) of this rank's shard.

The base weights exist in both runs (the model itself); only what training adds differs.
Layouts: TP=1 DP=2, TP=2 DP=1 (2 ranks) and TP=2 DP=2 (4 ranks); rank 0's numbers, full
fine-tuning and LoRA side by side with their ratio.
Usage: ``uv run python benchmarks/lora_memory.py`` (about a minute); prints a Markdown table
and writes ``results/lora_memory.json`` and ``results/lora_memory.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from machine import machine_record

from shardwork.dist_optimizer import DDPConfig, DistributedDataParallel, build_optimizer
from shardwork.models import GPTModel, LoRAConfig, apply_lora, preset
from shardwork.models.testing import random_batch
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

LORA = LoRAConfig(rank=8, alpha=16.0, target_modules=("linear_qkv", "linear_proj", "fc1", "fc2"))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


RESULTS = Path(__file__).parent / "results"
LAYOUTS = ((1, 2), (2, 1), (2, 2))  # (tp, dp)


def measure(tp: int, lora: bool) -> dict[str, int]:
    """One training step at (tp, dp = world / tp); this rank's allocated bytes (and its
    trainable element count)."""
    groups = init_process_groups(ParallelConfig(tp=tp))
    cfg = preset("tiny-llama3-8b", params_dtype=torch.bfloat16)
    model = GPTModel(cfg, groups)
    if lora:
        apply_lora(model, LORA)
    ddp = DistributedDataParallel(
        model,
        config=DDPConfig(use_distributed_optimizer=True, average_gradients=False),
        process_groups=groups,
    )
    opt = build_optimizer(
        ddp, lambda params: torch.optim.AdamW(params, lr=1e-3), process_groups=groups
    )
    ids, labels = random_batch(cfg.vocab_size, seed=groups.rank("dp"))
    loss_sum, n = ddp(ids, labels=labels)
    (loss_sum / n).backward()
    opt.step()
    masters = [m.master for part in opt.parts for m in part.masters if not m.master_is_view]
    state = [
        t
        for part in opt.parts
        if part.optimizer is not None
        for s in part.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    ]
    return {
        "model params (all, this rank)": _bytes(model.parameters()),
        "trainable elements": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "param buffer": _bytes(b.param_data for b in ddp.buffers.values()),
        "grad buffer": _bytes(b.grad_data for b in ddp.buffers.values()),
        "fp32 masters": _bytes(masters),
        "optimizer state": _bytes(state),
    }


def main() -> None:
    rows = {}
    for tp, dp in LAYOUTS:
        for lora in (False, True):
            rows[(tp, dp, lora)] = run_on_ranks(measure, tp * dp, args=(tp, lora))[0]
    names = list(next(iter(rows.values())))
    lines = [
        "| rank 0 | "
        + " | ".join(f"TP={tp} DP={dp}: full, LoRA r=8, ratio" for tp, dp in LAYOUTS)
        + " |"
    ]
    lines.append("|---" * (len(LAYOUTS) + 1) + "|")
    for name in names:
        cells = []
        for tp, dp in LAYOUTS:
            full, lora = rows[(tp, dp, False)][name], rows[(tp, dp, True)][name]
            cells.append(f"{full:,} / {lora:,} / {lora / full:.3f}")
        unit = "" if name == "trainable elements" else " (bytes)"
        lines.append(f"| {name}{unit} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    machine = machine_record() | {"device": "cpu", "torch": torch.__version__}
    out = {
        "machine": machine,
        "model": "tiny-llama3-8b, bf16 parameters, fp32 gradients, ZeRO-1 AdamW",
        "lora": {"rank": LORA.rank, "target_modules": list(LORA.target_modules)},
        "rank0": [
            {"tp": tp, "dp": dp, "lora": lora, **values} for (tp, dp, lora), values in rows.items()
        ],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora_memory.json").write_text(json.dumps(out, indent=2) + "\n")
    header = [
        "# Bytes per rank with and without LoRA (rank 0, after one AdamW step)",
        "",
        f"Machine: {machine}",
        "",
        "Cells: full fine-tuning / LoRA r=8 on linear_qkv, linear_proj, fc1, fc2 / ratio.",
        "",
    ]
    (RESULTS / "lora_memory.md").write_text("\n".join(header) + table + "\n")


if __name__ == "__main__":
    main()
