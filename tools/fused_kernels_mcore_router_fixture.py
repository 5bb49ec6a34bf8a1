"""Write the Megatron-Core router fixture used by packages/fused-kernels/tests/test_router.py.

Not a dependency, not run by CI. Run it with any interpreter: it re-executes itself in the
scratch Megatron-Core environment ``tools/megatron_env.py`` builds::

    uv run python tools/fused_kernels_mcore_router_fixture.py

For each routing configuration it stores the logits (and expert bias), Megatron-Core
0.19's ``topk_routing_with_score_function`` outputs (probs, routing map),
``compute_routing_scores_for_aux_loss`` outputs (aux routing map, scores) and the
gradient of ``Σ probs·G + Σ scores·GA`` w.r.t. the logits for fixed random G, GA.
"""

from __future__ import annotations

import pathlib

import megatron_env

megatron_env.reexec_under_megatron()  # nothing when megatron.core is importable here

import megatron.core  # noqa: E402
import torch  # noqa: E402
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    compute_routing_scores_for_aux_loss,
    topk_routing_with_score_function,
)

OUT = (
    pathlib.Path(__file__).resolve().parents[1]
    / "packages/fused-kernels/tests/data/mcore_router.pt"
)

CONFIGS = [
    {"topk": 2, "score_function": "softmax"},
    {"topk": 3, "score_function": "softmax", "pre_softmax": True, "scaling_factor": 1.5},
    {"topk": 4, "score_function": "softmax", "num_groups": 4, "group_topk": 2},
    {"topk": 1, "score_function": "sigmoid"},
    {"topk": 4, "score_function": "sigmoid", "expert_bias": True},
    {
        "topk": 6,
        "score_function": "sigmoid",
        "expert_bias": True,
        "num_groups": 8,
        "group_topk": 3,
        "scaling_factor": 2.5,
    },  # fmt: skip  (DeepSeek-V3 style)
    {
        "topk": 4,
        "score_function": "sqrtsoftplus",
        "expert_bias": True,
        "num_groups": 4,
        "group_topk": 2,
    },
    {"topk": 1, "score_function": "sqrtsoftplus"},
]


def main() -> None:
    torch.manual_seed(1234)
    n, e = 37, 16
    cases = []
    for cfg in CONFIGS:
        logits = torch.randn(n, e, dtype=torch.float32) * 2
        bias = torch.randn(e) * 0.3 if cfg.get("expert_bias") else None
        kwargs = {k: v for k, v in cfg.items() if k != "expert_bias"}
        x = logits.clone().requires_grad_(True)
        probs, routing_map = topk_routing_with_score_function(
            x,
            kwargs["topk"],
            use_pre_softmax=kwargs.get("pre_softmax", False),
            num_groups=kwargs.get("num_groups"),
            group_topk=kwargs.get("group_topk"),
            scaling_factor=kwargs.get("scaling_factor"),
            score_function=kwargs["score_function"],
            expert_bias=bias,
        )
        aux_map, aux_scores = compute_routing_scores_for_aux_loss(
            x, kwargs["topk"], kwargs["score_function"]
        )
        g = torch.randn(n, e)
        ga = torch.randn(n, e)
        (grad,) = torch.autograd.grad((probs * g).sum() + (aux_scores * ga).sum(), [x])
        cases.append(
            {
                "config": kwargs,
                "logits": logits,
                "expert_bias": bias,
                "probs": probs.detach(),
                "routing_map": routing_map,
                "aux_scores": aux_scores.detach(),
                "tokens_per_expert": aux_map.sum(0),
                "grad_probs": g,
                "grad_aux": ga,
                "grad_logits": grad,
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"megatron_core_version": megatron.core.__version__, "cases": cases}, OUT)
    print(f"wrote {len(cases)} cases to {OUT} (megatron-core {megatron.core.__version__})")


if __name__ == "__main__":
    main()
