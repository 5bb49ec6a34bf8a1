"""``TokenIds``: the tokenizer-facing ids a model's weights were trained with.

Beginning/end of sequence and padding ids change no arithmetic of the network, so they are
not ``GPTConfig`` fields (a config is the math; two checkpoints with the same math may use
different tokenizers). They travel with the model instead: ``GPTModel.token_ids``, which the
Hugging Face bridge fills from ``config.json`` (and ``generation_config.json``) on import and
writes back on export, so ``generate()`` on an exported model still stops at its EOS.

A model built from a preset has ``token_ids=None``: a preset is an architecture, and the ids
belong to the tokenizer a run trains it with (the trainer's ``data.tokenizer``), which need not
be the family's published one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TokenIds"]


@dataclass(frozen=True)
class TokenIds:
    """``bos`` / ``eos`` / ``pad`` token ids (None: the model has none); ``eos`` may be
    several ids, as Hugging Face allows (any of them ends generation).

    ``generation_config``: the ``generation_config.json`` a Hugging Face folder carried, kept
    verbatim so an export writes it back unchanged (None: there was none, and an export writes
    one holding these ids).
    """

    bos: int | None = None
    eos: int | tuple[int, ...] | None = None
    pad: int | None = None
    # a dict is unhashable: left out of the hash (still compared), so TokenIds stays hashable
    generation_config: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        eos = self.eos if isinstance(self.eos, tuple) else (self.eos,)
        for name, values in (("bos", (self.bos,)), ("eos", eos), ("pad", (self.pad,))):
            for v in values:
                # bool is an int subclass: True as a token id is a mistake, not id 1
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(
                        f"TokenIds.{name}={getattr(self, name)!r} is invalid: a token id is a "
                        "non-negative int (eos: an int or a tuple of them), or None"
                    )
