"""Price every layout: memory per GPU (the calculator), step time (:mod:`.step_time`), rank.

:func:`plan` enumerates the layouts the trainer accepts (:mod:`.layouts`), refuses those whose
most loaded rank does not fit ``USABLE_MEMORY`` of the GPU, predicts the step time of the
others and ranks them. Rankings are by *parallel layout* (tp, cp, pp, dp, ep, etp), each
represented by its fastest fitting variant (vpp, micro-batch, recompute): those knobs are
tuned per layout in practice, and the published recipes name the parallel sizes.

Memory is ``shardwork.models.calculator.memory_estimate`` of the model as a GPU run trains
it (:func:`planning_model`: bf16, the fused Triton kernels that ``kernel_backend="auto"``
picks on CUDA; weights bf16, fp32 gradients, ZeRO-1 fp32 master + Adam moments), with
sequence parallelism on when tp > 1 and the activations the trainer's schedule holds at its
peak (interleaving included, chunk by chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwork.models import GPTConfig
from shardwork.models.calculator import MemoryEstimate, memory_estimate
from shardwork.trainer.plan.cluster import Cluster, efficiency
from shardwork.trainer.plan.layouts import Layout, parallel_layouts, variants
from shardwork.trainer.plan.step_time import StepTime, model_flops, step_time

__all__ = ["USABLE_MEMORY", "Plan", "PlanRow", "plan", "planning_model", "price"]

#: Fraction of device memory the estimate may fill. The rest is for what the calculator does
#: not count: the CUDA context and NCCL buffers (1-2 GiB), the caching allocator's
#: fragmentation, one layer's transient recompute. An assumption, not a measurement
#: (docs/planner.md); the table prints each row's GiB so a reader can apply another margin.
USABLE_MEMORY = 0.9


@dataclass(frozen=True)
class PlanRow:
    """One priced layout: ``refused`` says why it does not fit, else ``time`` is set."""

    layout: Layout
    memory: float
    """Bytes on the most loaded rank."""
    estimate: MemoryEstimate
    time: StepTime | None = None
    mfu: float | None = None
    """Model FLOPs (no recompute) per second over ``num_gpus × peak``."""
    refused: str | None = None


@dataclass
class Plan:
    """All priced layouts of one problem, fitting ones ranked by step time."""

    model: GPTConfig
    cluster: Cluster
    global_batch: int
    seq_length: int
    efficiency: float
    rows: list[PlanRow] = field(default_factory=list)
    refused: list[PlanRow] = field(default_factory=list)

    def ranked(self) -> list[PlanRow]:
        """The fastest variant of each parallel layout, fastest first."""
        best: dict[tuple, PlanRow] = {}
        for row in self.rows:
            key = row.layout.parallel_key
            if key not in best or row.time.total < best[key].time.total:
                best[key] = row
        return sorted(best.values(), key=lambda r: (r.time.total, r.layout))

    def rank_of(self, **sizes: int) -> int | None:
        """1-based rank of the first parallel layout matching ``sizes`` (tp=, pp=, ...)."""
        for i, row in enumerate(self.ranked(), start=1):
            if all(getattr(row.layout, k) == v for k, v in sizes.items()):
                return i
        return None


def planning_model(model: GPTConfig) -> GPTConfig:
    """The model as a bf16 GPU run trains it: parameters and activations in bf16, and the
    fused Triton kernels (norms, SwiGLU, rotary) that ``kernel_backend="auto"`` runs on CUDA,
    whose saved activations the calculator counts (``calculator_memory.fused_kernels``)."""
    return model.replace(
        params_dtype=torch.bfloat16, compute_dtype=torch.bfloat16, kernel_backend="triton"
    )


def _memory(model: GPTConfig, lay: Layout, global_batch: int, seq_length: int):
    m = global_batch // (lay.dp * lay.micro_batch)
    est = memory_estimate(
        model.replace(sequence_parallel=lay.tp > 1),
        seq_length=seq_length, micro_batch_size=lay.micro_batch, tp=lay.tp, pp=lay.pp,
        dp=lay.dp, cp=lay.cp, ep=lay.ep, etp=lay.etp if model.moe is not None else None,
        vpp=lay.vpp if lay.vpp > 1 else None, num_microbatches=m, recompute=lay.recompute,
        **lay.split,
    )  # fmt: skip
    return est.total, est


def price(
    model: GPTConfig,
    layout: Layout,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_length: int,
    efficiency: float,
) -> PlanRow:
    """Memory and (if it fits) step time and MFU of one layout."""
    need, est = _memory(model, layout, global_batch, seq_length)
    budget = USABLE_MEMORY * cluster.gpu.memory
    if need > budget:
        why = (
            f"needs {need / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB usable "
            f"(weights {est.weights / 2**30:.1f}, grads {est.gradients / 2**30:.1f}, "
            f"optimizer {est.optimizer / 2**30:.1f}, activations "
            f"{est.activations / 2**30:.1f} on pp rank {est.pp_rank})"
        )
        return PlanRow(layout, need, est, refused=why)
    t = step_time(
        model,
        layout,
        cluster,
        global_batch=global_batch,
        seq_length=seq_length,
        efficiency=efficiency,
    )
    flops = model_flops(model, seq_length).model * global_batch * seq_length
    mfu = flops / (t.total * cluster.num_gpus * cluster.gpu.peak_bf16)
    return PlanRow(layout, need, est, time=t, mfu=mfu)


def plan(
    model: GPTConfig,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_length: int,
    precision: str = "bf16",
    eff: float | None = None,
) -> Plan:
    """Enumerate, price and rank every layout of ``model`` on ``cluster``."""
    model = planning_model(model)
    eff = efficiency(cluster.gpu.name, precision) if eff is None else eff
    result = Plan(model, cluster, global_batch, seq_length, eff)
    kw = dict(global_batch=global_batch, seq_length=seq_length, efficiency=eff)
    for base in parallel_layouts(
        model,
        num_gpus=cluster.num_gpus,
        gpus_per_node=cluster.gpus_per_node,
        global_batch=global_batch,
        seq_length=seq_length,
    ):
        modes = [sizes for sizes in variants(base, global_batch) if sizes]
        if not modes:  # no micro-batch size the schedule can run
            continue
        leanest = price(model, modes[-1][0], cluster, **kw)  # full recompute, smallest batch
        if leanest.refused is not None:  # no micro-batch or recompute choice can fit
            result.refused.append(leanest)
            continue
        for sizes in modes:
            for lay in sizes:
                row = price(model, lay, cluster, **kw)
                if row.refused is not None:
                    result.refused.append(row)
                    break  # a larger micro-batch needs more memory still
                result.rows.append(row)
    return result
