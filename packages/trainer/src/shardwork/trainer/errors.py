"""Mistakes a user can fix, their exit codes, and how the CLIs report them.

A :class:`UserError` is raised for bad input (an option, a config value, a data file, a
path): the CLIs print its message as one paragraph, without a traceback, and exit with its
``exit_code``. Anything else is an internal error and keeps Python's traceback (exit 1), so a
bug is never disguised as a user mistake.

Exit codes of ``shardwork-train``, ``-generate`` and ``-preprocess`` (docs/trainer.md,
"Reliability"):

- 0: success (also a run stopped cleanly by a signal)
- 1: internal error (a Python traceback: please report it)
- 2: usage or configuration error (an option, a value, its type, the layout, a path)
- 3: training stopped on a non-finite loss (``reliability.on_nan``)
- 4: checkpoint error (nothing complete to resume, a missing/truncated/corrupt file)
- 5: data error (a dataset file truncated or inconsistent; ids past the vocabulary; a broken
  input line); a data path that does not exist is a usage error (2)
- 6: a collective lost its peer rank or outlived ``parallel.timeout_minutes`` (the rank that
  failed prints which rank, step, phase and groups; the last committed checkpoint stays)
- 130: a second Ctrl-C during training (one line, no traceback)
"""

from __future__ import annotations

import json
import os
import sys
import time

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_NON_FINITE = 3
EXIT_CHECKPOINT = 4
EXIT_DATA = 5
EXIT_COLLECTIVE = 6
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Bad input the user can correct; the message names the option or file, the value and
    what would be valid."""

    exit_code = EXIT_USAGE


class CheckpointError(UserError, ValueError):
    """A checkpoint path holds no complete checkpoint, or one this command cannot use."""

    exit_code = EXIT_CHECKPOINT


class DataError(UserError, ValueError):
    """A data file is missing, truncated or inconsistent, or holds ids the model cannot embed."""

    exit_code = EXIT_DATA


def is_reporting_rank() -> bool:
    """Whether this process prints a mistake it found: rank 0 of a torchrun job (every rank
    finds the same mistake before any process group exists, and one of them reports it), and
    any process that torchrun did not start (ranks started by hand each have their own
    terminal, and rank 0 may not exist) or whose ``RANK`` is not a number."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return True
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def report(prog: str, message: str, exit_code: int) -> int:
    """Print ``prog: message`` on stderr (on the reporting rank only) and return ``exit_code``.

    Under torchrun every rank also writes the message to its error file: torchrun stops the
    other ranks as soon as one exits (possibly before rank 0 has printed) and then shows the
    first failed rank's error file in its closing summary, so the message is what it ends with.
    """
    text = f"{prog}: {message}"
    if is_reporting_rank():
        print(text, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": text, "timestamp": int(time.time())}, f)
    return exit_code
