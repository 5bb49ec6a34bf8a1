"""Aux losses and the tracker across ranks: sequence-parallel token shards and a pipeline
stage without MoE layers.

World 4 = TP 2 × PP 2. Stage 0 holds one MoE layer whose tokens are split over its TP pair
(sequence parallelism); stage 1 holds none. Every rank calls ``tracker.reduce`` (a stage
without MoE layers must join, or the others hang). Expected: the reduced loss values, token
counts and the TP-summed router/input gradients equal a single-process router over the full
sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwork.moe_router import (
    AuxLossScale,
    AuxLossTracker,
    RouterConfig,
    TopKRouter,
    update_expert_bias,
)

ps = pytest.importorskip("shardwork.parallel_state")
testing = pytest.importorskip("shardwork.parallel_state.testing")

E, H, S, B = 8, 6, 8, 3
SCALE = 0.5


def _config():
    return RouterConfig(
        num_experts=E,
        hidden_size=H,
        top_k=2,
        load_balancing_type=("aux_loss", "seq_aux_loss", "global_aux_loss"),
        aux_loss_coeff=(0.1, 0.2, 0.3),
        z_loss_coeff=0.05,
    )


def _data():
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(E, H, generator=g, dtype=torch.float64),
        torch.randn(S, B, H, generator=g, dtype=torch.float64),
        torch.randn(S, B, E, generator=g, dtype=torch.float64),
    )


def _rank_router(config, pg, tracker, weight):
    """Layer 0's fp64 router on this rank: token counts reduced over ``pg``'s tp_cp (sequence
    shards) and tp_dp_cp (global aux loss) groups, gate weight ``weight``."""
    router = TopKRouter(
        config,
        tp_cp_group=pg.tp_cp,
        tp_dp_cp_group=pg.tp_dp_cp,
        tracker=tracker,
        loss_scale=AuxLossScale(SCALE),
        layer_index=0,
    ).double()
    router.weight.data.copy_(weight)
    return router


def _run(tracker_kwargs):
    pg = ps.init_process_groups(ps.ParallelConfig(tp=2, pp=2))
    tracker = AuxLossTracker(num_layers=2, num_experts=E)
    weight, x, g = _data()
    result = {"stage": pg.rank("pp")}
    if pg.rank("pp") == 0:
        router = _rank_router(_config(), pg, tracker, weight)
        r, half = pg.rank("tp"), S // 2
        x_local = x[r * half : (r + 1) * half].clone().requires_grad_(True)
        probs, _ = router(x_local)
        (probs * g[r * half : (r + 1) * half].reshape(-1, E)).sum().backward()
        grad_w = router.weight.grad.clone()
        dist.all_reduce(grad_w, group=pg.tp)
        result |= {"grad_w": grad_w, "grad_x": x_local.grad, "tp_rank": r}
    tracker.reduce(pp_group=pg.pp, tp_cp_group=pg.tp_cp, dp_group=pg.dp)
    result["losses"] = tracker.loss_values()
    result["tokens"] = tracker.tokens_per_expert.clone()
    return result


@pytest.mark.multirank
def test_sequence_parallel_losses_and_pipeline_stage_without_moe():
    results = testing.run_on_ranks(_run, 4, args=({},))
    weight, x, g = _data()
    tracker = AuxLossTracker(num_layers=2, num_experts=E)
    router = TopKRouter(
        _config(), tracker=tracker, loss_scale=AuxLossScale(SCALE), layer_index=0
    ).double()
    router.weight.data.copy_(weight)
    x_ref = x.clone().requires_grad_(True)
    probs, _ = router(x_ref)
    (probs * g.reshape(-1, E)).sum().backward()
    ref_losses = tracker.loss_values()
    tol = {"rtol": 1e-10, "atol": 1e-13}
    for res in results:  # every rank of both stages holds the reduced values
        for name, values in ref_losses.items():
            torch.testing.assert_close(res["losses"][name], values, **tol, msg=name)
        torch.testing.assert_close(res["tokens"], tracker.tokens_per_expert, **tol)
        if res["stage"] == 0:
            torch.testing.assert_close(res["grad_w"], router.weight.grad, **tol)
            half = S // 2
            rows = slice(res["tp_rank"] * half, (res["tp_rank"] + 1) * half)
            torch.testing.assert_close(res["grad_x"], x_ref.grad[rows], **tol)


def _bias_update():
    rank = dist.get_rank()
    cfg = RouterConfig(
        num_experts=E,
        hidden_size=H,
        score_function="sigmoid",
        enable_expert_bias=True,
        expert_bias_update_rate=0.01,
        load_balancing_type="none",
    )
    routers = [TopKRouter(cfg), TopKRouter(cfg)]
    g = torch.Generator().manual_seed(100 + rank)
    for r in routers:
        r(torch.randn(5, 2, H, generator=g))
    counts = [r.local_tokens_per_expert.clone() for r in routers]
    update_expert_bias(routers, group=dist.group.WORLD)
    return (
        counts,
        [r.expert_bias.clone() for r in routers],
        [r.local_tokens_per_expert.clone() for r in routers],
    )


@pytest.mark.multirank
def test_expert_bias_update_reduces_counts_over_group():
    results = testing.run_on_ranks(_bias_update, 2)
    for layer in range(2):
        total = results[0][0][layer] + results[1][0][layer]
        expected = 0.01 * torch.sign(total.mean() - total)
        for _, biases, left in results:
            torch.testing.assert_close(biases[layer], expected)
            assert left[layer].sum() == 0


# Data parallelism: the global aux loss counts tokens over every DP rank and accumulates them
# over the micro-batches of a step; the tracker averages per-rank losses over DP (aux) or sums
# them (global). World 2 = DP 2, two micro-batches per rank.
DP, MICRO, K_DP = 2, 2, 2
COEFF_AUX, COEFF_GLOBAL = 0.1, 0.3


def _dp_config():
    return RouterConfig(
        num_experts=E,
        hidden_size=H,
        top_k=K_DP,
        load_balancing_type=("aux_loss", "global_aux_loss"),
        aux_loss_coeff=(COEFF_AUX, COEFF_GLOBAL),
    )


def _dp_data():
    """weight [E, H]; per rank and micro-batch: x [S, B, H] and the output gradient [S·B, E]."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(E, H, generator=g, dtype=torch.float64)
    x = torch.randn(DP, MICRO, S, B, H, generator=g, dtype=torch.float64)
    grad_out = torch.randn(DP, MICRO, S * B, E, generator=g, dtype=torch.float64)
    return weight, x, grad_out


def _run_dp():
    pg = ps.init_process_groups(ps.ParallelConfig())
    r = pg.rank("dp")
    tracker = AuxLossTracker(num_layers=1, num_experts=E)
    weight, x, grad_out = _dp_data()
    router = _rank_router(_dp_config(), pg, tracker, weight)
    grads_x = []
    for m in range(MICRO):
        x_m = x[r, m].clone().requires_grad_(True)
        probs, _ = router(x_m)
        (probs * grad_out[r, m]).sum().backward()
        grads_x.append(x_m.grad)
    grad_w = router.weight.grad.clone()
    dist.all_reduce(grad_w, group=pg.dp)
    tracker.reduce(pp_group=pg.pp, tp_cp_group=pg.tp_cp, dp_group=pg.dp)
    return {
        "rank": r,
        "grad_w": grad_w,
        "grads_x": grads_x,
        "losses": tracker.loss_values(),
        "tokens": tracker.tokens_per_expert.clone(),
    }


def _plain_switch(scores_TE, tokens_E, num_tokens, coeff):
    """Switch/GShard balance loss written out: E·coeff/(K·N²) · Σ_i (Σ_t p_ti)·f_i."""
    return E * coeff / (K_DP * num_tokens**2) * (scores_TE.sum(0) * tokens_E).sum()


def _dp_reference():
    """One process, plain autograd, every (rank, micro-batch) token group in turn."""
    weight, x, grad_out = _dp_data()
    T = S * B
    w = weight.clone().requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    logits, counts = {}, torch.zeros(MICRO, DP, E, dtype=torch.float64)
    for m in range(MICRO):
        for r in range(DP):
            logits[r, m] = xs[r, m].reshape(T, H) @ w.t()
            top = torch.topk(logits[r, m].detach(), K_DP, dim=-1).indices
            counts[m, r] = torch.bincount(top.reshape(-1), minlength=E).double()
    running_mean = counts.sum(1).cumsum(0) / torch.arange(1, MICRO + 1).double().unsqueeze(1)
    total, aux_values, global_values = 0.0, [], []
    for m in range(MICRO):
        for r in range(DP):
            lg = logits[r, m]
            top_vals, top_idx = torch.topk(lg, K_DP, dim=-1)
            probs = torch.zeros_like(lg).scatter(1, top_idx, torch.softmax(top_vals, dim=-1))
            scores = torch.softmax(lg, dim=-1)
            aux = _plain_switch(scores, counts[m, r], T, COEFF_AUX)
            glob = _plain_switch(scores, running_mean[m], T * DP, COEFF_GLOBAL)
            total = total + (probs * grad_out[r, m]).sum() + SCALE * (aux + glob)
            aux_values.append(aux.detach() / COEFF_AUX)
            global_values.append(glob.detach() / COEFF_GLOBAL)
    total.backward()
    losses = {
        "load_balancing_loss": torch.stack(aux_values).sum() / DP,  # summed over micro, DP mean
        "global_load_balancing_loss": torch.stack(global_values).sum(),  # summed over both
    }
    return w.grad, xs.grad, losses, counts.sum((0, 1))


@pytest.mark.multirank
def test_global_aux_loss_and_tracker_over_data_parallel_ranks():
    results = testing.run_on_ranks(_run_dp, DP)
    grad_w, grad_x, losses, tokens = _dp_reference()
    tol = {"rtol": 1e-10, "atol": 1e-13}
    for res in results:
        torch.testing.assert_close(res["grad_w"], grad_w, **tol)
        for m in range(MICRO):
            expected = grad_x[res["rank"], m]
            torch.testing.assert_close(res["grads_x"][m], expected, **tol, msg=f"micro {m}")
        for name, value in losses.items():
            torch.testing.assert_close(res["losses"][name][0], value, **tol, msg=name)
        torch.testing.assert_close(res["tokens"][0], tokens, **tol)
