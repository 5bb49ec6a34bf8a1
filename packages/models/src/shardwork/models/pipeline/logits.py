"""Full-vocabulary logits of a pipelined model: one forward-only pass through the schedule.

:func:`pipeline_logits` runs ``input_ids`` through a pipeline rank's stage (any pp, tp, ep
layout; one micro-batch) with the layout's own schedule and returns, on the last pipeline
stage, the logits gathered over TP as ``[b, s, vocab_size]`` (the Hugging Face layout), and
None on the other stages. For evaluation, debugging and parity checks against another
implementation; training goes through the schedules with a loss.
"""

from __future__ import annotations

import torch

from shardwork.models.logits import gather_logits
from shardwork.models.pipeline.schedules import get_schedule
from shardwork.parallel_state import ProcessGroups

__all__ = ["pipeline_logits"]


@torch.no_grad()
def pipeline_logits(stage, groups: ProcessGroups, input_ids: torch.Tensor) -> torch.Tensor | None:
    """``[b, s, vocab_size]`` logits of ``input_ids [b, s]`` on the last pipeline stage, else None.

    Every rank of the layout calls it with the same ids; ``stage`` is this rank's model (a
    :class:`~shardwork.models.pipeline.GPTStage` or ``GPTModel``). Activations cross stages
    in the model's activation dtype as ``[s(/tp under SP), b, h]``. Context parallelism is
    refused (each cp rank would need its own slices of the sequence).
    """
    config = stage.config
    if groups.size("cp") > 1:
        raise ValueError(f"pipeline_logits takes whole sequences: cp={groups.size('cp')}, use 1")
    batch, seq = input_ids.shape
    captured: list[torch.Tensor] = []

    def forward_step(_data, chunk):
        out = chunk(input_ids)

        def keep(logits):
            captured.append(gather_logits(logits, tp_group=groups.tp, vocab_size=config.vocab_size))
            return logits.sum() * 0, torch.tensor(1), {}

        return out, keep

    tp = groups.size("tp") if config.sequence_parallel else 1
    get_schedule(groups.size("pp"))(
        forward_step_func=forward_step,
        data_iterator=None,
        model=stage,
        num_microbatches=1,
        pp_group=groups.group("pp"),
        tensor_shape=(seq // tp, batch, config.hidden_size),
        dtype=config.activation_dtype,
        forward_only=True,
    )
    return captured[0] if groups.is_last_pp_stage else None
