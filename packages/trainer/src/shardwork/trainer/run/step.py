"""One training step and one evaluation pass, driven by shardwork.models.pipeline.

- The schedule is ``get_schedule(pp, vpp)``: gradient accumulation without
  pipelining, 1F1B, or interleaved 1F1B; it calls :func:`forward_step` once
  per micro-batch and chunk.
- Only the first pipeline stage reads input ids (and the last, for models
  with multi-token prediction) and only the last reads labels; middle stages read nothing (their
  micro-batch iterator yields empty dicts and they are given no dataset). With vpp chunks each chunk gets its own iterator over the
  same micro-batches.
- Loss: the model returns ``(loss_sum, num_tokens)``; backward starts from
  the sum (times the fp16 loss scale), ``finalize_model_grads`` finishes the
  reductions and divides every gradient by the global token count, so the
  gradient is exactly that of the global per-token mean.
- MoE models: trackers are reset per step, aux losses get the main loss's
  backward scale, ``moe_finalize_kwargs`` reduces the trackers and updates
  expert biases inside finalize_model_grads, and the step reports aux losses
  (one value per type) and per-layer expert load.
- Models with multi-token prediction: the MTP loss reaches backward through the
  model (with the main loss's backward scale) and is *not* part of the returned
  main loss; its per-depth token means are reduced by
  ``shardwork.models.mtp.reduce_mtp_losses`` (every rank) and reported separately,
  for training steps and evaluation alike.
- A collective that times out or loses its peer is re-raised by
  :func:`~.collectives.collective_phase` naming the step, the phase and the groups it
  communicates over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from shardwork.models import slice_for_context_parallel
from shardwork.models.moe import moe_finalize_kwargs
from shardwork.models.mtp import reduce_mtp_losses
from shardwork.models.pipeline import finalize_model_grads, get_schedule, loss_totals, reduce_loss
from shardwork.moe_router import AuxLossTracker
from shardwork.trainer.data.builder import micro_batch
from shardwork.trainer.run.collectives import collective_phase


def micro_batches(
    dataset,
    *,
    consumed: int,
    count: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    first_stage: bool,
    last_stage: bool,
    device: torch.device,
    last_stage_inputs: bool = False,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> Iterator[dict]:
    """The ``count`` micro-batches of this rank: ``{"input_ids", "labels"}`` as the stage needs.

    ``last_stage_inputs``: the last stage also needs input ids (multi-token prediction
    embeds the shifted inputs there).
    """
    for index in range(count):
        # Middle stages still yield one (empty) item per micro-batch: the schedule calls next() once
        # per micro-batch on every stage.
        if not (first_stage or last_stage):
            yield {}
            continue
        rows = micro_batch(
            dataset,
            consumed=consumed,
            index=index,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
        ).to(device, non_blocking=True)
        batch = {}
        if first_stage or last_stage_inputs:
            # Next-token prediction: inputs are tokens [0, L-1), labels the same rows shifted by
            # one.
            batch["input_ids"] = _context_slice(rows[:, :-1], cp_rank, cp_size)
        if last_stage:
            batch["labels"] = _context_slice(rows[:, 1:], cp_rank, cp_size)
        yield batch


def _context_slice(x: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This context-parallel rank's load-balanced chunks of the sequence dim (the model
    takes ``[b, s/cp]``); the identity without context parallelism."""
    if cp_size == 1:
        return x
    return slice_for_context_parallel(x, cp_rank=cp_rank, cp_size=cp_size, dim=1)


def _loss_fn(output):
    loss_sum, num_tokens = output
    return loss_sum, num_tokens, {}


def forward_step(data_iterator, chunk):
    """Megatron-style forward step: run ``chunk`` on the next micro-batch."""
    batch = next(data_iterator)
    output = chunk(input_ids=batch.get("input_ids"), labels=batch.get("labels"))
    return output, _loss_fn


@dataclass
class StepOutput:
    loss: float
    """Global mean loss (nats/token) of this step's batch."""
    num_tokens: int
    grad_norm: float | None
    update_successful: bool
    moe: dict | None = None
    """MoE statistics of the step: aux losses (mean over MoE layers and micro-batches),
    ``load_imbalance`` and ``expert_load`` (fraction of routed tokens, [MoE layer][expert])."""
    mtp: list[float] | None = None
    """Models with MTP: per-depth global mean MTP loss (nats/token, depth 1 first), without
    the ``loss_coeff`` weight; None without MTP."""


@dataclass
class EvalOutput:
    loss: float
    """Global mean main LM loss (nats/token) of the evaluated samples."""
    num_tokens: int
    mtp: list[float] | None = None
    """Models with MTP: per-depth global mean MTP loss on the same samples."""


def _reset_mtp(modules) -> None:
    """Zero the MTP loss trackers (each holds this step's or evaluation's per-depth sums)."""
    for m in modules:
        mtp = getattr(m, "mtp", None)
        if mtp is not None:
            mtp.tracker.reset()


def _mtp_losses(assembly, groups) -> list[float] | None:
    """Per-depth global mean MTP losses since the last :func:`_reset_mtp` (every rank calls)."""
    if getattr(assembly.model_config, "mtp", None) is None:
        return None
    return reduce_mtp_losses(assembly.modules, groups)


def _prepare_moe(modules, grad_scale: float) -> list:
    """Reset the MoE and MTP trackers and give aux / MTP losses the main loss's backward scale.

    The main loss is back-propagated as a token *sum* (times ``grad_scale``) and
    finalize_model_grads divides every gradient by the global token count, so aux losses
    enter backward with the same factor ``grad_scale``.
    """
    _reset_mtp(modules)
    trackers = []
    for m in modules:
        tracker = getattr(m, "aux_loss_tracker", None)
        if tracker is not None:
            tracker.reset()
            trackers.append(tracker)
        for name in ("aux_loss_scale", "mtp_loss_scale"):
            scale = getattr(m, name, None)
            if scale is not None:
                scale.set(grad_scale)
    return trackers


def _moe_stats(trackers, num_microbatches: int) -> dict | None:
    """Aux-loss summary and per-layer expert load from the (already reduced) trackers."""
    if not trackers:
        return None
    first = trackers[0]
    total = AuxLossTracker(num_layers=first.num_layers, num_experts=first.num_experts)
    for t in trackers:
        total.losses += t.losses.cpu()
        total.tokens_per_expert += t.tokens_per_expert.cpu()
    stats = total.summary(num_micro_batches=num_microbatches)
    counts = total.tokens_per_expert
    # MoE layers with no counted tokens are left out: no 0/0 fractions.
    used = counts.sum(dim=1) > 0
    if bool(used.any()):
        rows = counts[used]
        stats["expert_load"] = (rows / rows.sum(dim=1, keepdim=True)).tolist()
    return stats


def activation_shape(config, *, seq_length: int, micro_batch_size: int, groups) -> list[int]:
    """Shape of the activation sent between pipeline stages: ``[s/cp(/tp under SP), b, h]``."""
    # The pipeline's send/receive buffers are allocated from this shape on both sides.
    local = seq_length // groups.size("cp")
    if config.sequence_parallel:
        local //= groups.size("tp")
    return [local, micro_batch_size, config.hidden_size]


def run_schedule(
    assembly,
    runtime,
    dataset,
    *,
    consumed: int,
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    vpp: int | None,
    forward_only: bool,
    grad_scale: float = 1.0,
):
    """Run the pipeline schedule over ``num_microbatches``; returns the MicrobatchLoss list."""
    groups = runtime.groups
    schedule = get_schedule(groups.size("pp"), vpp)

    def iterator():
        return micro_batches(
            dataset,
            consumed=consumed,
            count=num_microbatches,
            micro_batch_size=micro_batch_size,
            dp_rank=groups.rank("dp"),
            dp_size=groups.size("dp"),
            first_stage=groups.is_first_pp_stage,
            last_stage=groups.is_last_pp_stage,
            device=runtime.device,
            last_stage_inputs=getattr(assembly.model_config, "mtp", None) is not None,
            cp_rank=groups.rank("cp"),
            cp_size=groups.size("cp"),
        )

    chunks = assembly.chunks
    data = iterator() if len(chunks) == 1 else [iterator() for _ in chunks]
    model = chunks[0] if len(chunks) == 1 else chunks
    return schedule(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model,
        num_microbatches=num_microbatches,
        pp_group=groups.pp,
        tensor_shape=activation_shape(
            assembly.model_config,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            groups=groups,
        ),
        dtype=assembly.model_config.activation_dtype,
        device=runtime.device,
        forward_only=forward_only,
        grad_scale=grad_scale,
    )


def _forward_groups(assembly) -> tuple[str, ...]:
    """The groups a forward (and backward) pass communicates over, named in its failures: MoE
    layers add the expert all-to-all groups."""
    names = ("pp", "tp", "cp", "dp_cp")
    if getattr(assembly.model_config, "moe", None) is not None:
        names += ("ep", "etp")
    return names


def train_step(
    assembly,
    runtime,
    dataset,
    *,
    consumed: int,
    global_batch_size: int,
    config,
    step: int | None = None,
) -> StepOutput:
    """Forward/backward over one global batch, finalize gradients, optimizer step
    (``step``: the step's index, named in a collective failure)."""
    groups = runtime.groups
    mbs = config.schedule.micro_batch_size
    # Each data-parallel rank runs global / (mbs * dp) micro-batches.
    num_micro = global_batch_size // (mbs * groups.size("dp"))
    timeout = config.parallel.timeout_minutes
    for m in assembly.modules:
        m.train()
    assembly.optimizer.zero_grad()
    # The backward scale (fp16 loss scale, else 1) is read before backward; the optimizer divides it
    # out again in step().
    grad_scale = assembly.optimizer.loss_scale
    trackers = _prepare_moe(assembly.modules, grad_scale)
    where = "" if step is None else f"train step {step}, "
    with collective_phase(
        f"{where}forward/backward", groups, _forward_groups(assembly), timeout_minutes=timeout
    ):
        losses = run_schedule(
            assembly,
            runtime,
            dataset,
            consumed=consumed,
            num_microbatches=num_micro,
            micro_batch_size=mbs,
            seq_length=config.data.seq_length,
            vpp=config.parallel.vpp,
            forward_only=False,
            grad_scale=grad_scale,
        )
    with collective_phase(
        f"{where}gradient finalisation",
        groups,
        ("dp_cp", "tp", "pp", "embedding"),
        timeout_minutes=timeout,
    ):
        # finalize_model_grads divides every gradient by the global token count it reduces from
        # these.
        _, local_tokens = loss_totals(losses, device=runtime.device)
        finalize_model_grads(
            assembly.chunks,
            groups,
            num_tokens=local_tokens,
            **moe_finalize_kwargs(assembly.chunks, groups),
        )
    with collective_phase(
        f"{where}optimizer step", groups, ("dp_cp", "mp"), timeout_minutes=timeout
    ):
        result = assembly.optimizer.step()
    with collective_phase(
        f"{where}loss reduction", groups, ("pp", "dp_cp"), timeout_minutes=timeout
    ):
        # After the step, for reporting only; every pp and dp_cp rank takes part.
        mean, _, tokens = reduce_loss(
            losses, pp_group=groups.pp, dp_cp_group=groups.group("dp_cp"), device=runtime.device
        )
        mtp = _mtp_losses(assembly, groups)
    return StepOutput(
        loss=float(mean),
        num_tokens=int(tokens),
        grad_norm=result.grad_norm,
        update_successful=bool(result.update_successful),
        moe=_moe_stats(trackers, num_micro),
        mtp=mtp,
    )


def eval_chunk_size(groups, config) -> int:
    """Evaluation micro-batches run between two stop-flag checks.

    Without pipelining one (a check costs nothing more than the loop); with pipeline stages
    one global batch's micro-batches, so the pipeline fills and drains as often as in
    training rather than once per micro-batch.
    """
    if groups.size("pp") == 1:
        return 1
    mbs = config.schedule.micro_batch_size
    return max(1, config.schedule.global_batch_size // (mbs * groups.size("dp")))


@torch.no_grad()
def evaluate(
    assembly,
    runtime,
    dataset,
    *,
    num_microbatches: int,
    config,
    should_stop: Callable[[], bool] | None = None,
    step: int | None = None,
) -> EvalOutput | None:
    """Mean loss (nats/token) over ``num_microbatches`` per data-parallel rank of ``dataset``
    (and the per-depth MTP losses of models with MTP).

    ``should_stop`` is asked between chunks of :func:`eval_chunk_size` micro-batches; when it
    returns True the evaluation ends there and returns None. It must answer the same on every
    rank (e.g. a flag agreed over the world), since every rank has to leave at the same chunk.
    """
    groups = runtime.groups
    mbs = config.schedule.micro_batch_size
    chunk = eval_chunk_size(groups, config)
    for m in assembly.modules:
        m.eval()
    _reset_mtp(assembly.modules)
    losses = []
    with collective_phase(
        "evaluation" if step is None else f"evaluation after step {step}",
        groups,
        _forward_groups(assembly),
        timeout_minutes=config.parallel.timeout_minutes,
    ):
        for first in range(0, num_microbatches, chunk):
            # Asked between chunks only; the answer is the same on every rank, so all leave at the
            # same chunk and no rank waits in a collective of a pipeline that others have left.
            if first > 0 and should_stop is not None and should_stop():
                for m in assembly.modules:
                    m.train()
                return None
            losses += run_schedule(
                assembly,
                runtime,
                dataset,
                # Each chunk reads the next samples of every data-parallel rank.
                consumed=first * mbs * groups.size("dp"),
                num_microbatches=min(chunk, num_microbatches - first),
                micro_batch_size=mbs,
                seq_length=config.data.seq_length,
                vpp=config.parallel.vpp,
                forward_only=True,
            )
        mean, _, tokens = reduce_loss(
            losses, pp_group=groups.pp, dp_cp_group=groups.group("dp_cp"), device=runtime.device
        )
        mtp = _mtp_losses(assembly, groups)
    for m in assembly.modules:
        m.train()
    return EvalOutput(loss=float(mean), num_tokens=int(tokens), mtp=mtp)
