"""Validation of ``checkpoint.megatron_init``, before any process group.

The rule for starting from a Megatron-Core checkpoint: the architecture comes from the run's
``[model]`` table (a preset and fields, e.g. ``vocab_size``), since a ``torch_dist`` folder
need not record it; the checkpoint's index (no weights read) must then hold exactly the
tensors that model has, at their shapes, and Megatron-LM's ``args`` in ``common.pt``, when
present, must agree (shardwork.models.megatron's checks, whose messages name the key or field
and both values).

- Not together with ``checkpoint.hf_init`` (two sources of the initial weights).
- Not with ``checkpoint.resume`` naming a checkpoint path: that starts from another run's
  weights, which would silently replace the import. ``resume="auto"`` is allowed: a run that
  restarts after a stop resumes its own checkpoint and skips the import, like ``hf_init``.
"""

from __future__ import annotations

from shardwork.models.megatron import check_megatron_checkpoint
from shardwork.trainer.config.sections import TrainConfig


def check_megatron_init(config: TrainConfig, problems: list[str], *, model) -> None:
    """Check ``checkpoint.megatron_init``; ``model`` is the run's GPTConfig (None when it could
    not be built: the checkpoint's shapes are not compared)."""
    c = config.checkpoint
    folder = c.megatron_init
    if folder is None:
        return
    where = f"checkpoint.megatron_init={folder!r}"
    if c.hf_init is not None:
        problems.append(
            f"{where} and checkpoint.hf_init={c.hf_init!r} both set the initial weights; "
            "valid: one of them"
        )
    if c.resume not in ("auto", "none"):
        problems.append(
            f"{where} with checkpoint.resume={c.resume!r}: resuming another run replaces the "
            "imported weights; valid: resume='none' or 'auto' (a restarted run resumes its own)"
        )
    if model is None:
        return
    try:
        check_megatron_checkpoint(folder, model)
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
