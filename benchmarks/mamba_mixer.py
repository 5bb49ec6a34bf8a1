"""Benchmark the Mamba-2 mixer: shardwork's plain-torch ``Mamba2Mixer`` vs transformers'
``NemotronHMamba2Mixer`` torch path (mamba-ssm / causal-conv1d absent), forward + backward.

Same process, same weights (mapped by ``mamba_from_hf``), same input and output gradient,
float32. Outputs are checked to agree (rtol 1e-3 at the output's scale) before timing. Rounds
alternate between the two (ours, theirs, ours, ...) so that load on a shared machine hits
both alike; the median of each is reported as tokens/s, and the ratio ours / theirs (goal
>= 1.0). Writes benchmarks/results/mamba_mixer.json and .md.

Usage: uv run python benchmarks/mamba_mixer.py [--seq 512] [--batch 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
from machine import machine_record
from transformers.models.nemotron_h import modeling_nemotron_h as hf
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.utils import logging as hf_logging

from shardwork.models import AttentionInputs, GPTConfig, Mamba2Mixer
from shardwork.models.hf.mamba_weights import (
    mamba_config_from_hf,
    mamba_config_to_hf,
    mamba_from_hf,
)
from shardwork.parallel_state import ProcessGroups

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
NO_POSITIONS = AttentionInputs(cos=torch.empty(0), sin=torch.empty(0), mask=None)


def _models(args):
    hf_cfg = NemotronHConfig(
        hidden_size=args.hidden,
        mamba_num_heads=args.heads,
        mamba_head_dim=args.head_dim,
        ssm_state_size=args.state,
        n_groups=args.groups,
        chunk_size=args.chunk,
        num_hidden_layers=1,
        layers_block_type=["mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        intermediate_size=2 * args.hidden,
    )
    theirs = hf.NemotronHMamba2Mixer(hf_cfg, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        theirs.norm.weight.add_(1.0)
        theirs.A_log.copy_(torch.rand(args.heads, generator=gen) * 2.7)
    mamba = mamba_config_from_hf(hf_cfg)
    assert mamba_config_to_hf(mamba, norm_epsilon=hf_cfg.layer_norm_epsilon)["n_groups"] == (
        args.groups
    )
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=4,
        ffn_hidden_size=2 * args.hidden,
        vocab_size=128,
        mamba=mamba,
    )
    ours = Mamba2Mixer(cfg, ProcessGroups.single())
    mapped = mamba_from_hf(theirs.state_dict(), "")
    with torch.no_grad():
        for key, st in ours.sharded_state_dict().items():
            st.data.copy_(mapped[key])
    return ours, theirs


def _step_fns(ours, theirs, x, grad):
    """Forward + backward of each, on ``[b, s, h]`` inputs (ours takes ``[s, b, h]``)."""
    xs = x.transpose(0, 1).contiguous().requires_grad_()
    xh = x.clone().requires_grad_()
    gs = grad.transpose(0, 1).contiguous()

    def run_ours():
        y = ours(xs, NO_POSITIONS)
        y.backward(gs)
        return y.transpose(0, 1)

    def run_theirs():
        y = theirs(xh)
        y.backward(grad)
        return y

    return run_ours, run_theirs


def _interleaved(fns, rounds):
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--state", type=int, default=64)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    hf_logging.set_verbosity_error()  # the "falling back to torch" notices
    torch_path = all(importlib.util.find_spec(p) is None for p in ("mamba_ssm", "causal_conv1d"))
    assert torch_path, "mamba-ssm / causal-conv1d installed: transformers would not run torch"
    ours, theirs = _models(args)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
    grad = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
    run_ours, run_theirs = _step_fns(ours, theirs, x, grad)
    a, b = run_ours().detach(), run_theirs().detach()  # also the warm-up round
    scale = float(b.abs().max())
    err = float((a - b).abs().max())
    assert err <= 1e-3 * scale, (err, scale)
    medians = _interleaved({"shardwork": run_ours, "transformers": run_theirs}, args.rounds)
    tokens = args.batch * args.seq
    row = {
        **{f"{k}_tokens_per_s": tokens / v for k, v in medians.items()},
        **{f"{k}_ms": v * 1e3 for k, v in medians.items()},
        "ratio": medians["transformers"] / medians["shardwork"],
        "max_abs_diff_over_scale": err / scale,
    }
    print(json.dumps(row, indent=2))
    machine = machine_record() | {
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    shapes = {k: v for k, v in vars(args).items() if k != "rounds"} | {"rounds": args.rounds}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"machine": machine, "shapes": shapes, "dtype": "float32", "row": row}
    (RESULTS / "mamba_mixer.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "# Mamba-2 mixer, forward + backward, float32, median of interleaved rounds",
        "",
        f"Machine: {machine}",
        f"Shapes: {shapes}",
        "",
        "| implementation | ms / step | tokens/s |",
        "|---|---|---|",
        f"| shardwork Mamba2Mixer | {row['shardwork_ms']:.1f} | "
        f"{row['shardwork_tokens_per_s']:.0f} |",
        f"| transformers NemotronHMamba2Mixer (torch path) | {row['transformers_ms']:.1f} | "
        f"{row['transformers_tokens_per_s']:.0f} |",
        "",
        f"Ratio shardwork / transformers throughput: **{row['ratio']:.2f}** (goal >= 1.0).",
    ]
    (RESULTS / "mamba_mixer.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
