"""Benchmark shardwork's Gated DeltaNet mixer against transformers' Qwen3NextGatedDeltaNet.

Both on their plain-torch paths (no flash-linear-attention / causal-conv1d: asserted), same
weights (transformers' random init mapped with ``deltanet_from_hf``), same inputs and output
gradient, forward + backward, in one process. Rounds alternate between the two (so machine
load drifts hit both alike); the median per implementation is reported as tokens/s, with the
ratio shardwork / transformers, and the same by process CPU time. Outputs are checked equal (float32 rounding) before timing.
Writes benchmarks/results/deltanet_mixer.json and .md.

Usage: uv run python benchmarks/deltanet_mixer.py [--batch 2] [--seq 512] [--rounds 11] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from shardwork.models import AttentionInputs, GatedDeltaNetConfig, GPTConfig, layout_groups
from shardwork.models.deltanet import GatedDeltaNetMixer
from shardwork.models.hf.deltanet_weights import deltanet_config_to_hf, deltanet_from_hf
from shardwork.parallel_state import ParallelConfig

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _modules(args):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    for package in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(package) is None, f"{package} is installed"
    gdn = GatedDeltaNetConfig(
        num_key_heads=args.key_heads,
        num_value_heads=args.value_heads,
        key_head_dim=args.head_dim,
        value_head_dim=args.head_dim,
        chunk_size=64,
    )
    hf_config = Qwen3NextConfig(
        hidden_size=args.hidden,
        hidden_act="silu",
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        **deltanet_config_to_hf(gdn),
    )
    torch.manual_seed(0)
    theirs = Qwen3NextGatedDeltaNet(hf_config, layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.key_heads,
        ffn_hidden_size=args.hidden,
        vocab_size=128,
        norm_epsilon=hf_config.rms_norm_eps,
        linear_attention=gdn,
    )
    ours = GatedDeltaNetMixer(cfg, layout_groups(ParallelConfig(), 1, 0))
    tensors = deltanet_from_hf(dict(theirs.state_dict()), "", gdn)
    with torch.no_grad():
        for key, st in ours.sharded_state_dict().items():
            st.data.copy_(tensors[key])
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--key-heads", type=int, default=4)
    ap.add_argument("--value-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=11)
    # One intra-op thread by default: on the shared 2-core machine two threads per process
    # oversubscribe the cores and the wall times swing by 5x from run to run.
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ours, theirs = _modules(args)
    b, s, h = args.batch, args.seq, args.hidden
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, h, generator=gen)
    grad = torch.randn(b, s, h, generator=gen)
    inputs = AttentionInputs(cos=torch.ones(s, 1, 2), sin=torch.zeros(s, 1, 2), mask=None)

    def run_ours():
        xs = x.transpose(0, 1).clone().requires_grad_()
        y = ours(xs, inputs)
        y.backward(grad.transpose(0, 1))
        return y.transpose(0, 1)

    def run_theirs():
        xs = x.clone().requires_grad_()
        y = theirs(xs)
        y.backward(grad)
        return y

    runs = {"shardwork": run_ours, "transformers": run_theirs}
    torch.testing.assert_close(run_ours(), run_theirs(), rtol=1e-4, atol=1e-5)  # also warms up
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    median = {name: statistics.median(t) for name, t in times.items()}
    # CPU seconds of the process (all its threads): on a shared, oversubscribed machine this
    # moves less than wall time, since time spent waiting for a core is not counted.
    median_cpu = {name: statistics.median(t) for name, t in cpu.items()}
    tokens = {name: b * s / m for name, m in median.items()}
    ratio = tokens["shardwork"] / tokens["transformers"]
    cpu_ratio = median_cpu["transformers"] / median_cpu["shardwork"]
    machine = dict(
        device=platform.processor() or "cpu",
        dtype="torch.float32",
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        load_average=os.getloadavg(),
    )
    shape = dict(vars(args))
    result = dict(
        machine=machine,
        shape=shape,
        median_s=median,
        median_cpu_s=median_cpu,
        tokens_per_s=tokens,
        ratio=ratio,
        cpu_ratio=cpu_ratio,
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deltanet_mixer.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Gated DeltaNet mixer, forward + backward, median of interleaved rounds",
        "",
        f"Machine: {machine}",
        "",
        f"Shape: {shape}",
        "",
        "| implementation | median wall ms | tokens/s | median CPU ms |",
        "|---|---|---|---|",
        *(
            f"| {n} | {median[n] * 1e3:.1f} | {tokens[n]:.0f} | {median_cpu[n] * 1e3:.1f} |"
            for n in runs
        ),
        "",
        f"Ratio shardwork / transformers (tokens/s, wall): {ratio:.2f}; "
        f"by CPU time: {cpu_ratio:.2f}",
    ]
    (RESULTS / "deltanet_mixer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
