"""GPU and cluster specifications the planner prices layouts on, each constant with its source.

A :class:`GPUSpec` is what a data sheet says about one GPU (dense bf16 peak, memory, NVLink
bandwidth); a :class:`Cluster` adds how many GPUs there are, how many share a node, and the
inter-node bandwidth each GPU gets. Bandwidths are per GPU and per direction, in bytes/s (the
rate one rank sends at while every rank of a ring or all-to-all sends at once).

``EFFICIENCY`` holds the one achievable-compute constant per (GPU, precision): the fraction
of the data-sheet peak that the layers' matmuls reach while the pipeline is full. It is
fitted to published training throughput (docs/planner.md, "Efficiency constants"), never
per recipe; :mod:`shardwork.trainer.plan.calibrate` refits it and produces the
leave-one-out table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["CLUSTERS", "EFFICIENCY", "GPUS", "Cluster", "GPUSpec", "efficiency"]

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model's data-sheet numbers."""

    name: str
    peak_bf16: float
    """Dense (no sparsity) bf16 tensor-core peak, FLOP/s."""
    memory: float
    """Device memory in bytes."""
    nvlink: float
    """NVLink bandwidth per GPU per direction, bytes/s (half the data sheet's bidirectional)."""
    source: str


GPUS: dict[str, GPUSpec] = {
    "a100-80gb": GPUSpec(
        "a100-80gb",
        312e12,
        80 * GIB,
        300 * GB,
        "NVIDIA A100 data sheet (2021): 312 TFLOP/s dense BF16, 80 GB HBM2e, NVLink 3 600 GB/s",
    ),
    "h100-sxm": GPUSpec(
        "h100-sxm",
        989e12,
        81559 * 2**20,
        450 * GB,
        "NVIDIA H100 data sheet (2023): 989 TFLOP/s dense BF16 (SXM), 80 GB HBM3 (81,559 MiB "
        "usable), NVLink 4 900 GB/s",
    ),
    "h800-sxm": GPUSpec(
        "h800-sxm",
        989e12,
        81559 * 2**20,
        200 * GB,
        "H100 silicon with NVLink cut to 400 GB/s (NVIDIA H800 data sheet); DeepSeek-V3 report "
        "(2024) §3.2.2 measures ~160 GB/s achievable NVLink",
    ),
}


@dataclass(frozen=True)
class Cluster:
    """A number of identical GPUs, ``gpus_per_node`` of them joined by NVLink in each node."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int
    internode: float
    """Inter-node bandwidth per GPU per direction, bytes/s."""
    source: str = "user"

    def replace(self, **changes) -> Cluster:
        return dataclasses.replace(self, **changes)


def _cluster(gpu: str, gpus_per_node: int, internode_gbit_per_gpu: float, source: str):
    return dict(
        gpu=GPUS[gpu],
        gpus_per_node=gpus_per_node,
        internode=internode_gbit_per_gpu / 8 * GB,
        source=source,
    )


#: Named clusters of the published recipes (``num_gpus`` comes from the recipe or the CLI).
CLUSTERS: dict[str, dict] = {
    "selene": _cluster(
        "a100-80gb",
        8,
        200,
        "Narayanan et al. 2021 §5: DGX A100 nodes, 8 x 200 Gb/s HDR InfiniBand per node",
    ),
    "jean-zay": _cluster(
        "a100-80gb",
        8,
        50,
        "BLOOM paper (Le Scao et al. 2022) §3.4: 4 x 100 Gb/s Omni-Path links per 8-GPU node",
    ),
    "meta-h100": _cluster(
        "h100-sxm",
        8,
        400,
        "Llama 3 paper (Dubey et al. 2024) §3.3.1: 8 GPUs per server, 400 Gb/s RoCE per GPU",
    ),
    "deepseek-h800": _cluster(
        "h800-sxm",
        8,
        400,
        "DeepSeek-V3 report §3.1: 8 H800 per node, 400 Gb/s (50 GB/s) InfiniBand per GPU",
    ),
}

#: Achievable fraction of ``peak_bf16`` for the layers' matmuls, one per (GPU, precision),
#: each fitted by ``calibrate.fit_efficiency`` to every published MFU of that GPU at once
#: (docs/planner.md, "Efficiency constants", with the leave-one-out table).
#: A100: Narayanan et al. 2021, GPT-1T and GPT-530B. H100: the three Llama 3 405B rows (Dubey
#: et al. 2024, Table 4), priced with their published pipeline (interleaved, 8 chunks, first
#: and last virtual stage empty) and, at 8K, without recompute. H800: no published MFU; it is
#: H100 silicon with less NVLink, so the H100 value is carried over (an assumption).
EFFICIENCY: dict[tuple[str, str], float] = {
    ("a100-80gb", "bf16"): 0.608,
    ("h100-sxm", "bf16"): 0.564,
    ("h800-sxm", "bf16"): 0.564,
}


def efficiency(gpu: str, precision: str = "bf16") -> float:
    """The constant for ``gpu`` at ``precision`` (KeyError lists the known pairs)."""
    key = (gpu, precision)
    if key not in EFFICIENCY:
        raise KeyError(
            f"no efficiency constant for gpu={gpu!r} precision={precision!r}; known: "
            + ", ".join(f"{g}/{p}" for g, p in EFFICIENCY)
        )
    return EFFICIENCY[key]
