"""Bytes per rank of DDP buffers, fp32 master weights and AdamW state, with and without LoRA.

A tiny Llama-3-style model (``tiny-llama3-8b`` preset, bf16 parameters) on 2 gloo ranks at
DP=2 with the ZeRO-1 ``DistributedOptimizer`` (and at TP=2), after one real training step
(forward, backward, optimizer step), so every number is what was actually allocated:

- param buffer / grad buffer: DDP's contiguous buffers (bf16 params, fp32 gradients), which
  hold trainable parameters only (frozen ones are left out);
- masters: fp32 copies of this rank's shard of the bf16 parameters;
- optimizer state: AdamW's ``exp_avg`` / ``exp_avg_sq`` (fp32) of this rank's shard.

The base weights exist in both runs (the model itself); only what training adds differs.
Usage: ``uv run python benchmarks/lora_memory.py`` (about 20 s); prints a Markdown table.
"""

from __future__ import annotations

import torch

from shardwork.dist_optimizer import DDPConfig, DistributedDataParallel, build_optimizer
from shardwork.models import GPTModel, LoRAConfig, apply_lora, preset
from shardwork.models.testing import random_batch
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

LORA = LoRAConfig(rank=8, alpha=16.0, target_modules=("linear_qkv", "linear_proj", "fc1", "fc2"))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(tp: int, lora: bool) -> dict[str, int]:
    """One training step at (tp, dp = 2 / tp); this rank's allocated bytes."""
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
        "trainable params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "param buffer": _bytes(b.param_data for b in ddp.buffers.values()),
        "grad buffer": _bytes(b.grad_data for b in ddp.buffers.values()),
        "fp32 masters": _bytes(masters),
        "optimizer state": _bytes(state),
    }


def main() -> None:
    rows = {}
    for tp in (1, 2):
        for lora in (False, True):
            rows[(tp, lora)] = run_on_ranks(measure, 2, args=(tp, lora))[0]
    names = list(next(iter(rows.values())))
    head = " | ".join(f"TP={tp} DP={2 // tp} {'LoRA r=8' if lora else 'full'}" for tp, lora in rows)
    print(f"| rank 0, bytes | {head} |")
    print("|---" * (len(rows) + 1) + "|")
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r[name]:,}" for r in rows.values()) + " |")


if __name__ == "__main__":
    main()
