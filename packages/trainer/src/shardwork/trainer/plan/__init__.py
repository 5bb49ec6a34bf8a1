"""``shardwork-plan``: enumerate, price and rank the parallel layouts of a training run.

Modules: :mod:`.cluster` (GPU and cluster constants, the efficiency constants),
:mod:`.layouts` (what the trainer accepts), :mod:`.step_time` (the cost model),
:mod:`.planner` (memory, step time, ranking), :mod:`.calibrate` (fitting the efficiency
constants, leave-one-out), :mod:`.report` (table and SVG plot), :mod:`.cli`.
docs/planner.md explains each formula and its source.
"""

from shardwork.trainer.plan.cluster import CLUSTERS, EFFICIENCY, GPUS, Cluster, GPUSpec
from shardwork.trainer.plan.layouts import Layout, parallel_layouts
from shardwork.trainer.plan.planner import Plan, PlanRow, plan, price
from shardwork.trainer.plan.step_time import StepTime, step_time

__all__ = [
    "CLUSTERS",
    "EFFICIENCY",
    "GPUS",
    "Cluster",
    "GPUSpec",
    "Layout",
    "Plan",
    "PlanRow",
    "StepTime",
    "parallel_layouts",
    "plan",
    "price",
    "step_time",
]
