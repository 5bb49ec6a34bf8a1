"""Rebuild a trained model from its checkpoint on one CPU process, and sample text from it.

What ``shardwork-generate`` runs once it has parsed its flags (:mod:`.generate` keeps torch
out of its own imports, so this module is imported after OpenMP's wait policy is set). The
checkpoint carries the run's resolved config, so model and tokenizer are rebuilt exactly; the
model section loads through ``CheckpointManager`` at world size 1 (any training layout
reshards), verifying each file it reads against its recorded CRC-32. A LoRA run's checkpoint
holds the adapters only: the base is rebuilt from its ``checkpoint.hf_init`` folder (or the
seed) and the adapters are loaded onto it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch

from shardwork.dist_checkpoint import CheckpointManager, read_info
from shardwork.models.lora import apply_lora, lora_state_dict
from shardwork.parallel_state import ProcessGroups
from shardwork.trainer.config.load import config_from_dict
from shardwork.trainer.config.validate import check_model_settings
from shardwork.trainer.config.validate_peft import lora_config_of
from shardwork.trainer.data.tokenizer import load_tokenizer
from shardwork.trainer.errors import CheckpointError
from shardwork.trainer.model_factory import build_model_chunks, gpt_config
from shardwork.trainer.run.checkpointing import locate_checkpoint, no_checkpoint_reason
from shardwork.trainer.run.hf import import_hf_weights
from shardwork.trainer.run.megatron import import_megatron_weights


def load_for_inference(checkpoint: str | Path):
    """``(model, train_config, tokenizer)`` rebuilt from a checkpoint on one CPU process."""
    root, step = locate_checkpoint(checkpoint)
    manager = CheckpointManager(root)
    step = manager.latest() if step is None else step
    if step is None:
        reason = no_checkpoint_reason(checkpoint)
        raise CheckpointError(f"CHECKPOINT={str(checkpoint)!r}: {reason}")
    info = read_info(manager.step_path(step))
    text = (info.get("user_metadata") or {}).get("train_config")
    if text is None:
        raise CheckpointError(
            f"{manager.step_path(step)} was not written by shardwork-train (no config)"
        )
    problems: list[str] = []
    config = check_model_settings(config_from_dict(tomllib.loads(text)), problems)
    if problems:
        raise CheckpointError(
            f"{manager.step_path(step)}: its stored config: {'; '.join(problems)}"
        )
    hf = (info.get("user_metadata") or {}).get("hf_config")  # runs started from a HF folder
    groups = ProcessGroups.single()
    (model,) = build_model_chunks(gpt_config(config, hf=hf), groups, device=torch.device("cpu"))
    lora = lora_config_of(config)
    if lora is not None:
        _lora_base(model, config, manager.step_path(step))
        apply_lora(model, lora)
    state = {"model": lora_state_dict(model) if lora is not None else model.sharded_state_dict()}
    manager.load(state, step=step, include=("model",))
    model.eval()
    tokenizer = load_tokenizer(config.data.tokenizer, eod_token=config.data.eod_token)
    return model, config, tokenizer


def _lora_base(model, config, path) -> None:
    """A LoRA run's checkpoint holds adapters only: its frozen base is ``checkpoint.hf_init``
    or ``checkpoint.megatron_init`` again (the seed's init, rebuilt by ``build_model_chunks``,
    when the run had neither)."""
    c = config.checkpoint
    field, folder = ("hf_init", c.hf_init) if c.hf_init else ("megatron_init", c.megatron_init)
    if folder is None:
        return
    if not Path(folder).is_dir():
        raise CheckpointError(
            f"{path} holds LoRA adapters only and its base model, checkpoint.{field}="
            f"{folder!r}, is no longer there: restore that folder to load the adapters"
        )
    if field == "hf_init":
        import_hf_weights([model], folder)
    else:
        import_megatron_weights([model], folder)


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    context: int,
    generator: torch.Generator,
) -> str:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (stops at end-of-document).

    Temperature and top-k over the real vocabulary (padding rows excluded; temperature 0 is
    greedy, top-k 0 the whole vocabulary), the context cropped to the last ``context`` tokens,
    no KV cache: each new token re-runs the window, simple and fast enough for the small
    models this serves on a CPU. ``generator`` is what sampling draws from.
    """
    ids = tokenizer.encode(prompt) or [tokenizer.eod_id]
    vocab = model.config.vocab_size
    out: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]])
        logits = model(input_ids=window)[-1, 0, :vocab].float()  # [s, b, V_pad]
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < vocab:
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token == tokenizer.eod_id:
            break
        ids.append(token)
        out.append(token)
    return tokenizer.decode(out)
