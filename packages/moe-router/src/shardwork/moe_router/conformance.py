"""Router conformance kit: does another framework's MoE router route as shardwork's does?

Another framework wraps its router in a *candidate*, a function from a
:class:`ConformanceCase` (options + random inputs, :mod:`.conformance_cases`) to a
:class:`RouterOutput`; :func:`run_conformance` runs every case through the candidate and
through shardwork's :class:`TopKRouter` (the reference, :func:`shardwork_candidate`) and
reports, option by option, whether they agree::

    from shardwork.moe_router.conformance import RouterOutput, run_conformance

    def my_router(case):
        router = MyRouter(**translate(case.config))        # the framework's own router
        router.weight.data.copy_(case.weight)
        probs, routing_map = router(case.hidden)
        return RouterOutput(probs=probs, routing_map=routing_map, weight=router.weight)

    report = run_conformance(my_router)
    print(report.summary())          # one line per option: agrees, or what differs and by how much
    assert report.all_agree, report.summary()

In a pytest suite, ``test_router = conformance_test(my_router)`` makes one test per case.

What is compared, per case: the routing map exactly (a different expert is a different
routing, not a rounding error); the probs, the gradients of the input and of the gating weight
of ``Σ probs·grad_probs`` plus the case's loss, and each loss value, at fp32 rounding of the
tensor's own scale (``|a − e| ≤ ulps·2⁻²³·max|e| + rtol·|e|``, defaults 8 and 1e-6: two
correct fp32 implementations measured ≤ 2.8 ulp each from the exact result, docs/moe-router.md).

Losses: a candidate either returns them as differentiable tensors in ``RouterOutput.losses``
(coefficient included; the kit adds them to the objective) or, like shardwork and Megatron-Core,
injects their gradient in backward and reports values only in ``loss_values`` (a value it does
not report is marked "not reported, not compared"; its gradient is still checked). Loss cases use
coefficient 1, aux-loss scale 1 and a zero upstream gradient, so their gradients are the loss's.
Names: ``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``, ``z_loss``.

Not covered (stateful across steps or layouts, checked by the golden tests against Megatron
instead): the expert-bias and quantile-balancing updates, sinkhorn, padding masks, parallel
reductions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardwork.moe_router.aux_loss import AuxLossScale
from shardwork.moe_router.conformance_cases import ConformanceCase, generate_cases
from shardwork.moe_router.router import TopKRouter
from shardwork.moe_router.tracker import LOSS_NAMES, AuxLossTracker

# the tracker's row names -> the kit's loss names (RouterConfig's option names)
_TRACKER_LOSSES = dict(zip(LOSS_NAMES, ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")))
FP32_EPS = torch.finfo(torch.float32).eps


@dataclass
class RouterOutput:
    """What a candidate returns for one case."""

    probs: torch.Tensor
    """[T, E] combine weights, zero off the routing map, differentiable."""
    routing_map: torch.Tensor
    """[T, E] bool: token t is routed to expert e."""
    weight: torch.Tensor
    """The gating weight the candidate routed with (a leaf: its ``.grad`` is compared)."""
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Differentiable loss values (coefficient included), added to the objective."""
    loss_values: dict[str, float] = field(default_factory=dict)
    """Loss values whose gradients the candidate injects in backward itself."""


@dataclass(frozen=True)
class CheckResult:
    """One comparison of one case."""

    case: str
    option: str
    check: str
    """``routing_map``, ``probs``, ``grad_hidden``, ``grad_weight``, ``loss:<name>``, or
    ``candidate`` when the candidate raised."""
    passed: bool
    detail: str
    skipped: bool = False
    """The candidate did not report this value (a loss it only injects in backward without
    logging it): nothing was compared; its gradient is still checked."""


@dataclass
class ConformanceReport:
    """Every check of a run; options agree when all their checks passed."""

    results: list[CheckResult]

    @property
    def all_agree(self) -> bool:
        return all(r.passed for r in self.results)

    def disagreeing_options(self) -> list[str]:
        """Options with at least one failed check, in case order."""
        return list(dict.fromkeys(r.option for r in self.results if not r.passed))

    def agreeing_options(self) -> list[str]:
        bad = set(self.disagreeing_options())
        return list(dict.fromkeys(r.option for r in self.results if r.option not in bad))

    def summary(self) -> str:
        """One line per case: the option, then ``agrees`` or each failed check's detail."""
        lines = []
        for case in dict.fromkeys(r.case for r in self.results):
            mine = [r for r in self.results if r.case == case]
            failed = [f"{r.check}: {r.detail}" for r in mine if not r.passed]
            verdict = "agrees" if not failed else "DIFFERS — " + "; ".join(failed)
            unreported = [r.check for r in mine if r.skipped]
            if unreported:
                verdict += f" (not reported, not compared: {', '.join(unreported)})"
            lines.append(f"{case:20s} {mine[0].option:45s} {verdict}")
        return "\n".join(lines)


def _max_ulps(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> float:
    """Largest |a − e| − rtol·|e| in fp32 ulps of max|e| (≤ the tolerance means close)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-30) * FP32_EPS
    excess = (actual - expected).abs() - rtol * expected.abs()
    return float(excess.max()) / scale if excess.numel() else 0.0


def _compare(case, check, actual, expected, *, rtol: float, ulps: float) -> CheckResult:
    if actual is None or expected is None or actual.shape != expected.shape:
        got = None if actual is None else tuple(actual.shape)
        want = None if expected is None else tuple(expected.shape)
        return CheckResult(case.name, case.option, check, False, f"shape {got}, expected {want}")
    if check == "routing_map":
        wrong = int((actual.bool() != expected.bool()).any(dim=-1).sum())
        return CheckResult(
            case.name, case.option, check, wrong == 0, f"{wrong} token(s) routed differently"
        )
    err = max(_max_ulps(actual, expected, rtol), 0.0)
    if not torch.isfinite(actual.detach()).all():
        err = float("inf")
    detail = f"max error {err:.3g} ulp of max|ref| (tolerance {ulps})"
    return CheckResult(case.name, case.option, check, err <= ulps, detail)


def shardwork_candidate(case: ConformanceCase) -> RouterOutput:
    """The reference: shardwork's :class:`TopKRouter` (aux-loss scale 1, losses injected in
    backward, values from its tracker)."""
    tracker = AuxLossTracker(num_layers=1, num_experts=case.config.num_experts)
    router = TopKRouter(case.config, tracker=tracker, loss_scale=AuxLossScale(1.0), layer_index=0)
    with torch.no_grad():
        router.weight.copy_(case.weight)
        if case.expert_bias is not None:
            router.expert_bias.copy_(case.expert_bias)
    probs, routing_map = router(case.hidden)
    logged = {_TRACKER_LOSSES[name]: value for name, value in tracker.loss_values().items()}
    values = {name: float(logged[name][0]) for name in _loss_names(case)}
    return RouterOutput(
        probs=probs, routing_map=routing_map, weight=router.weight, loss_values=values
    )


def _run_one(candidate, case: ConformanceCase) -> dict:
    """Outputs and gradients of ``candidate`` on a fresh copy of the case's inputs."""
    hidden = case.hidden.clone().requires_grad_(True)
    bias = None if case.expert_bias is None else case.expert_bias.clone()
    run_case = ConformanceCase(
        name=case.name,
        option=case.option,
        config=case.config,
        hidden=hidden,
        weight=case.weight.clone(),
        expert_bias=bias,
        grad_probs=case.grad_probs,
    )
    out = candidate(run_case)
    objective = (out.probs.float() * case.grad_probs).sum()
    for loss in out.losses.values():
        objective = objective + loss.float().sum()
    objective.backward()
    values = {name: float(v) for name, v in out.loss_values.items()}
    values |= {name: float(v.detach().sum()) for name, v in out.losses.items()}
    return {
        "routing_map": out.routing_map.detach(),
        "probs": out.probs.detach().float(),
        "grad_hidden": hidden.grad,
        "grad_weight": out.weight.grad,
        "losses": values,
    }


def _loss_names(case: ConformanceCase) -> list[str]:
    config = case.config
    names = [
        n
        for n in ("aux_loss", "seq_aux_loss", "global_aux_loss")
        if config.aux_loss_coeff_for(n) > 0
    ]
    return names + (["z_loss"] if config.z_loss_coeff else [])


def check_case(
    candidate, case: ConformanceCase, *, rtol: float = 1e-6, ulps: float = 8
) -> list[CheckResult]:
    """Every check of one case (see module docstring)."""
    expected = _run_one(shardwork_candidate, case)
    try:
        actual = _run_one(candidate, case)
    except Exception as exc:  # a candidate that cannot run an option disagrees on it
        return [
            CheckResult(case.name, case.option, "candidate", False, f"{type(exc).__name__}: {exc}")
        ]
    results = [
        _compare(case, check, actual[check], expected[check], rtol=rtol, ulps=ulps)
        for check in ("routing_map", "probs", "grad_hidden", "grad_weight")
    ]
    for name in _loss_names(case):
        got, want = actual["losses"].get(name), expected["losses"][name]
        if got is None:
            results.append(
                CheckResult(case.name, case.option, f"loss:{name}", True, "not reported", True)
            )
            continue
        results.append(
            _compare(
                case,
                f"loss:{name}",
                torch.tensor([got]),
                torch.tensor([want]),
                rtol=rtol,
                ulps=ulps,
            )
        )
    return results


def run_conformance(
    candidate: Callable[[ConformanceCase], RouterOutput],
    *,
    cases: list[ConformanceCase] | None = None,
    rtol: float = 1e-6,
    ulps: float = 8,
) -> ConformanceReport:
    """Run ``candidate`` on ``cases`` (default :func:`generate_cases`) and report per option."""
    cases = generate_cases() if cases is None else cases
    return ConformanceReport(
        [r for case in cases for r in check_case(candidate, case, rtol=rtol, ulps=ulps)]
    )


def conformance_test(candidate: Callable[[ConformanceCase], RouterOutput], **kwargs):
    """A pytest test function, one parametrized test per case, failing with the case's report
    line; assign it in a test module: ``test_router = conformance_test(my_router)``."""
    import pytest  # optional: only a pytest suite calls this

    cases = generate_cases()

    @pytest.mark.parametrize("case", cases, ids=[c.name for c in cases])
    def test_router_conformance(case):
        report = ConformanceReport(check_case(candidate, case, **kwargs))
        assert report.all_agree, report.summary()

    return test_router_conformance
