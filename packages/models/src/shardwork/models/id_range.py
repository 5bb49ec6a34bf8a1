"""Checks of the token ids a model is given: ``input_ids`` and ``labels`` (values, shape, dtype).

An id at or above ``vocab_size`` is a tokenizer/config mismatch that must not train silently:
below the padded vocabulary it would read (and train) a padding row of the embedding, and a
label there would score a logit no real token has. The shape and dtype checks are free; the
range check reads the values, so it runs exactly on CPU tensors and as a device-side assert
elsewhere, or while ``torch.compile`` traces the caller (``torch._assert_async``: no host
synchronisation in the step and no graph break).
"""

from __future__ import annotations

import torch

__all__ = ["check_token_ids"]


def check_token_ids(
    name: str, ids: torch.Tensor, vocab_size: int, *, ignore_index: int | None = None
) -> None:
    """Raise ``ValueError`` unless ``ids`` is a 2-D ``[b, s]`` integer tensor whose values are
    in ``[0, vocab_size)`` (or equal ``ignore_index``, for labels)."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name}.dtype={ids.dtype} is invalid: token ids must be an integer dtype")
    if ids.dim() != 2:
        raise ValueError(
            f"{name}.shape={tuple(ids.shape)} is invalid: it must be [batch, sequence] (2-D); "
            "add a batch dimension with ids.unsqueeze(0)"
        )
    valid = (ids >= 0) & (ids < vocab_size)
    if ignore_index is not None:
        valid |= ids == ignore_index
    allowed = f"[0, {vocab_size})" + ("" if ignore_index is None else f" or {ignore_index}")
    if ids.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(valid.all(), f"{name} holds an id outside {allowed}")
        return
    if bool(valid.all()):
        return
    row, col = (int(i) for i in (~valid).nonzero()[0])
    raise ValueError(
        f"{name}[{row}, {col}]={int(ids[row, col])} is invalid: ids must be in {allowed} "
        f"(vocab_size={vocab_size}); is the tokenizer the model's?"
    )
