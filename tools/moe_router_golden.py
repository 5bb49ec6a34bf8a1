"""Produce golden fixtures for shardwork-moe-router from Megatron-Core 0.19.2's TopKRouter.

A development aid, never run by CI. Run it with any interpreter; it re-executes itself in the
scratch Megatron-Core environment that ``tools/megatron_env.py`` builds (first run: ~1 min)::

    uv run python tools/moe_router_golden.py [router] [quantile] [replay]

(no argument: all three). The Megatron-side code of each fixture:

- ``router`` (``megatron_router_golden.pt``, below);
- ``quantile`` (``megatron_quantile_balancing.pt``): quantile balancing, see ``QB_CASES``;
- ``replay`` (``megatron_router_replay.pt``): router replay, see ``REPLAY_CASES``.

Multi-rank cases run on gloo ranks spawned here, each with Megatron's own parallel state.

``router`` writes packages/moe-router/tests/fixtures/megatron_router_golden.pt: one entry per case
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

import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

import megatron_env

megatron_env.reexec_under_megatron()  # nothing when megatron.core is importable here

import torch  # noqa: E402

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
    "quantile_balancing_ema": "moe_router_quantile_balancing_ema",
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


# --------------------------------------------------------------------------- multi-rank cases
FIXTURE_DIR = OUT.parent
QB_OUT = FIXTURE_DIR / "megatron_quantile_balancing.pt"
REPLAY_OUT = FIXTURE_DIR / "megatron_router_replay.pt"


def qb(**kw):
    return base(load_balancing_type="quantile_balancing", **kw)


# Quantile balancing: ``steps`` optimizer steps of ``micro_batches`` forward/backward passes,
# then Megatron's own per-step update (finalize_model_grads._update_router_qb_beta) and reset.
# ``tp`` > 1: the micro-batch's sequence is split over the TP ranks (sequence parallelism, the
# logits are gathered over tp×cp); the other ranks are data parallel (quantiles averaged).
QB_CASES = {
    "qb_softmax_ema0": dict(config=qb(), steps=2, micro_batches=3),
    "qb_sigmoid_scaled_ema": dict(
        config=qb(
            num_experts=16,
            top_k=4,
            score_function="sigmoid",
            top_k_scaling_factor=2.5,
            quantile_balancing_ema=0.9,
        ),
        steps=3,
        micro_batches=2,
    ),
    "qb_presoftmax_z": dict(
        config=qb(pre_softmax=True, z_loss_coeff=1e-3, quantile_balancing_ema=0.5),
        steps=2,
        micro_batches=2,
    ),
    "qb_sqrtsoftplus_eval": dict(
        config=qb(top_k=3, score_function="sqrtsoftplus", quantile_balancing_ema=0.25),
        steps=2,
        micro_batches=2,
        eval_after=True,
    ),
    "qb_tp2_dp2": dict(
        config=qb(quantile_balancing_ema=0.5), steps=2, micro_batches=2, world=4, tp=2, B=2
    ),
}

# Router replay: ``layers`` routers record ``micro_batches`` forwards, their weights are
# perturbed, and each micro-batch's records are replayed (set_replay_data before it).
REPLAY_CASES = {
    "replay_sigmoid_groups_bias": dict(
        config=base(
            num_experts=16,
            top_k=4,
            score_function="sigmoid",
            num_groups=4,
            group_top_k=2,
            top_k_scaling_factor=2.5,
            enable_expert_bias=True,
            load_balancing_type="seq_aux_loss",
            aux_loss_coeff=1e-2,
        )
    ),
    "replay_presoftmax_aux": dict(
        config=base(pre_softmax=True, load_balancing_type="aux_loss", aux_loss_coeff=1e-2)
    ),
    "replay_postsoftmax_sp2": dict(
        config=base(load_balancing_type="aux_loss", aux_loss_coeff=1e-2), world=2, tp=2
    ),
}


def _rank_setup(rank: int, world: int, tp: int, store_dir: str) -> dict:
    """Megatron's parallel state on this gloo rank; its tp and dp coordinates."""
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.use_deterministic_algorithms(False)
    return {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "dp_size": parallel_state.get_data_parallel_world_size(),
    }


def _megatron_router(cfg: dict, tp: int, **extra) -> MTopKRouter:
    mcfg = megatron_config(cfg)
    mcfg.tensor_model_parallel_size = tp
    mcfg.sequence_parallel = tp > 1
    for name, value in extra.items():
        setattr(mcfg, name, value)
    router = MTopKRouter(mcfg, pg_collection=moe_utils.get_default_pg_collection())
    router.set_layer_number(1)
    return router


def _shard(x: torch.Tensor, coords: dict, tp: int) -> torch.Tensor:
    """This TP rank's contiguous share of the sequence dim (sequence parallelism)."""
    rows = x.shape[0] // tp
    return x[coords["tp_rank"] * rows : (coords["tp_rank"] + 1) * rows]


def _micro_batch(g, S, B, E, H, dp_size, coords, tp):
    """Draw every DP rank's full micro-batch (same stream on all ranks), keep this rank's."""
    drawn = [
        (torch.randn(S, B, H, generator=g), torch.randn(S, B, E, generator=g))
        for _ in range(dp_size)
    ]
    x, grad = drawn[coords["dp_rank"]]
    x, grad = _shard(x, coords, tp), _shard(grad, coords, tp)
    return x.clone().requires_grad_(True), grad.reshape(-1, E)


def _qb_forward_backward(router, x, grad_probs, train: bool) -> dict:
    probs, rmap = router(x)
    if train:
        (probs * grad_probs).sum().backward()
    return {
        "hidden": x.detach().clone(),
        "grad_probs": grad_probs,
        "probs": probs.detach().clone(),
        "routing_map": rmap.clone(),
        "grad_hidden": None if x.grad is None else x.grad.clone(),
    }


def run_qb_rank(rank: int, case: dict, store_dir: str) -> dict:
    """One rank of a quantile-balancing case: its inputs and Megatron's outputs per step."""
    # the package re-exports a function of the module's name: import the module itself
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    world, tp = case.get("world", 1), case.get("tp", 1)
    coords = _rank_setup(rank, world, tp, store_dir)
    cfg = case["config"]
    E, H, S, B = cfg["num_experts"], cfg["hidden_size"], case.get("S", 8), case.get("B", 4)
    g = torch.Generator().manual_seed(case.get("seed", 3))
    weight = torch.randn(E, H, generator=g) / H**0.5
    qb_beta = torch.randn(E, generator=g) * 0.1  # a non-zero start exercises the offset at once
    router = _megatron_router(cfg, tp)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.qb_beta.copy_(qb_beta)
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.5))
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    out = {**coords, "weight": weight, "qb_beta": qb_beta, "steps": []}
    for _ in range(case["steps"]):
        router.train()
        router.weight.grad = None
        mbs = [
            _qb_forward_backward(
                router, *_micro_batch(g, S, B, E, H, coords["dp_size"], coords, tp), True
            )
            for _ in range(case["micro_batches"])
        ]
        step = {
            "micro_batches": mbs,
            "grad_weight": router.weight.grad.clone(),
            "qb_beta_accum": router.qb_beta_accum.clone(),
            "qb_beta_count": router.qb_beta_count.clone(),
        }
        fmg._update_router_qb_beta([router], router.config, dp_cp_group=dp_cp)
        fmg.reset_model_temporary_tensors(router.config, [router])
        step["qb_beta_after"] = router.qb_beta.clone()
        out["steps"].append(step)
    if case.get("eval_after"):
        router.eval()
        x, grad = _micro_batch(g, S, B, E, H, coords["dp_size"], coords, tp)
        with torch.no_grad():
            out["eval"] = _qb_forward_backward(router, x, grad, False)
        out["eval"]["qb_beta_count"] = router.qb_beta_count.clone()
    dist.destroy_process_group()
    return out


def _replay_layers(cfg: dict, tp: int, num_layers: int, g) -> tuple[list, list]:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()  # Megatron keeps them in a class list
    routers, inputs = [], []
    for _ in range(num_layers):
        router = _megatron_router(cfg, tp, moe_enable_routing_replay=True)
        weight = torch.randn(cfg["num_experts"], cfg["hidden_size"], generator=g)
        bias = torch.randn(cfg["num_experts"], generator=g) * 0.1
        with torch.no_grad():
            router.weight.copy_(weight)
            if router.expert_bias is not None:
                router.expert_bias.copy_(bias)
        routers.append(router.train())
        inputs.append(
            {"weight": weight, "expert_bias": bias if router.expert_bias is not None else None}
        )
    return routers, inputs


def run_replay_rank(rank: int, case: dict, store_dir: str) -> dict:
    """One rank of a replay case: record, perturb the weights, replay micro-batch by micro-batch."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    world, tp = case.get("world", 1), case.get("tp", 1)
    coords = _rank_setup(rank, world, tp, store_dir)
    cfg, num_layers, num_mb = case["config"], case.get("layers", 2), case.get("micro_batches", 2)
    E, H, S, B = cfg["num_experts"], cfg["hidden_size"], case.get("S", 8), case.get("B", 4)
    g = torch.Generator().manual_seed(case.get("seed", 5))
    routers, layer_inputs = _replay_layers(cfg, tp, num_layers, g)
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.5))
    data = [
        [_micro_batch(g, S, B, E, H, coords["dp_size"], coords, tp) for _ in routers]
        for _ in range(num_mb)
    ]
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    records, recorded_maps = [], []
    for mb in range(num_mb):
        recorded_maps.append([r(data[mb][i][0].detach())[1].clone() for i, r in enumerate(routers)])
        records.append([t.clone() for t in RouterReplay.get_recorded_data()])
    RouterReplay.clear_global_router_replay_action()
    deltas = [torch.randn(E, H, generator=g) for _ in routers]
    with torch.no_grad():
        for r, d in zip(routers, deltas):
            r.weight.add_(d)
    natural = [
        [r(data[mb][i][0].detach())[1].clone() for i, r in enumerate(routers)]
        for mb in range(num_mb)
    ]
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replayed = []
    for mb in range(num_mb):
        RouterReplay.set_replay_data(records[mb])
        replayed.append(
            [_qb_forward_backward(r, *data[mb][i], True) for i, r in enumerate(routers)]
        )
    RouterReplay.clear_global_router_replay_action()
    out = {
        **coords,
        "layers": layer_inputs,
        "weight_delta": deltas,
        "records": records,
        "recorded_maps": recorded_maps,
        "natural_maps": natural,
        "replayed": replayed,
        "grad_weight": [r.weight.grad.clone() for r in routers],
    }
    dist.destroy_process_group()
    return out


def _rank_entry(rank, fn, case, store_dir):
    # through a file: tensors sent over a multiprocessing queue die with the sending process
    torch.save(fn(rank, case, store_dir), os.path.join(store_dir, f"rank{rank}.pt"))


def run_spawned(fn, case: dict) -> list[dict]:
    """``fn(rank, case, store_dir)`` on ``case['world']`` gloo ranks; results by rank."""
    import torch.multiprocessing as mp

    world = case.get("world", 1)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [
            ctx.Process(target=_rank_entry, args=(r, fn, case, store_dir)) for r in range(world)
        ]
        for proc in procs:
            proc.start()
        while any(proc.exitcode is None for proc in procs):
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:  # a failed rank leaves the others waiting in a collective
                    proc.kill()
            time.sleep(0.5)
        codes = [proc.exitcode for proc in procs]
        if any(codes):
            raise SystemExit(f"a rank failed (exit codes {codes}); see its traceback above")
        return [torch.load(os.path.join(store_dir, f"rank{r}.pt")) for r in range(world)]


def write_spawned(fn, cases: dict, out: Path) -> None:
    fixtures = {"megatron_core_version": "0.19.2", "torch_version": torch.__version__, "cases": {}}
    for name, case in cases.items():
        fixtures["cases"][name] = {**case, "ranks": run_spawned(fn, case)}
        print(f"{name:28s} world={case.get('world', 1)}")
    torch.save(fixtures, out)
    print(f"wrote {out} ({os.path.getsize(out) / 1e3:.1f} kB)")


def write_router_fixtures() -> None:
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
    parallel_state.destroy_model_parallel()


def main() -> None:
    chosen = sys.argv[1:] or ["router", "quantile", "replay"]
    unknown = set(chosen) - {"router", "quantile", "replay"}
    if unknown:
        raise SystemExit(f"unknown fixture(s) {sorted(unknown)}: choose router, quantile, replay")
    if "router" in chosen:
        write_router_fixtures()
    if "quantile" in chosen:
        write_spawned(run_qb_rank, QB_CASES, QB_OUT)
    if "replay" in chosen:
        write_spawned(run_replay_rank, REPLAY_CASES, REPLAY_OUT)


if __name__ == "__main__":
    sys.exit(main())
