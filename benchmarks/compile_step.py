"""torch.compile per transformer layer (inductor, C++ on this CPU) vs eager: step time and compile time.

One process builds the same model twice (shardwork.models' initialisation is a function of the
parameter keys and the seed, so both hold identical weights; checked), compiles every layer of
one of them with `shardwork.models.compile_blocks` (inductor), and trains both on the same
batches with ``torch.optim.AdamW`` (forward, ``(loss_sum / tokens).backward()``, step):

- compile time: the compiled model's first step minus its median later step (the first step
  traces and compiles the layer's forward and backward; one layer kind, so once), and the
  first step's wall time itself. Inductor caches compiled graphs on disk, so a second run
  would measure a cache hit: the run uses a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (a cold
  compile, as a first training run sees) unless ``--warm-cache`` keeps the user's cache;
- speed: ``--rounds`` interleaved rounds after a warm-up step on each side, one step of each
  per round (order alternating), each timed; the ratio eager / compiled of the median step
  times (> 1: compiled is faster), and of process CPU time;
- the losses of both sides, step by step (max relative difference reported: the compiled
  layers change summation orders only);
- what dynamo did (`compile_report`: graphs, graph breaks).

The default model is the issue's dense comparison model: 4 layers, hidden 512, 8 query heads in
4 KV groups, SwiGLU 1408, vocab 8192, sequence 256, batch 4, fp32. ``--moe`` runs the MoE
variant (8 experts, top-2, expert hidden 704, every layer MoE): its dispatch runs eagerly
inside the compiled layers (see docs/models.md).

Writes ``benchmarks/results/compile_step[_moe][<suffix>].json`` and ``.md`` (``--suffix=-zen5``:
the record of a Zen 5 machine beside the Zen 4 one).
Usage: ``uv run python benchmarks/compile_step.py [--rounds 8] [--threads 2] [--moe]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import machine_record

from shardwork.models import GPTConfig, GPTModel, MoEConfig, compile_blocks, compile_report
from shardwork.moe_router import RouterConfig

RESULTS = Path(__file__).resolve().parent / "results"
DENSE = dict(
    num_layers=4,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=1408,
    vocab_size=8192,
    max_position_embeddings=256,
)
SEQ, BATCH = 256, 4


def model_config(moe: bool) -> GPTConfig:
    if not moe:
        return GPTConfig(**DENSE)
    router = RouterConfig(num_experts=8, top_k=2, hidden_size=DENSE["hidden_size"])
    return GPTConfig(**DENSE, moe=MoEConfig(router=router, ffn_hidden_size=704))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Side:
    """One model, its optimizer and its per-step timings."""

    def __init__(self, config: GPTConfig, *, compiled: bool) -> None:
        self.model = GPTModel(config)
        self.compiled_layers = compile_blocks(self.model) if compiled else 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []

    def step(self, ids: torch.Tensor) -> tuple[float, float]:
        wall0, cpu0 = time.perf_counter(), cpu_seconds()
        loss, count = self.model(ids[:, :-1], labels=ids[:, 1:])
        (loss / count).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append((loss / count).item())
        return time.perf_counter() - wall0, cpu_seconds() - cpu0


def run(config: GPTConfig, rounds: int) -> dict:
    eager, compiled = Side(config, compiled=False), Side(config, compiled=True)
    for a, b in zip(eager.model.state_dict().values(), compiled.model.state_dict().values()):
        assert torch.equal(a, b)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=gen)
        for _ in range(rounds + 1)
    ]
    eager_first = eager.step(batches[0])
    compiled_first = compiled.step(batches[0])  # traces and compiles
    for index, ids in enumerate(batches[1:]):
        order = (eager, compiled) if index % 2 == 0 else (compiled, eager)
        for side in order:
            wall, cpu = side.step(ids)
            side.wall.append(wall)
            side.cpu.append(cpu)
    med = {
        name: statistics.median(s.wall) for name, s in (("eager", eager), ("compiled", compiled))
    }
    cpu = {name: statistics.median(s.cpu) for name, s in (("eager", eager), ("compiled", compiled))}
    diff = max(abs(a - b) / abs(b) for a, b in zip(compiled.losses, eager.losses))
    report = compile_report()
    return {
        "compiled_layers": compiled.compiled_layers,
        "first_step_s": {"eager": eager_first[0], "compiled": compiled_first[0]},
        "compile_s": compiled_first[0] - med["compiled"],
        "median_step_s": med,
        "median_step_cpu_s": cpu,
        "speedup_wall": med["eager"] / med["compiled"],
        "speedup_cpu": cpu["eager"] / cpu["compiled"],
        "steps_s": {"eager": eager.wall, "compiled": compiled.wall},
        "losses": {"eager": eager.losses, "compiled": compiled.losses},
        "max_rel_loss_diff": diff,
        "graphs": report.graphs,
        "graph_breaks": report.graph_breaks,
    }


def table(result: dict, args: argparse.Namespace) -> str:
    m = result["machine"]
    kind = "MoE (8 experts, top-2)" if args.moe else "dense"
    rows = [
        f"# torch.compile per layer (inductor, C++) vs eager: {kind} training step on the CPU",
        "",
        f"{m['cpu']}, {m['cpus']} CPUs, {args.threads} torch thread(s), load average "
        f"{m['load_avg'][0]:.1f} at the end; torch {result['torch']}; 4 layers, hidden 512, "
        f"GQA 8/4, SwiGLU 1408, vocab 8192, seq {SEQ}, batch {BATCH}, fp32, AdamW; median of "
        f"{args.rounds} interleaved rounds.",
        "",
        "| | eager | compiled | eager / compiled |",
        "|---|---|---|---|",
        f"| median step, wall (s) | {result['median_step_s']['eager']:.3f} | "
        f"{result['median_step_s']['compiled']:.3f} | {result['speedup_wall']:.2f} |",
        f"| median step, process CPU (s) | {result['median_step_cpu_s']['eager']:.3f} | "
        f"{result['median_step_cpu_s']['compiled']:.3f} | {result['speedup_cpu']:.2f} |",
        f"| first step (s) | {result['first_step_s']['eager']:.2f} | "
        f"{result['first_step_s']['compiled']:.2f} | |",
        "",
        f"Compile time (first compiled step - median compiled step), inductor cache "
        f"{result['cache']}: {result['compile_s']:.1f} s for {result['compiled_layers']} layers. Max relative loss difference over "
        f"{args.rounds + 1} steps: {result['max_rel_loss_diff']:.1e}. dynamo: "
        f"{result['graphs']} graph(s), graph breaks: "
        + (", ".join(f"{k} x{v}" for k, v in result["graph_breaks"].items()) or "none")
        + ".",
    ]
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's disk cache")
    parser.add_argument("--suffix", default="",
                        help="appended to the result files' name (another machine's record)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as cache:
        if not args.warm_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read by inductor when it compiles
        result = run(model_config(args.moe), args.rounds)
    cache_state = "warm (user's cache)" if args.warm_cache else "cold (fresh cache)"
    result.update(
        torch=torch.__version__, threads=args.threads, machine=machine_record(), cache=cache_state
    )
    text = table(result, args)
    print(text)
    name = ("compile_step_moe" if args.moe else "compile_step") + args.suffix
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
