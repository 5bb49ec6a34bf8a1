"""The conformance kit: it passes routers that route as shardwork does and names what differs.

- shardwork's own ``TopKRouter``, wrapped the way another framework would wrap its router:
  every option agrees.
- ``plain_router``: an independent router written here from the formulas in
  docs/moe-router.md in plain autograd (losses returned as tensors, not injected): every option
  agrees, so the kit does not confuse two correct implementations.
- The same router with one planted bug at a time: the kit reports exactly the option the bug
  touches as disagreeing (and which check caught it), every other option agreeing.
- ``conformance_test`` turns a candidate into a parametrized pytest test (used here on
  ``plain_router``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwork.moe_router import RouterConfig, TopKRouter
from shardwork.moe_router.conformance import (
    RouterOutput,
    conformance_test,
    generate_cases,
    run_conformance,
)


def _group_mask(select_TE, cfg, n, bug):
    """Keep the experts of each token's best ``group_top_k`` groups (score: sum of top-n)."""
    tokens, experts = select_TE.shape
    grouped = select_TE.view(tokens, cfg.num_groups, experts // cfg.num_groups)
    if bug == "group_max":
        group_score = grouped.max(dim=-1).values
    else:
        group_score = grouped.topk(n, dim=-1).values.sum(-1)
    best = group_score.topk(cfg.group_top_k, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, best, True)
    return keep.repeat_interleave(experts // cfg.num_groups, dim=1)


def _select(logits, cfg, bias, bug):
    """(weights_TK, idx_TK, normalised scores for the losses) from the definitions."""
    K = cfg.top_k
    if cfg.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
        ranked = scores if cfg.pre_softmax else logits
    else:
        raw = (
            torch.sigmoid(logits) if cfg.score_function == "sigmoid" else F.softplus(logits).sqrt()
        )
        scores = raw / raw.sum(-1, keepdim=True)
        ranked = raw
    select = ranked.detach() + (0 if bias is None else bias)
    if cfg.num_groups is not None:
        n = cfg.group_score_top_n or K // cfg.group_top_k
        select = select.masked_fill(~_group_mask(select, cfg, n, bug), float("-inf"))
    idx = select.topk(K, dim=-1).indices
    if cfg.score_function == "softmax" and not cfg.pre_softmax:
        w = torch.softmax(logits.gather(1, idx), dim=-1)
    elif cfg.score_function == "softmax":
        w = scores.gather(1, idx)
        if bug == "pre_softmax_renormalised":
            w = w / w.sum(-1, keepdim=True)
    else:
        w = ranked.gather(1, idx)
        if K > 1 and bug != "sigmoid_unnormalised":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    scale = cfg.top_k_scaling_factor or 1.0
    if bug == "scaling_1e-5_high" and cfg.top_k_scaling_factor:
        scale *= 1 + 1e-5
    return w * scale, idx, scores


def _capacity(probs, rmap, cfg, bug):
    tokens, experts = rmap.shape
    rounding = math.floor if bug == "capacity_floor" else math.ceil
    cap = rounding(tokens * cfg.top_k / experts * cfg.capacity_factor)
    if cfg.token_drop_policy == "probs":
        keep = torch.zeros_like(rmap).scatter(0, probs.detach().topk(cap, dim=0).indices, True)
        keep &= rmap
    else:
        keep = rmap & (rmap.int().cumsum(0) <= cap)
    if cfg.pad_to_capacity:
        free = cap - keep.sum(0)
        keep |= ~rmap & ((~rmap).int().cumsum(0) <= free)
    return probs * keep, keep


def _losses(logits, scores, cfg, seq_len, batch, bug):
    """Switch aux loss E/(K·T²)·Σ_i c_i·Σ_x s(x, i) (per sequence for seq-aux), z-loss."""
    E, K = cfg.num_experts, cfg.top_k
    plain = torch.zeros_like(scores, dtype=torch.bool).scatter(
        1, scores.detach().topk(K, dim=-1).indices, True
    )
    out = {}
    for name in ("aux_loss", "global_aux_loss"):
        if cfg.aux_loss_coeff_for(name):
            T = scores.shape[0]
            factor = 1.0 if bug == "aux_missing_E" else E
            out[name] = factor / (K * T * T) * (plain.sum(0) * scores.sum(0)).sum()
    if cfg.aux_loss_coeff_for("seq_aux_loss"):
        per_seq = scores.view(seq_len, batch, E).sum(0)  # [B, E]
        counts = plain.view(seq_len, batch, E).sum(0)
        losses_b = E / (K * seq_len * seq_len) * (counts * per_seq).sum(-1)
        out["seq_aux_loss"] = losses_b.sum() if bug == "seq_aux_summed" else losses_b.mean()
    if cfg.z_loss_coeff:
        lse = torch.logsumexp(logits, dim=-1)
        out["z_loss"] = (lse.abs() if bug == "z_unsquared" else lse.square()).mean()
    return {
        name: value * (cfg.z_loss_coeff if name == "z_loss" else cfg.aux_loss_coeff_for(name))
        for name, value in out.items()
    }


def plain_router(case, bug: str | None = None) -> RouterOutput:
    """The router of docs/moe-router.md in plain torch, optionally with one planted bug."""
    cfg = case.config
    seq_len, batch, _ = case.hidden.shape
    weight = case.weight.clone().requires_grad_(True)
    logits = case.hidden.reshape(seq_len * batch, -1) @ weight.t()
    w, idx, scores = _select(logits, cfg, case.expert_bias, bug)
    probs = torch.zeros_like(logits).scatter(1, idx, w)
    rmap = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    if cfg.capacity_factor is not None:
        probs, rmap = _capacity(probs, rmap, cfg, bug)
    losses = _losses(logits, scores, cfg, seq_len, batch, bug)
    return RouterOutput(probs=probs, routing_map=rmap, weight=weight, losses=losses)


def shardwork_as_a_user_wraps_it(case) -> RouterOutput:
    """shardwork's public router behind the candidate interface (losses injected in backward;
    their values from the router's tracker)."""
    from shardwork.moe_router import AuxLossScale, AuxLossTracker

    tracker = AuxLossTracker(num_layers=1, num_experts=case.config.num_experts)
    router = TopKRouter(case.config, tracker=tracker, loss_scale=AuxLossScale(1.0), layer_index=0)
    with torch.no_grad():
        router.weight.copy_(case.weight)
        if case.expert_bias is not None:
            router.expert_bias.copy_(case.expert_bias)
    probs, rmap = router(case.hidden)
    names = ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")
    values = dict(zip(names, (float(v[0]) for v in tracker.loss_values().values())))
    return RouterOutput(probs=probs, routing_map=rmap, weight=router.weight, loss_values=values)


def test_shardwork_router_agrees_on_every_option():
    report = run_conformance(shardwork_as_a_user_wraps_it)
    assert report.all_agree, report.summary()
    assert len(report.agreeing_options()) == len(generate_cases())


def test_independent_plain_router_agrees_on_every_option():
    report = run_conformance(plain_router)
    assert report.all_agree, report.summary()


PLANTED = {
    # bug: (the option that must disagree, the check that must catch it)
    "pre_softmax_renormalised": ("score_function=softmax, pre_softmax=True", "probs"),
    "sigmoid_unnormalised": ("score_function=sigmoid", "probs"),
    "group_max": ("num_groups / group_top_k", "routing_map"),
    "capacity_floor": ("capacity_factor, token_drop_policy=probs", "routing_map"),
    "aux_missing_E": ("load_balancing_type=aux_loss", "loss:aux_loss"),
    "seq_aux_summed": ("load_balancing_type=seq_aux_loss", "loss:seq_aux_loss"),
    "z_unsquared": ("z_loss_coeff", "loss:z_loss"),
    # a subtle one: 1e-5 relative is ~84 fp32 ulp, beyond the 8-ulp tolerance
    "scaling_1e-5_high": ("top_k_scaling_factor", "probs"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bug_is_caught_and_named(bug):
    option, check = PLANTED[bug]
    report = run_conformance(lambda case: plain_router(case, bug))
    disagreeing = report.disagreeing_options()
    assert option in disagreeing, report.summary()
    failed = {r.check for r in report.results if r.option == option and not r.passed}
    assert check in failed, report.summary()
    line = next(x for x in report.summary().splitlines() if option in x)
    assert "DIFFERS" in line and check in line, line
    # the bug touches its own option (and options sharing its code path), never everything
    assert "score_function=softmax, pre_softmax=False" not in disagreeing


def test_candidate_that_raises_disagrees_on_that_option_only():
    def refuses_groups(case):
        if case.config.num_groups is not None:
            raise NotImplementedError("no group-limited routing")
        return plain_router(case)

    report = run_conformance(refuses_groups)
    assert report.disagreeing_options() == ["num_groups / group_top_k", "group_score_top_n=2"]
    assert "NotImplementedError: no group-limited routing" in report.summary()


test_plain_router_conformance = conformance_test(plain_router)


def test_unknown_case_names_are_refused():
    with pytest.raises(ValueError, match="not cases"):
        generate_cases(names=("softmax_post_top2", "topk_3"))
    (case,) = generate_cases(names=("z_loss",))
    assert isinstance(case.config, RouterConfig) and not case.grad_probs.any()


def test_readme_conformance_example_runs():
    """The README's conformance example, as written, reports every option agreeing."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Conformance kit", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    report = scope["report"]
    assert report.all_agree and len(report.agreeing_options()) == len(generate_cases())
    # the example reports no loss values: those checks are marked, not counted as agreeing
    assert {r.check for r in report.results if r.skipped} == {
        "loss:aux_loss",
        "loss:seq_aux_loss",
        "loss:global_aux_loss",
        "loss:z_loss",
    }
    assert "not reported, not compared: loss:z_loss" in report.summary()
