"""shardwork.models.pipeline: pipeline parallelism that any trainer can drive.

- Schedules with Megatron's calling convention: :func:`forward_backward_no_pipelining`,
  :func:`forward_backward_1f1b`, :func:`forward_backward_interleaved_1f1b`, chosen by
  :func:`get_schedule`; each returns per-microbatch :class:`MicrobatchLoss` on the last
  stage. :func:`reduce_loss` gives the true global per-token mean.
- :func:`finalize_model_grads`: DP sync (duck-typed), sequence-parallel and shared-embedding
  reductions, MoE tracker/hooks, and division by the global token count.
- :func:`layer_split` / :func:`stage_layers` / :func:`chunk_layer_counts` split a model's
  layers over pp × vpp stages (uneven ends per rank, or per virtual stage as Llama 3 does);
  :func:`build_stage` / :func:`build_model_chunks` build GPT chunks (:class:`GPTStage`);
  ``mtp_standalone=True`` gives the MTP depths a rank of their own (``mtp_stage.py``).
- :func:`pipeline_logits`: one forward-only pass giving the last stage's ``[b, s, V]`` logits.
- Schedules are plans computed ahead of time (``plan.py``) and executed with batched
  point-to-point exchanges that cannot deadlock (``p2p.py``).
"""

from shardwork.models.pipeline.finalize import all_reduce_coalesced, finalize_model_grads
from shardwork.models.pipeline.logits import pipeline_logits
from shardwork.models.pipeline.losses import MicrobatchLoss, loss_totals, reduce_loss
from shardwork.models.pipeline.mtp_stage import standalone_last_stage_layers
from shardwork.models.pipeline.plan import Action, peak_in_flight, plan_ticks, schedule_orders
from shardwork.models.pipeline.schedules import (
    forward_backward_1f1b,
    forward_backward_interleaved_1f1b,
    forward_backward_no_pipelining,
    get_schedule,
)
from shardwork.models.pipeline.split import (
    chunk_layer_counts,
    layer_split,
    layers_per_rank,
    stage_layers,
)
from shardwork.models.pipeline.stage import GPTStage, build_model_chunks, build_stage

__all__ = [
    "Action",
    "GPTStage",
    "MicrobatchLoss",
    "all_reduce_coalesced",
    "build_model_chunks",
    "build_stage",
    "chunk_layer_counts",
    "finalize_model_grads",
    "forward_backward_1f1b",
    "forward_backward_interleaved_1f1b",
    "forward_backward_no_pipelining",
    "get_schedule",
    "layer_split",
    "layers_per_rank",
    "loss_totals",
    "peak_in_flight",
    "pipeline_logits",
    "plan_ticks",
    "reduce_loss",
    "schedule_orders",
    "stage_layers",
    "standalone_last_stage_layers",
]
