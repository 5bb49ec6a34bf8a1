"""Run shardwork's router conformance kit against Megatron-Core 0.19.2's ``TopKRouter``.

A development aid (not CI): it shows the kit used as another framework would use it, and
which options Megatron-Core and shardwork agree on. Run it with any interpreter; it
re-executes itself in the scratch Megatron-Core environment ``tools/megatron_env.py`` builds::

    uv run python tools/moe_router_conformance_megatron.py

Megatron injects its aux-loss gradients in backward (``MoEAuxLossAutoScaler``, scale 1 here)
and logs loss values in its metrics tracker, which the candidate reports as ``loss_values``.
Options Megatron does not have (``group_score_top_n``) make the candidate raise, which the kit
reports as a disagreement on that option.
"""

from __future__ import annotations

import sys

import megatron_env

megatron_env.reexec_under_megatron()  # nothing when megatron.core is importable here

import moe_router_golden as golden  # noqa: E402  (Megatron on CPU, its config mapping)
import torch  # noqa: E402

from shardwork.moe_router.conformance import RouterOutput, run_conformance  # noqa: E402

# Megatron's tracker names -> the kit's loss names
LOSSES = {
    "load_balancing_loss": "aux_loss",
    "seq_load_balancing_loss": "seq_aux_loss",
    "global_load_balancing_loss": "global_aux_loss",
    "z_loss": "z_loss",
}


def megatron_candidate(case) -> RouterOutput:
    fields = {
        k: v
        for k, v in vars(case.config).items()
        if not k.startswith("_") and v != getattr(type(case.config), k, object())
    }
    if case.config.group_score_top_n is not None:
        raise NotImplementedError("Megatron-Core has no group_score_top_n option")
    mapped = {k: fields[k] for k in golden.FIELD_MAP if k in fields}
    mcfg = golden.megatron_config(mapped)
    router = golden.MTopKRouter(mcfg, pg_collection=golden.moe_utils.get_default_pg_collection())
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(case.weight)
        if case.expert_bias is not None:
            router.expert_bias.copy_(case.expert_bias)
    golden.moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    tracker = golden.get_moe_metrics_tracker()
    tracker._metrics.clear()
    router.train()
    probs, routing_map = router(case.hidden)
    values = {
        LOSSES[key]: float(tracker.metrics[key].values[0])
        for key in LOSSES
        if key in tracker.metrics
    }
    return RouterOutput(
        probs=probs, routing_map=routing_map, weight=router.weight, loss_values=values
    )


def main() -> None:
    import tempfile

    tmp = tempfile.mkdtemp()
    golden.dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    golden.parallel_state.initialize_model_parallel()
    report = run_conformance(megatron_candidate)
    print(report.summary())
    print(f"\nagree: {len(report.agreeing_options())}, differ: {report.disagreeing_options()}")


if __name__ == "__main__":
    sys.exit(main())
