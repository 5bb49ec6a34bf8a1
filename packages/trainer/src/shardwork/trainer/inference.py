"""Rebuild a trained model from its checkpoint on one CPU process, and sample text from it.

What ``shardwork-generate`` runs once it has parsed its flags (:mod:`.generate` keeps torch
out of its own imports, so this module is imported after OpenMP's wait policy is set). The
checkpoint carries the run's resolved config, so model and tokenizer are rebuilt exactly; the
model section loads through ``CheckpointManager`` at world size 1 (any training layout
reshards), verifying each file it reads against its recorded CRC-32. A LoRA run's checkpoint
holds the adapters only: the base is rebuilt from its ``checkpoint.hf_init`` folder (or the
seed) and the adapters are loaded onto it.

The tokenizer is loaded before the model is built: the run's ``data.tokenizer`` as stored (a
relative path is read from the current folder), or the ``tokenizer`` argument instead, whose
vocabulary must match the model's; a tokenizer that cannot be loaded is a :class:`UserError`
that names it and the way out (``shardwork-generate --tokenizer PATH``). :func:`sample` hands
the text to a callback as it grows, so a long generation shows its tokens as they come.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

import torch

from shardwork.dist_checkpoint import CheckpointManager, read_info
from shardwork.models.lora import apply_lora, lora_state_dict
from shardwork.parallel_state import ProcessGroups
from shardwork.trainer.config.load import config_from_dict
from shardwork.trainer.config.validate import check_model_settings
from shardwork.trainer.config.validate_peft import lora_config_of
from shardwork.trainer.data.tokenizer import load_tokenizer
from shardwork.trainer.errors import CheckpointError, UserError
from shardwork.trainer.model_factory import build_model_chunks, gpt_config
from shardwork.trainer.run.checkpoint_choice import named_candidates
from shardwork.trainer.run.checkpointing import no_checkpoint_reason
from shardwork.trainer.run.hf import import_hf_weights
from shardwork.trainer.run.megatron import import_megatron_weights


def load_for_inference(checkpoint: str | Path, *, tokenizer: str | None = None):
    """``(model, train_config, tokenizer)`` rebuilt from a checkpoint on one CPU process.

    ``tokenizer`` ('byte' or a tokenizer JSON path) replaces the run's stored one, e.g. when
    that file moved; either is loaded before the model is built."""
    manager, step, config, hf = _read_run(checkpoint)
    model_config = single_process_config(gpt_config(config, hf=hf))
    tok = _run_tokenizer(config, model_config.vocab_size, tokenizer, manager.step_path(step))
    groups = ProcessGroups.single()
    (model,) = build_model_chunks(model_config, groups, device=torch.device("cpu"))
    lora = lora_config_of(config)
    if lora is not None:
        _lora_base(model, config, manager.step_path(step))
        apply_lora(model, lora)
    state = {"model": lora_state_dict(model) if lora is not None else model.sharded_state_dict()}
    manager.load(state, step=step, include=("model",))
    model.eval()
    return model, config, tok


def single_process_config(model_config):
    """``model_config`` for one process: a run trained with tensor parallelism and
    ``parallel.sequence_parallel`` stores that setting, which needs tp > 1; at tp = 1 sequence
    parallelism changes nothing, so it is turned off (the weights load the same)."""
    return model_config.replace(sequence_parallel=False)


def _read_run(checkpoint: str | Path):
    """``(manager, step, train_config, hf_config)`` of the checkpoint ``checkpoint`` names (its
    metadata only; CheckpointError when there is none or it lacks a usable config)."""
    candidates = named_candidates(checkpoint)
    if not candidates.steps:
        reason = no_checkpoint_reason(checkpoint)
        raise CheckpointError(f"CHECKPOINT={str(checkpoint)!r}: {reason}")
    manager, step = CheckpointManager(candidates.root), candidates.steps[-1]
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
    return manager, step, config, hf


def _run_tokenizer(config, vocab_size: int, override: str | None, where: Path):
    """The run's tokenizer, or ``override`` whose vocabulary must equal the model's
    ``vocab_size``; a tokenizer that cannot be loaded is a UserError naming it and the
    ``--tokenizer`` way out (a run given a relative path, generated from another folder)."""
    saved = config.data.tokenizer
    spec = saved if override is None else override
    try:
        tokenizer = load_tokenizer(spec, eod_token=config.data.eod_token)
    except (ImportError, ValueError, OSError) as exc:
        if override is not None:
            raise UserError(
                f"--tokenizer={override!r}: {exc}; valid: 'byte' or a tokenizer JSON file "
                f"with the model's {vocab_size} ids"
            ) from None
        missing = spec != "byte" and not Path(spec).expanduser().is_file()
        # an absolute path names the same file from every folder: it was moved or deleted
        gone = missing and Path(spec).expanduser().is_absolute()
        if gone:
            why, remedy = "no longer exists (moved or deleted)", "restore that file"
        elif missing:
            why, remedy = (
                f"is not found from here ({Path.cwd()})",
                ("run from the folder the training ran in"),
            )
        else:
            why, remedy = f"does not load ({exc})", "run from the folder the training ran in"
        raise UserError(
            f"{where}: the checkpoint's run used tokenizer data.tokenizer={saved!r}, which "
            f"{why}; valid: {remedy}, or pass --tokenizer PATH (that tokenizer's JSON file, "
            f"{vocab_size} ids)"
        ) from None
    if override is not None and tokenizer.vocab_size != vocab_size:
        raise UserError(
            f"--tokenizer={override!r} has {tokenizer.vocab_size} ids but the checkpoint's model "
            f"has a vocabulary of {vocab_size} (its run used data.tokenizer={saved!r}); valid: "
            f"the tokenizer the run trained with ({vocab_size} ids)"
        )
    return tokenizer


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
    on_text: Callable[[str], None] | None = None,
) -> str:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (stops at end-of-document).

    Temperature and top-k over the real vocabulary (padding rows excluded; temperature 0 is
    greedy, top-k 0 the whole vocabulary), the context cropped to the last ``context`` tokens,
    no KV cache: each new token re-runs the window, simple and fast enough for the small
    models this serves on a CPU. ``generator`` is what sampling draws from. ``on_text``, when
    given, receives the text as it grows, in pieces that join to the returned text (for
    decoders that only extend their text, as the byte and BPE ones do); a piece
    waits while the text ends in an incomplete character (a byte tokenizer's partial UTF-8).
    """
    ids = tokenizer.encode(prompt) or [tokenizer.eod_id]
    vocab = model.config.vocab_size
    out: list[int] = []
    shown = ""
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
        if on_text is not None:
            shown = _show(tokenizer.decode(out).rstrip("\ufffd"), shown, on_text)
    text = tokenizer.decode(out)
    if on_text is not None:
        _show(text, shown, on_text)
    return text


def _show(text: str, shown: str, on_text: Callable[[str], None]) -> str:
    """Pass what ``text`` adds to ``shown`` (already passed) to ``on_text``; return what has
    been passed. A text that does not extend ``shown`` (a decoder that rewrote earlier text)
    waits for a later one that does."""
    if len(text) > len(shown) and text.startswith(shown):
        on_text(text[len(shown) :])
        return text
    return shown
