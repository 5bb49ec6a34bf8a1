"""``shardwork-generate CHECKPOINT --prompt TEXT``: sample text from a trained checkpoint.

- The checkpoint carries the run's resolved config (in its metadata), so the
  model and tokenizer are rebuilt exactly; the model section is loaded
  through CheckpointManager at world size 1 (checkpoints reshard from any
  training layout). The load verifies every file it reads against its recorded CRC-32;
  a corrupt checkpoint exits with status 4 and one message naming the file (so does a
  directory with no complete checkpoint; a bad argument or a path that is no directory: 2).
- Sampling: temperature and top-k over the real vocabulary (padding rows
  excluded), the context cropped to the training sequence length, no KV
  cache (each new token re-runs the window: simple, and fast enough for the
  small models this is meant for on a CPU).
- Arguments are checked before the model is loaded (``--max_new_tokens`` >= 1,
  ``--temperature`` >= 0 with 0 meaning greedy, ``--top_k`` >= 0 with 0 meaning the whole
  vocabulary, a ``--prompt`` that is valid UTF-8, an existing CHECKPOINT path and
  ``--tokenizer`` file), and so are the shardwork environment variables, with the same check
  as ``shardwork-train`` (``SHARDWORK_KERNEL_BACKEND``, ``SHARDWORK_CPU_GEMM``): a mistake exits
  with 2, a path without a usable checkpoint with 4, each with one paragraph and no traceback
  (:mod:`.errors`).
- The run's tokenizer is read from its stored ``data.tokenizer`` (a relative path from the
  current folder); when that file is not found from here the message says so, and
  ``--tokenizer PATH`` gives it (its vocabulary must match the model's).
- The text is printed as it is generated (the prompt first), so a long ``--max_new_tokens``
  shows progress; Ctrl-C stops it with exit 130 and no traceback.
- Like ``shardwork-train``, the command lets idle OpenMP threads sleep (set before torch is
  imported): on a shared 2-core machine spinning threads made a run 3x slower (30.7 s vs
  10.9 s measured for 80 tokens from the demo checkpoint). So this module and its top-level
  imports never load torch: the model loading and sampling live in :mod:`.inference`, which
  :func:`main` imports after it set the policy and parsed the flags.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from shardwork.trainer.cpu_runtime import set_cpu_runtime_env
from shardwork.trainer.errors import EXIT_INTERRUPTED, CheckpointError, UserError, report


@dataclass(kw_only=True)
class GenerateArgs:
    """Sample text from a shardwork checkpoint. Exit codes: 0 ok, 1 internal error, 2 usage
    error, 4 no usable checkpoint."""

    checkpoint: tyro.conf.Positional[str]
    """A checkpoint directory (RUN_DIR/checkpoints/step_*) or a checkpoint root (latest is used)."""
    prompt: str = "The "
    """Text to continue."""
    max_new_tokens: int = 200
    """Tokens to generate (>= 1; fewer when the model ends the document)."""
    temperature: float = 0.8
    """Softmax temperature (>= 0); 0 picks the most likely token (greedy)."""
    top_k: int = 40
    """Sample among the k most likely tokens (>= 0); 0: the whole vocabulary."""
    seed: int = 0
    """Sampling seed."""
    tokenizer: str | None = None
    """'byte' or a tokenizer JSON file replacing the run's stored one (e.g. when that file has
    moved); its vocabulary must match the model's. Default: the run's data.tokenizer."""


def check_args(args: GenerateArgs) -> None:
    """Refuse out-of-range arguments (UserError naming the option, the value and the valid
    range) before anything is loaded."""
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"--max_new_tokens={args.max_new_tokens}: must be an integer >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        problems.append(
            f"--temperature={args.temperature}: must be a finite number >= 0 (0: greedy)"
        )
    if args.top_k < 0:
        problems.append(f"--top_k={args.top_k}: must be an integer >= 0 (0: whole vocabulary)")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes Python could not decode (surrogate escapes)
        byte = ord(args.prompt[exc.start]) - 0xDC00
        problems.append(
            f"--prompt: not valid UTF-8 (byte 0x{byte:02x} at character {exc.start}); valid: "
            "UTF-8 text (check the terminal's or the locale's encoding)"
        )
    if args.tokenizer not in (None, "byte") and not Path(args.tokenizer).expanduser().is_file():
        problems.append(
            f"--tokenizer={args.tokenizer!r}: no such file; valid: 'byte' or a tokenizer JSON file"
        )
    if not Path(args.checkpoint).is_dir():
        problems.append(
            f"CHECKPOINT={args.checkpoint!r}: no such directory; valid: a checkpoint "
            "(RUN_DIR/checkpoints/step_*) or a checkpoint root (RUN_DIR/checkpoints)"
        )
    if problems:
        raise UserError("; ".join(problems))


def check_generate_environment() -> None:
    """The environment check ``shardwork-train`` runs (kernel backend, CPU product library),
    so a bad value is refused before the model loads rather than mid-sampling. Imports torch:
    call it after :func:`set_cpu_runtime_env`."""
    # deferred import: torch loads here, after set_cpu_runtime_env set OpenMP's wait policy
    from shardwork.trainer.config.validate import check_environment

    problems: list[str] = []
    check_environment(problems)
    if problems:
        raise UserError("; ".join(problems))


def _corrupt_remedy(exc) -> str:
    """A corrupt checkpoint's message and what to do: the other checkpoints beside it may be
    intact, and ``shardwork-ckpt verify`` on their folder says which."""
    if exc.checkpoint is None:
        return str(exc)
    root = Path(exc.checkpoint).parent
    return (
        f"{exc}; `shardwork-ckpt verify {root}` lists which checkpoints there are intact: pass "
        "one of those step_* folders as CHECKPOINT"
    )


def main(argv: list[str] | None = None) -> int:
    set_cpu_runtime_env()
    args = tyro.cli(  # --help and flag errors exit here, before torch loads
        GenerateArgs,
        args=sys.argv[1:] if argv is None else argv,
        use_underscores=True,
        prog="shardwork-generate",
    )
    # deferred import: torch loads here, after set_cpu_runtime_env set OpenMP's wait policy
    import torch

    from shardwork.dist_checkpoint import (
        CheckpointCorruptError,
        IncompleteCheckpointError,
        UnsupportedFormatError,
    )
    from shardwork.trainer.inference import load_for_inference, sample

    try:
        check_args(args)
        check_generate_environment()
        model, config, tokenizer = load_for_inference(args.checkpoint, tokenizer=args.tokenizer)
    except UserError as exc:
        return report("shardwork-generate", str(exc), exc.exit_code)
    except CheckpointCorruptError as exc:
        return report("shardwork-generate", _corrupt_remedy(exc), CheckpointError.exit_code)
    except (IncompleteCheckpointError, UnsupportedFormatError) as exc:
        return report("shardwork-generate", str(exc), CheckpointError.exit_code)
    generator = torch.Generator().manual_seed(args.seed)
    print(args.prompt, end="", flush=True)
    try:
        sample(
            model,
            tokenizer,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            context=config.data.seq_length,
            generator=generator,
            on_text=lambda piece: print(piece, end="", flush=True),
        )
    except KeyboardInterrupt:
        print(flush=True)
        return report("shardwork-generate", "interrupted (Ctrl-C)", EXIT_INTERRUPTED)
    print(flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
