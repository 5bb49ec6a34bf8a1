"""Produce golden fixtures for shardwork-moe-router from Megatron-Core 0.19.2's TopKRouter.

Run in the scratch venv that has megatron-core (never in CI):

    /work/scratch/mcore-venv/bin/python tools/moe_router_golden.py

It writes packages/moe-router/tests/fixtures/megatron_router_golden.pt: one entry per case
with the RouterConfig keyword arguments, the inputs (hidden states, gating weight/bias,
expert bias, padding mask, upstream gradient, aux-loss scale) and Megatron's outputs
(routing map, probs, gradients of input/weight/bias, per-layer aux-loss values, expert token
counts and the updated expert bias), one set per micro-batch.

Megatron runs on CPU with torch.cuda.current_device patched to the CPU device and a 1-rank
gloo group. Where Megatron fails (expert bias with a padding mask: it broadcasts a [T] mask
against the [T, E] routing map), the expected counts are computed here from Megatron's own
routing map with the mask applied per token, and the case is flagged ``megatron_failed``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron places buffers there

import megatron.core.jit as mjit  # noqa: E402

mjit.disable_jit_fuser()  # torch.compile of a 3-line helper is not what we compare

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter as MTopKRouter  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

OUT = (
    Path(__file__).resolve().parents[1]
    / "packages/moe-router/tests/fixtures/megatron_router_golden.pt"
)

# shardwork field -> Megatron-Core TransformerConfig field
FIELD_MAP = {
    "num_experts": "num_moe_experts",
    "hidden_size": "hidden_size",
    "top_k": "moe_router_topk",
    "score_function": "moe_router_score_function",
    "pre_softmax": "moe_router_pre_softmax",
    "top_k_scaling_factor": "moe_router_topk_scaling_factor",
    "num_groups": "moe_router_num_groups",
    "group_top_k": "moe_router_group_topk",
    "load_balancing_type": "moe_router_load_balancing_type",
    "aux_loss_coeff": "moe_aux_loss_coeff",
    "z_loss_coeff": "moe_z_loss_coeff",
    "capacity_factor": "moe_expert_capacity_factor",
    "token_drop_policy": "moe_token_drop_policy",
    "pad_to_capacity": "moe_pad_expert_input_to_capacity",
    "router_dtype": "moe_router_dtype",
    "input_jitter_eps": "moe_input_jitter_eps",
    "add_bias": "add_bias_linear",
    "enable_expert_bias": "moe_router_enable_expert_bias",
    "expert_bias_update_rate": "moe_router_bias_update_rate",
    "calculate_per_token_loss": "calculate_per_token_loss",
}

LOSS_KEYS = {
    "load_balancing_loss": "load_balancing_loss",
    "seq_load_balancing_loss": "seq_load_balancing_loss",
    "global_load_balancing_loss": "global_load_balancing_loss",
    "z_loss": "z_loss",
}


def megatron_config(kw: dict) -> TransformerConfig:
    args = {"num_layers": 1, "num_attention_heads": 1, "add_bias_linear": False}
    for k, v in kw.items():
        if isinstance(v, tuple):
            v = list(v)
        args[FIELD_MAP[k]] = v
    return TransformerConfig(**args)


def case(
    name,
    config,
    *,
    S=8,
    B=4,
    micro_batches=1,
    padding=False,
    dtype=torch.float32,
    weight_std=1.0,
    train=True,
    scale=0.5,
    seed=0,
    jitter_seed=None,
):
    return dict(
        name=name,
        config=config,
        S=S,
        B=B,
        micro_batches=micro_batches,
        padding=padding,
        dtype=dtype,
        weight_std=weight_std,
        train=train,
        scale=scale,
        seed=seed,
        jitter_seed=jitter_seed,
    )


def base(**kw):
    cfg = {
        "num_experts": 8,
        "hidden_size": 16,
        "top_k": 2,
        "aux_loss_coeff": 0.0,
        "load_balancing_type": "none",
    }
    cfg.update(kw)
    return cfg


DSV3 = dict(
    num_experts=32,
    top_k=8,
    score_function="sigmoid",
    num_groups=8,
    group_top_k=4,
    top_k_scaling_factor=2.5,
    enable_expert_bias=True,
    load_balancing_type="seq_aux_loss",
    aux_loss_coeff=1e-4,
)

CASES = [
    case("softmax_post_top2_aux", base(load_balancing_type="aux_loss", aux_loss_coeff=1e-2)),
    case(
        "softmax_pre_top2_aux",
        base(pre_softmax=True, load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
    ),
    case(
        "softmax_pre_top1_aux",
        base(top_k=1, pre_softmax=True, load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
    ),
    case(
        "sigmoid_top2_aux",
        base(score_function="sigmoid", load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
    ),
    case(
        "sqrtsoftplus_top2_aux",
        base(score_function="sqrtsoftplus", load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
    ),
    case("sigmoid_top1", base(top_k=1, score_function="sigmoid")),
    case(
        "sigmoid_top4_scaled",
        base(num_experts=16, top_k=4, score_function="sigmoid", top_k_scaling_factor=2.5),
    ),
    case(
        "softmax_pre_grouped",
        base(
            num_experts=16,
            top_k=4,
            pre_softmax=True,
            num_groups=4,
            group_top_k=2,
            load_balancing_type="aux_loss",
            aux_loss_coeff=1e-2,
        ),
    ),
    case("softmax_post_grouped", base(num_experts=16, top_k=4, num_groups=4, group_top_k=2)),
    case("deepseek_v3", base(**DSV3)),
    case(
        "sqrtsoftplus_bias_grouped",
        base(
            num_experts=16,
            top_k=4,
            score_function="sqrtsoftplus",
            num_groups=4,
            group_top_k=2,
            enable_expert_bias=True,
            expert_bias_update_rate=1e-2,
        ),
    ),
    case(
        "capacity_probs_drop",
        base(capacity_factor=1.0, load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
    ),
    case("capacity_probs_pad", base(capacity_factor=1.0, pad_to_capacity=True)),
    case("capacity_low_probs_drop", base(pre_softmax=True, capacity_factor=0.5)),
    case("capacity_position_drop", base(capacity_factor=1.0, token_drop_policy="position")),
    case(
        "capacity_position_pad",
        base(capacity_factor=1.0, token_drop_policy="position", pad_to_capacity=True),
    ),
    case(
        "padding_aux_z",
        base(load_balancing_type="aux_loss", aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
        padding=True,
    ),
    case(
        "padding_seq_aux",
        base(load_balancing_type="seq_aux_loss", aux_loss_coeff=1e-2),
        padding=True,
    ),
    case(
        "padding_global_aux",
        base(load_balancing_type="global_aux_loss", aux_loss_coeff=1e-2),
        padding=True,
        micro_batches=2,
    ),
    case(
        "router_fp64",
        base(router_dtype="fp64", load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
    ),
    case("gating_bias", base(add_bias=True, load_balancing_type="aux_loss", aux_loss_coeff=1e-2)),
    case(
        "loss_list",
        base(
            load_balancing_type=("aux_loss", "seq_aux_loss", "global_aux_loss"),
            aux_loss_coeff=(1e-2, 1e-3, 5e-3),
            z_loss_coeff=1e-3,
        ),
        micro_batches=2,
    ),
    case("z_loss_only", base(z_loss_coeff=1e-2)),
    case(
        "seq_aux_sigmoid",
        base(score_function="sigmoid", load_balancing_type="seq_aux_loss", aux_loss_coeff=1e-2),
    ),
    case("sinkhorn_top1", base(top_k=1, load_balancing_type="sinkhorn")),
    case("sinkhorn_top2", base(load_balancing_type="sinkhorn")),
    case(
        "global_aux_3mb",
        base(load_balancing_type="global_aux_loss", aux_loss_coeff=1e-2),
        micro_batches=3,
    ),
    case(
        "expert_bias_update",
        base(score_function="sigmoid", enable_expert_bias=True, expert_bias_update_rate=1e-2),
        micro_batches=2,
    ),
    case(
        "expert_bias_padding",
        base(score_function="sigmoid", enable_expert_bias=True, expert_bias_update_rate=1e-2),
        padding=True,
    ),
    case(
        "per_token_loss",
        base(
            load_balancing_type=("aux_loss", "seq_aux_loss"),
            aux_loss_coeff=(1e-2, 1e-3),
            z_loss_coeff=1e-3,
            calculate_per_token_loss=True,
        ),
        padding=True,
    ),
    case(
        "jitter",
        base(input_jitter_eps=1e-2, load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
        jitter_seed=123,
    ),
    case(
        "bf16_model_fp32_router",
        base(router_dtype="fp32", load_balancing_type="aux_loss", aux_loss_coeff=1e-2),
        dtype=torch.bfloat16,
    ),
    case(
        "eval_mode",
        base(
            num_experts=16,
            top_k=4,
            **{k: v for k, v in DSV3.items() if k not in ("num_experts", "top_k")},
        ),
        train=False,
    ),
]


def run_case(c: dict) -> dict:
    cfg = c["config"]
    g = torch.Generator().manual_seed(c["seed"])
    E, H = cfg["num_experts"], cfg["hidden_size"]
    S, B = c["S"], c["B"]
    weight = (torch.randn(E, H, generator=g) * c["weight_std"] / H**0.5).to(c["dtype"])
    bias = torch.randn(E, generator=g) * 0.1 if cfg.get("add_bias") else None
    expert_bias = torch.randn(E, generator=g) * 0.05 if cfg.get("enable_expert_bias") else None
    mcfg = megatron_config(cfg)
    if cfg.get("add_bias"):
        mcfg.params_dtype = torch.float32
    router = MTopKRouter(mcfg, pg_collection=moe_utils.get_default_pg_collection())
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.data = weight.clone()
        if bias is not None:
            router.bias.data = bias.clone()
        if expert_bias is not None:
            router.expert_bias.copy_(expert_bias)
    router.train(c["train"])
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(c["scale"]))
    tracker = get_moe_metrics_tracker()
    tracker._metrics.clear()
    out = {
        "inputs": {"weight": weight, "bias": bias, "expert_bias": expert_bias},
        "micro_batches": [],
    }
    megatron_failed = None
    for mb in range(c["micro_batches"]):
        x = torch.randn(S, B, H, generator=g).to(c["dtype"]).requires_grad_(True)
        pad = (torch.rand(S, B, generator=g) < 0.25) if c["padding"] else None
        grad_probs = torch.randn(S * B, E, generator=g)
        if c["jitter_seed"] is not None:
            torch.manual_seed(c["jitter_seed"] + mb)
        try:
            probs, rmap = router(x, padding_mask=pad)
        except Exception as exc:  # Megatron bug: expert bias + padding mask
            megatron_failed = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            router._apply_expert_bias.__func__  # noqa: B018 - document which helper failed
            saved = router.enable_expert_bias
            router.enable_expert_bias = False
            probs, rmap = router(x, padding_mask=pad)
            router.enable_expert_bias = saved
            with torch.no_grad():
                router.local_tokens_per_expert += (rmap & ~pad.reshape(-1, 1)).sum(dim=0)
        if c["train"]:
            (probs * grad_probs.to(probs.dtype)).sum().backward()
        rec = {
            "hidden": x.detach().clone(),
            "padding_mask": pad,
            "grad_probs": grad_probs,
            "probs": probs.detach().clone(),
            "routing_map": rmap.clone(),
            "grad_hidden": None if x.grad is None else x.grad.clone(),
        }
        out["micro_batches"].append(rec)
    out["grad_weight"] = None if router.weight.grad is None else router.weight.grad.clone()
    out["grad_bias"] = (
        None if router.bias is None or router.bias.grad is None else router.bias.grad.clone()
    )
    out["losses"] = {
        name: tracker.metrics[key].values[0].clone()
        for name, key in LOSS_KEYS.items()
        if key in tracker.metrics
    }
    if router.expert_bias is not None:
        counts = router.local_tokens_per_expert.clone()
        out["local_tokens_per_expert"] = counts
        out["updated_expert_bias"] = moe_utils.get_updated_expert_bias(
            counts.clone(),
            router.expert_bias.clone(),
            mcfg.moe_router_bias_update_rate,
            tp_dp_cp_group=parallel_state.get_tensor_and_data_parallel_group(
                with_context_parallel=True
            ),
        )
    if router.global_tokens_per_expert is not None:
        out["global_tokens_per_expert"] = router.global_tokens_per_expert.clone()
    out["megatron_failed"] = megatron_failed
    return out


def main() -> None:
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    torch.use_deterministic_algorithms(False)
    fixtures = {"megatron_core_version": "0.19.2", "torch_version": torch.__version__, "cases": {}}
    for c in CASES:
        res = run_case(c)
        meta = {k: v for k, v in c.items() if k != "config"}
        fixtures["cases"][c["name"]] = {"config": c["config"], "meta": meta, **res}
        flag = f"  (Megatron failed: {res['megatron_failed']})" if res["megatron_failed"] else ""
        print(
            f"{c['name']:28s} losses={ {k: round(float(v), 6) for k, v in res['losses'].items()} }{flag}"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixtures, OUT)
    print(f"wrote {OUT} ({os.path.getsize(OUT) / 1e3:.1f} kB)")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
