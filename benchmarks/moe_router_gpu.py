"""GPU part of the router benchmark: shardwork's fused Triton router against Megatron-Core's
unfused routing and Transformer Engine's fused router, on the same logits, same GPU.

Each side computes what an MoE layer needs from the router logits ``[N, E]``: the top-k
probabilities and routing map (group-limited, expert bias, scaling where the case asks) and
the aux-loss scores, then backward through the probabilities and the aux scores with fixed
random upstream gradients. Sides:

- ``shardwork[triton]``: ``shardwork.fused_kernels.router_topk(backend="triton")``, one
  fused kernel forward and one backward;
- ``shardwork[torch]``: the same call on the torch reference backend;
- ``megatron``: Megatron-Core's ``topk_routing_with_score_function(fused=False)`` plus
  ``compute_routing_scores_for_aux_loss(fused=False)`` (when megatron-core imports);
- ``megatron[te]``: the same with ``fused=True`` (Transformer Engine's fused router), only where
  Transformer Engine imports; otherwise the row records why it did not run.

Routing maps are compared exactly with Megatron's and probabilities at fp32 rounding before
anything is timed. Times are CUDA-event medians; the ratio is side time / shardwork[triton].

    python benchmarks/moe_router_gpu.py     # needs CUDA; writes results/moe_router-gpu.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from shardwork.fused_kernels import router_topk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_record

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {
    # DeepSeek-V3's router: 256 experts, top-8 of 4 of 8 groups, sigmoid, bias, scale 2.5.
    "deepseek-v3": dict(experts=256, topk=8, score="sigmoid", groups=8, group_topk=4,
                        bias=True, scale=2.5),
    # Qwen3-MoE-like: 128 experts, top-8, softmax after top-k.
    "qwen3-moe": dict(experts=128, topk=8, score="softmax", groups=None, group_topk=None,
                      bias=False, scale=None),
}  # fmt: skip


def shardwork_side(backend: str, case: dict, bias):
    def run(logits):
        out = router_topk(
            logits, topk=case["topk"], score_function=case["score"],
            num_groups=case["groups"], group_topk=case["group_topk"], expert_bias=bias,
            scaling_factor=case["scale"], backend=backend,
        )  # fmt: skip
        return out.probs, out.routing_map, out.scores_for_aux

    return run


def megatron_side(case: dict, bias, fused: bool):
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        topk_routing_with_score_function,
    )

    def run(logits):
        probs, routing_map = topk_routing_with_score_function(
            logits, case["topk"], num_groups=case["groups"], group_topk=case["group_topk"],
            scaling_factor=case["scale"], score_function=case["score"], expert_bias=bias,
            fused=fused,
        )  # fmt: skip
        _, scores = compute_routing_scores_for_aux_loss(
            logits, case["topk"], case["score"], fused=fused
        )
        return probs, routing_map, scores

    return run


def sides_for(case: dict, bias) -> tuple[dict, dict]:
    sides = {"shardwork[triton]": shardwork_side("triton", case, bias),
             "shardwork[torch]": shardwork_side("torch", case, bias)}  # fmt: skip
    skipped = {}
    try:
        sides["megatron"] = megatron_side(case, bias, fused=False)
    except ImportError as err:
        skipped["megatron"] = f"megatron-core not importable: {err}"
    try:
        import transformer_engine.pytorch  # noqa: F401

        sides["megatron[te]"] = megatron_side(case, bias, fused=True)
    except ImportError as err:
        skipped["megatron[te]"] = f"Transformer Engine not importable: {err}"
    return sides, skipped


def fwd_bwd(run, logits, grad_probs, grad_scores):
    x = logits.detach().requires_grad_(True)
    probs, routing_map, scores = run(x)
    (probs.float() * grad_probs).sum().add_((scores.float() * grad_scores).sum()).backward()
    return probs.detach(), routing_map, x.grad


def time_side(run, inputs, repeats: int) -> float:
    """Median milliseconds of forward + backward, by CUDA events."""
    for _ in range(3):
        fwd_bwd(run, *inputs)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fwd_bwd(run, *inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(name: str, case: dict, tokens: int, repeats: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, case["experts"], device="cuda", generator=gen)
    bias = (
        torch.randn(case["experts"], device="cuda", generator=gen) * 0.1 if case["bias"] else None
    )
    grads = (torch.randn(tokens, case["experts"], device="cuda", generator=gen),
             torch.randn(tokens, case["experts"], device="cuda", generator=gen))  # fmt: skip
    inputs = (logits, *grads)
    sides, skipped = sides_for(case, bias)
    reference = fwd_bwd(sides.get("megatron", sides["shardwork[torch]"]), *inputs)
    rows = []
    for side, run in sides.items():
        probs, routing_map, grad = fwd_bwd(run, *inputs)
        row = {"case": name, "tokens": tokens, "side": side,
               "map_equal": bool(torch.equal(routing_map.bool(), reference[1].bool())),
               "probs_max_err": float((probs.float() - reference[0].float()).abs().max()),
               "grad_max_err": float((grad - reference[2]).abs().max())}  # fmt: skip
        row["ms"] = time_side(run, inputs, repeats)
        rows.append(row)
    base = next(r["ms"] for r in rows if r["side"] == "shardwork[triton]")
    for row in rows:
        row["ratio_vs_triton"] = row["ms"] / base
    rows += [
        {"case": name, "tokens": tokens, "side": s, "not_run": why} for s, why in skipped.items()
    ]
    return rows


def markdown(result: dict) -> str:
    lines = [f"# MoE router on {result['device']}", "",
             "forward + backward of probs and aux scores; ratio = side ms / shardwork[triton] ms "
             "(> 1: the fused kernel is faster); errors against Megatron-Core's unfused path.", "",
             "| case | tokens | side | ms | ratio | map equal | probs max err | grad max err |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if "not_run" in r:
            lines.append(
                f"| {r['case']} | {r['tokens']} | {r['side']} | not run: {r['not_run'][:120]} | | | | |"
            )
        else:
            lines.append(f"| {r['case']} | {r['tokens']} | {r['side']} | {r['ms']:.3f} | "
                         f"{r['ratio_vs_triton']:.2f} | {r['map_equal']} | {r['probs_max_err']:.2e} | "
                         f"{r['grad_max_err']:.2e} |")  # fmt: skip
    return "\n".join([*lines, "", f"machine: {json.dumps(result['machine'])}", ""])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_router_gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    rows = [r for name, case in CASES.items() for t in args.tokens
            for r in run_case(name, case, t, args.repeats)]  # fmt: skip
    result = {"benchmark": "moe_router_gpu", "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "machine": machine_record(), "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_router-gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "moe_router-gpu.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
