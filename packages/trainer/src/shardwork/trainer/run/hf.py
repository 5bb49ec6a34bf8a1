"""Start a run from a Hugging Face checkpoint (``checkpoint.hf_init``) and export its result
(``checkpoint.hf_export``), through shardwork.models.hf.

- Import happens on the model chunks *before* DistributedDataParallel wraps them and the
  optimizer copies its fp32 master weights, so step 0 trains the imported weights at any
  layout: each rank reads only the slices it holds (``load_hf_weights``). Every parameter is
  zeroed first, as ``shardwork.models.hf.from_pretrained`` does: the padding rows of the
  embedding and LM head are not in a Hugging Face checkpoint.
- A run that will resume a shardwork checkpoint skips the import (the checkpoint holds the
  trained weights); :func:`will_resume` decides that from ``checkpoint.resume`` alone.
- Export: every rank calls ``save_pretrained`` with its (only) chunk; the first rank writes
  config.json, generation_config.json (the ``hf_init`` folder's token ids) and safetensors. The trained model's config.json (also stored in the run's
  checkpoints) keeps ``shardwork-generate`` independent of the original folder.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.dist_checkpoint import CheckpointManager
from shardwork.models.full_state import full_state_dict
from shardwork.models.hf import (
    export_peft,
    import_peft,
    load_hf_weights,
    read_hf_config,
    read_token_ids,
    save_pretrained,
)
from shardwork.models.lora import is_lora_key, load_lora_state, lora_state_dict
from shardwork.trainer.errors import CheckpointError


def will_resume(config) -> bool:
    """Whether :class:`~shardwork.trainer.run.checkpointing.Checkpointer` will load a checkpoint
    (``checkpoint.resume``: a path, or 'auto' with a complete checkpoint in ``checkpoint.dir``)."""
    c = config.checkpoint
    if c.resume == "none":
        return False
    if c.resume != "auto":
        return True
    return CheckpointManager(c.dir).latest() is not None  # what 'auto' resumes from


@torch.no_grad()
def import_hf_weights(modules, folder: str) -> None:
    """Fill every model chunk of this rank with its slices of the checkpoint in ``folder``.

    Validation has read the folder's config.json and weight headers; what only the load sees
    (a tensor the model needs that the files lack, or of another shape) raises
    `CheckpointError` naming ``checkpoint.hf_init`` on every rank alike (exit 4).
    """
    for module in modules:
        for p in module.parameters():
            p.zero_()
        try:
            load_hf_weights(module, folder)
        except ValueError as exc:  # a tensor missing, of another shape, or one too many
            raise CheckpointError(
                f"checkpoint.hf_init={folder!r}: its weights do not fit the model: {exc}"
            ) from None


def export_hf(modules, folder: str, hf_init: str | None = None) -> None:
    """Write the model (every rank calls this with its one chunk) as a Hugging Face folder.

    A run started from ``hf_init`` exports that folder's token ids and
    ``generation_config.json`` (read at export, so a resumed run, which never imported the
    folder, keeps them too); a run from a preset exports none (see ``models.TokenIds``).
    """
    (module,) = modules  # validation rejects virtual pipeline stages with hf_export
    token_ids = None if hf_init is None else read_token_ids(hf_init, read_hf_config(hf_init))
    save_pretrained(module, folder, token_ids=token_ids)


def export_adapters(modules, folder: str, lora, hf_init: str) -> None:
    """Write the run's LoRA adapters as a PEFT folder for the ``hf_init`` model: every rank
    assembles the full adapter tensors (one all-reduce each, the adapters only; validation
    rejects virtual pipeline stages), the first rank writes."""
    (module,) = modules
    adapters = full_state_dict(module, keys=is_lora_key)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    export_peft(adapters, lora, module.config, folder, base_model_name_or_path=hf_init)


@torch.no_grad()
def import_peft_adapters(modules, folder: str) -> None:
    """Fill every chunk's LoRA adapters from the PEFT folder ``folder`` (each rank reads the
    whole, small adapter file and copies the slices of the keys its chunks hold)."""
    for module in modules:
        adapters, _ = import_peft(folder, module.config)
        held = set(lora_state_dict(module))
        load_lora_state(module, {k: v for k, v in adapters.items() if k in held})
