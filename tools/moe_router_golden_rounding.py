"""Measure the rounding spread behind the moe-router golden test's tolerance.

    uv run python tools/moe_router_golden_rounding.py
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 uv run python tools/moe_router_golden_rounding.py

For every fp32 case of packages/moe-router/tests/fixtures/megatron_router_golden.pt it prints,
per output, the largest error in fp32 ulp of the tensor's max|ref| (``ulps_of_scale``) of:
ours vs Megatron's fixture, ours vs our router run in float64 on the same inputs, and the
fixture vs that float64 run (cases with input jitter are left out of the float64 columns:
their noise is drawn in fp32). The golden test's ``ULPS`` is chosen from these numbers with
margin (docs/moe-router.md, "Portable tolerances").
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from shardwork.moe_router import AuxLossScale, AuxLossTracker, RouterConfig, TopKRouter
from shardwork.parallel_state.testing import ulps_of_scale

TEST = Path(__file__).resolve().parents[1] / "packages/moe-router/tests/test_golden_megatron.py"


def _golden_module():
    """The golden test module (its fixture loading and ``run_ours``), imported by path."""
    spec = importlib.util.spec_from_file_location("golden_megatron", TEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_fp64(case: dict):
    """Our router in float64 on the case's inputs: (router, tracker, [(probs, map, grad)])."""
    kw = {k: v for k, v in case["config"].items() if k != "router_dtype"}
    cfg, meta, inputs = RouterConfig(**kw), case["meta"], case["inputs"]
    tracker = AuxLossTracker(num_layers=1, num_experts=cfg.num_experts)
    scale = AuxLossScale(meta["scale"])
    router = TopKRouter(cfg, tracker=tracker, loss_scale=scale, layer_index=0).double()
    with torch.no_grad():
        router.weight.data = inputs["weight"].double().clone()
        if inputs["bias"] is not None:
            router.bias.copy_(inputs["bias"])
        if inputs["expert_bias"] is not None:
            router.expert_bias.copy_(inputs["expert_bias"])
    router.train(meta["train"])
    results = []
    for rec in case["micro_batches"]:
        x = rec["hidden"].double().clone().requires_grad_(True)
        probs, rmap = router(x, padding_mask=rec["padding_mask"])
        if meta["train"]:
            (probs * rec["grad_probs"].double()).sum().backward()
        results.append((probs.detach(), rmap, x.grad))
    return router, tracker, results


def _outputs(router, tracker, results, case):
    """(name, tensor) pairs of one run, in the golden test's order."""
    for probs, _, grad in results:
        yield "probs", probs
        yield "grad_hidden", grad
    yield "grad_weight", router.weight.grad
    values = tracker.loss_values()
    for loss_name in case["losses"]:
        yield "loss", values[loss_name][0]


def _fixture_outputs(case):
    for ref in case["micro_batches"]:
        yield "probs", ref["probs"]
        yield "grad_hidden", ref["grad_hidden"]
    yield "grad_weight", case["grad_weight"]
    for expected in case["losses"].values():
        yield "loss", expected


def main() -> None:
    golden = _golden_module()
    worst: dict[str, dict[str, float]] = {}

    def record(column, name, actual, expected):
        if actual is not None and expected is not None:
            row = worst.setdefault(name, {})
            err = ulps_of_scale(actual, expected, dtype=torch.float32)
            row[column] = max(row.get(column, 0.0), err)

    for name, case in sorted(golden.CASES.items()):
        if name in golden.POSITION_CASES or case["meta"]["dtype"] != torch.float32:
            continue
        ours = list(_outputs(*golden.run_ours(name, case), case))
        fixture = list(_fixture_outputs(case))
        for (key, a), (_, e) in zip(ours, fixture):
            record("ours vs fixture", key, a, e)
        if case["meta"]["jitter_seed"] is not None:
            continue
        exact = list(_outputs(*run_fp64(case), case))
        for (key, a), (_, e), (_, x) in zip(ours, fixture, exact):
            record("ours vs fp64", key, a, x)
            record("fixture vs fp64", key, e, x)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    columns = ("ours vs fixture", "ours vs fp64", "fixture vs fp64")
    print(f"{'output':<12}" + "".join(f"{c:>18}" for c in columns))
    for key, row in worst.items():
        print(f"{key:<12}" + "".join(f"{row.get(c, 0.0):>18.2f}" for c in columns))


if __name__ == "__main__":
    main()
