"""The step-time model: compute, each parallelism's communication, the pipeline bubble.

Everything is per training step of ``global_batch`` sequences of ``seq_length`` tokens on
``N = tp·cp·pp·dp`` GPUs, ``m = global_batch / (dp·micro_batch)`` micro-batches per pipeline,
``T = micro_batch·seq_length / cp`` tokens per rank and micro-batch, ``e = 2`` bytes (bf16).
FLOPs come from ``shardwork.models.calculator`` only (no formula is restated here): the
per-layer forward is ``(F(full recompute) − F) / L``, the head/MTP rest is ``F − 3·L·layer``,
the causal attention-score forward is ``(F(non-causal) − F(causal)) / 3``.

- Compute (hardware FLOPs: full recompute adds one forward of the layers, selective the
  attention scores): one micro-batch on the most loaded stage takes
  ``T·(layers_r·3·layer [+ recompute] [+ head on the last stage]) / (tp·peak·eff)``.
- Tensor parallelism with sequence parallelism (Korthikanti et al. 2022, §4.2.2): per layer
  and pass, two all-gathers and two reduce-scatters of ``T·h·e`` bytes, each moving
  ``(tp−1)/tp`` of it per GPU; an MoE layer with etp = 1 keeps only the attention's two.
  Passes: forward, backward (same volume, Korthikanti Fig. 5), recomputed forward. Exposed
  (Megatron runs them on the critical path; Narayanan et al. 2021 §3.2).
- Context parallelism: per layer, an all-gather of the other ranks' keys and values
  ``(cp−1)·T·kv_width·e`` (kv_width ``2·g/tp·d``, MLA ``n/tp·(dq+dv)``) forward and its
  reduce-scatter of gradients backward (the Llama 3 paper §3.3.2 all-gather CP); exposed.
- Expert parallelism: per MoE layer and pass, a dispatch and a combine all-to-all, each
  sending ``(ep−1)/ep · T/tp·k·h·e`` per GPU (Megatron-Core MoE, Lepikhin et al. 2020);
  over NVLink when ``etp·ep`` ranks fit a node, else over the inter-node link; exposed.
- Pipeline: point-to-point activations ``T·h·e/tp`` (scatter-gather optimisation, Narayanan
  et al. §4.1) forward and backward per virtual stage; the 1F1B bubble adds ``(pp−1)/vpp``
  micro-batch times to ``m`` (Narayanan et al. §2.2: bubble fraction ``(p−1)/(v·m)``).
- Data parallelism (ZeRO-1, the trainer's distributed optimizer): gradients reduce-scatter
  in fp32, ``(n−1)/n·P·4`` bytes, parameters all-gather in bf16, ``(n−1)/n·P·2``; n = dp·cp
  for dense parameters, edp for expert ones. The reduce-scatter overlaps the last
  micro-batch's backward and the all-gather the first micro-batch's forward (bucketed
  overlap: Li et al. 2020, PyTorch DDP; Megatron ``overlap_grad_reduce``/``overlap_param_gather``);
  only what outlasts them is exposed.

Links: a group whose ranks fit one node uses NVLink, else the inter-node bandwidth. Rank order
is the trainer's ``tp-cp-ep-dp-pp``: tp·cp span ``tp·cp`` ranks, dp ``tp·cp·dp``; pp stages
sit on different nodes unless all of tp·cp·dp·pp fits one.
Not modelled: the optimizer step, kernel launch latency, load imbalance between experts,
DualPipe's compute/communication overlap, stragglers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwork.models import GPTConfig, spec_for
from shardwork.models.calculator import flops_per_token
from shardwork.models.calculator_memory import local_parameters
from shardwork.models.pipeline import layers_per_rank
from shardwork.trainer.plan.cluster import Cluster
from shardwork.trainer.plan.layouts import Layout

__all__ = ["ModelFlops", "StepTime", "model_flops", "step_time"]

BYTES = 2  # bf16 activations and parameters
GRAD_BYTES = 4  # fp32 gradients (the trainer's main_grad; Llama 3 §3.3.4 reduce-scatters fp32)


@dataclass(frozen=True)
class ModelFlops:
    """Per-token FLOPs split by where they run (all from the calculator)."""

    model: float
    """Training FLOPs per token without recompute (the MFU numerator)."""
    layer_forward: float
    """Forward FLOPs per token of one average decoder layer (causal attention)."""
    scores_forward: float
    """Of which the attention scores (QKᵀ, AV), per layer."""
    rest: float
    """Head, embedding and MTP, forward + backward, per token (on the last stage)."""
    num_layers: int


@lru_cache(maxsize=64)
def model_flops(model: GPTConfig, seq_length: int) -> ModelFlops:
    """Derive the per-layer split from the calculator's totals (see module docstring)."""
    f = flops_per_token(model, seq_length)
    layers_fwd = flops_per_token(model, seq_length, full_recompute=True) - f
    scores = (flops_per_token(model, seq_length, causal=False) - f) / 3
    L = model.num_layers
    return ModelFlops(f, layers_fwd / L, scores / L, f - 3 * layers_fwd, L)


def hardware_flops(flops: ModelFlops, recompute: str) -> float:
    """FLOPs per token the GPUs execute: model FLOPs plus what recompute repeats."""
    L = flops.num_layers
    extra = {"none": 0.0, "selective": flops.scores_forward, "full": flops.layer_forward}
    return flops.model + L * extra[recompute]


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, split into what the critical path spends them on."""

    compute: float
    """All micro-batches' compute on the most loaded stage (no bubble)."""
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    dp: float
    """Exposed data-parallel gradient/parameter traffic."""

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.cp + self.ep + self.pp + self.dp


def _link(cluster: Cluster, span: int) -> float:
    return cluster.gpu.nvlink if span <= cluster.gpus_per_node else cluster.internode


def _kv_width(model: GPTConfig, tp: int) -> float:
    if model.mla is not None:
        n = model.num_attention_heads // tp
        return n * (model.mla.qk_head_dim + model.mla.v_head_dim)
    return 2 * model.kv_heads // tp * model.kv_channels


def _moe_fraction(model: GPTConfig) -> float:
    if model.moe is None:
        return 0.0
    return sum(layer.mlp == "moe" for layer in spec_for(model).layers) / model.num_layers


def _stage_flops(model: GPTConfig, flops: ModelFlops, layout: Layout) -> float:
    """Hardware FLOPs per token of the most loaded pipeline stage."""
    counts = layers_per_rank(model.num_layers, layout.pp, vpp=layout.vpp, **layout.split)
    per_layer = hardware_flops(flops, layout.recompute) - flops.rest
    per_layer /= model.num_layers
    loads = [n * per_layer for n in counts]
    loads[-1] += flops.rest
    return max(loads)


def _dp_seconds(model: GPTConfig, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds of the most loaded stage's ZeRO-1 traffic."""
    lay = layout
    etp = lay.etp if model.moe is not None else None
    worst = (0.0, 0.0)
    for r in {0, min(1, lay.pp - 1), lay.pp - 1}:  # the ends and a middle rank (all alike)
        local = local_parameters(
            model, tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=etp, pp_rank=r, vpp=lay.vpp, **lay.split
        )
        n = lay.dp * lay.cp
        edp = lay.tp * lay.cp * lay.dp // (lay.ep * (lay.etp if model.moe else lay.tp))
        bw = _link(cluster, lay.tp * lay.cp * lay.dp)  # edp spans the same ranks at most
        dense = (n - 1) / n * local.dense / bw
        expert = (edp - 1) / edp * local.expert / bw if local.expert else 0.0
        cand = ((dense + expert) * GRAD_BYTES, (dense + expert) * BYTES)
        worst = max(worst, cand)
    return worst


def step_time(
    model: GPTConfig,
    layout: Layout,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_length: int,
    efficiency: float,
) -> StepTime:
    """Predicted seconds per step of ``layout`` (formulas: module docstring)."""
    lay, h = layout, model.hidden_size
    flops = model_flops(model, seq_length)
    m = global_batch // (lay.dp * lay.micro_batch)
    tokens = lay.micro_batch * seq_length / lay.cp
    rate = cluster.gpu.peak_bf16 * efficiency
    t_mb = tokens * _stage_flops(model, flops, lay) / lay.tp / rate
    layers = max(layers_per_rank(model.num_layers, lay.pp, vpp=lay.vpp, **lay.split))
    passes = 3 if lay.recompute == "full" else 2
    moe = _moe_fraction(model)
    tp_colls = 4 - (2 * moe if lay.etp == 1 else 0) if lay.tp > 1 else 0
    tp_bytes = tp_colls * passes * (lay.tp - 1) / lay.tp * tokens * h * BYTES
    t_tp = layers * tp_bytes / _link(cluster, lay.tp)
    cp_bytes = (lay.cp - 1) * tokens * _kv_width(model, lay.tp) * BYTES * passes
    t_cp = layers * cp_bytes / _link(cluster, lay.tp * lay.cp)
    t_ep = 0.0
    if model.moe is not None and lay.ep > 1:
        sent = (lay.ep - 1) / lay.ep * tokens / lay.tp * model.moe.router.top_k * h * BYTES
        t_ep = layers * moe * 2 * passes * sent / _link(cluster, lay.etp * lay.ep)
    t_pp = 0.0
    if lay.pp > 1:
        span = lay.tp * lay.cp * lay.dp * lay.pp
        t_pp = 2 * lay.vpp * tokens * h * BYTES / lay.tp / _link(cluster, span)
    per_mb = t_mb + t_tp + t_cp + t_ep + t_pp
    bubble_mbs = (lay.pp - 1) / lay.vpp
    rs, ag = _dp_seconds(model, lay, cluster)
    dp = max(0.0, rs - t_mb * 2 / 3) + max(0.0, ag - t_mb / 3)
    scale = m  # every per-micro-batch cost repeats m times on the critical path
    return StepTime(
        compute=scale * t_mb,
        bubble=bubble_mbs * per_mb,
        tp=scale * t_tp,
        cp=scale * t_cp,
        ep=scale * t_ep,
        pp=scale * t_pp,
        dp=dp,
    )
