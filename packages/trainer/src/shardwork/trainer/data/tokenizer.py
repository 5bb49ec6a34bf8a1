"""Tokenizers: a built-in byte-level one and a Hugging Face ``tokenizers`` JSON file.

- :class:`ByteTokenizer` needs nothing: ids 0–255 are the UTF-8 bytes, 256 is
  the end-of-document token appended after each document. Decoding replaces
  invalid UTF-8 (a sampled byte sequence may cut a character).
- :class:`HFTokenizer` wraps ``tokenizers.Tokenizer.from_file`` (the optional
  ``tokenizers`` extra); its end-of-document token is the first of
  ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>`` present in the
  vocabulary, or the one named explicitly.
- :func:`load_tokenizer` resolves the config string ``"byte"`` or a path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_of(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id``, as ``eod_token`` names one; None for a
        tokenizer without named entries (byte)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0–255 plus an end-of-document id 256 (vocabulary of 257)."""

    vocab_size = 257
    eod_id = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_of(self, token_id: int) -> str | None:
        return None  # bytes, and a fixed end-of-document id: nothing eod_token could name


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (e.g. a trained BPE's ``tokenizer.json``)."""

    def __init__(self, path: str | Path, *, eod_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizerImpl
        except ImportError as exc:  # optional extra
            raise ImportError(
                "a tokenizer JSON needs the `tokenizers` package: install "
                "shardwork-trainer[tokenizers] or use data.tokenizer='byte'"
            ) from exc
        try:
            self._tok = HFTokenizerImpl.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(
                f"tokenizer {path}: not a readable Hugging Face tokenizer JSON file ({reason})"
            ) from exc
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eod_token,) if eod_token else _EOD_CANDIDATES
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                self.eod_id = token_id
                break
        else:
            raise ValueError(
                f"tokenizer {path}: no end-of-document token among {list(candidates)}; "
                "name one with eod_token"
            )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_of(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def load_tokenizer(spec: str, *, eod_token: str | None = None) -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; a path to a ``tokenizer.json`` -> :class:`HFTokenizer`."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"data.tokenizer={spec!r} is invalid: use 'byte' or the path of an existing "
            "Hugging Face tokenizer JSON file"
        )
    return HFTokenizer(path, eod_token=eod_token)
