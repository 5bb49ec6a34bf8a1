"""Write the RankLayout fixture from Megatron-Core's RankGenerator (development aid, not CI).

Run it with any interpreter: it re-executes itself in the scratch Megatron-Core 0.19.2
environment ``tools/megatron_env.py`` builds:

    uv run python tools/parallel_state_rank_fixture.py \
        packages/parallel-state/tests/fixtures/megatron_rank_groups.json

For each configuration it records the member ranks of every group, produced
by Megatron-Core's two generators exactly as its ``initialize_model_parallel``
builds them (dense: tp, ep=1, dp, pp, cp; expert: etp, ep, edp, pp, cp=1).
"""

import json
import sys

import megatron_env

megatron_env.reexec_under_megatron()  # nothing when megatron.core is importable here

from megatron.core.parallel_state import RankGenerator  # noqa: E402

CONFIGS = [
    # world, tp, pp, cp, ep, etp, order
    (1, 1, 1, 1, 1, 1, "tp-cp-ep-dp-pp"),
    (2, 2, 1, 1, 1, 2, "tp-cp-ep-dp-pp"),
    (4, 2, 2, 1, 1, 2, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 2, 1, 2, "tp-cp-ep-dp-pp"),
    (8, 1, 1, 1, 8, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 1, 4, 1, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 1, 2, 2, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 2, 2, 1, "tp-cp-ep-dp-pp"),
    (16, 4, 2, 1, 2, 2, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 2, 4, 2, "tp-cp-ep-dp-pp"),
    (32, 4, 2, 2, 8, 1, "tp-cp-ep-dp-pp"),
    (64, 8, 4, 1, 8, 1, "tp-cp-ep-dp-pp"),
    (64, 4, 4, 2, 4, 2, "tp-cp-ep-dp-pp"),
    (8, 2, 2, 1, 1, 2, "tp-dp-pp"),
    (8, 2, 2, 1, 1, 2, "tp-pp-dp"),
    (8, 2, 2, 2, 1, 2, "tp-pp-cp-dp"),
    (8, 2, 1, 2, 2, 1, "tp-ep-cp-dp-pp"),
    (16, 2, 2, 1, 4, 1, "tp-ep-dp-cp-pp"),
    (16, 2, 4, 2, 1, 2, "tp-cp-dp-pp"),
    (24, 2, 3, 2, 2, 2, "tp-cp-ep-dp-pp"),
    (12, 3, 2, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (16, 4, 1, 2, 2, 2, "cp-tp-ep-dp-pp"),
    (32, 2, 4, 1, 4, 2, "tp-cp-ep-dp-pp"),
]

DENSE_TOKENS = {
    "tp": "tp",
    "cp": "cp",
    "dp": "dp",
    "pp": "pp",
    "dp_cp": "dp-cp",
    "tp_cp": "tp-cp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-dp-cp",
    "mp": "tp-pp",
}
EXPERT_TOKENS = {"ep": "ep", "etp": "tp", "edp": "dp", "etp_ep": "tp-ep", "expert_mp": "tp-ep-pp"}


def main(path: str) -> None:
    cases = []
    for world, tp, pp, cp, ep, etp, order in CONFIGS:
        dp = world // (tp * pp * cp)
        edp = world // (etp * ep * pp)
        dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
        groups = {name: dense.get_ranks(token) for name, token in DENSE_TOKENS.items()}
        groups |= {name: expert.get_ranks(token) for name, token in EXPERT_TOKENS.items()}
        assert groups["pp"] == expert.get_ranks("pp")
        config = {
            "world": world,
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "ep": ep,
            "etp": etp,
            "order": order,
        }
        cases.append({"config": config, "groups": groups})
    with open(path, "w") as f:
        json.dump({"source": "megatron-core 0.19.2 RankGenerator", "cases": cases}, f, indent=0)
    print(f"wrote {len(cases)} configurations to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
