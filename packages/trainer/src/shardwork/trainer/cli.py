"""``shardwork-train`` (also ``python -m shardwork.trainer``, e.g. under torchrun).

Parses and validates the whole configuration, then runs the preflight checks
(:mod:`.run.preflight`: directories, free space, data files, ``eval.steps``), all before any
process group is created. A user mistake ends with one paragraph on stderr (from rank 0 only)
and the exit code of :mod:`.errors`: 2 for an option, value or path, 3 for a non-finite loss
that stops the run, 4 for a checkpoint that cannot be resumed (reported before the run
directory is written), 5 for a data file, 6 for a collective that lost its peer rank or outlived
``parallel.timeout_minutes`` (one paragraph naming the rank, phase and groups; the last
committed checkpoint stays), 130 for a second Ctrl-C during training (one line). Internal
errors keep their traceback (exit 1).

Torch-free at import: this module and its top-level imports never load torch. Everything that
does (validation, preflight, the run) is imported inside :func:`train_main` after
:func:`set_cpu_runtime_env`, because OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads it;
flags are parsed before any of it, so ``--help`` and flag errors take 0.3 s instead of the
6.2 s that importing the run costs (shared 2-core machine, load ~11).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shardwork.trainer.config.cli import parse_train_args
from shardwork.trainer.config.load import config_to_toml
from shardwork.trainer.cpu_runtime import set_cpu_runtime_env
from shardwork.trainer.errors import (
    EXIT_CHECKPOINT,
    EXIT_COLLECTIVE,
    EXIT_INTERRUPTED,
    EXIT_NON_FINITE,
    UserError,
    is_reporting_rank,
    report,
)

PROG = "shardwork-train"


def _checked_config(argv: list[str]):
    """``(resolved config, print_config)``, validated and, unless only printing, preflighted;
    raises a UserError (ConfigError, DataError) for a mistake."""
    config, print_config = parse_train_args(argv)  # --help and flag errors exit here
    # deferred import: torch loads here, after train_main set OpenMP's wait policy (docstring)
    from shardwork.trainer.config.launch_env import launch_world_size
    from shardwork.trainer.config.validate import validate_config
    from shardwork.trainer.run.preflight import preflight

    world_size = launch_world_size()
    resolved = validate_config(config, world_size=world_size)
    if not print_config:
        for warning in preflight(resolved):
            if is_reporting_rank():
                print(f"{PROG}: {warning}", file=sys.stderr, flush=True)
    return resolved, print_config


def interrupted_message(config) -> str:
    """What a SIGINT that ended the run means: a second one while stopping, or, with
    ``checkpoint.save_on_signal`` off, the first (nothing catches it to stop cleanly)."""
    if config.checkpoint.save_on_signal:
        cause = "interrupted by a second SIGINT"
    else:
        cause = (
            "interrupted by SIGINT (checkpoint.save_on_signal=false: a signal stops the run "
            "without saving; true finishes the step and saves)"
        )
    return f"{cause}; no checkpoint was written for the current step (the last committed one stays)"


def train_main(argv: Sequence[str] | None = None) -> int:
    set_cpu_runtime_env()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        resolved, print_config = _checked_config(argv)
    except UserError as exc:
        return report(PROG, str(exc), exc.exit_code)
    if print_config:
        if is_reporting_rank():
            print(config_to_toml(resolved), end="")
        return 0
    # deferred import: the run's modules (torch), imported once the flags are valid
    from shardwork.dist_checkpoint import CheckpointCorruptError, UnsupportedFormatError
    from shardwork.trainer.run.checkpointing import ResumeError
    from shardwork.trainer.run.collectives import CollectiveError
    from shardwork.trainer.run.trainer import NonFiniteLossError, train

    try:
        train(resolved)
    except NonFiniteLossError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_NON_FINITE
    except (CheckpointCorruptError, UnsupportedFormatError, ResumeError) as exc:
        # Raised while resuming, before the run directory is written: nothing to clean up.
        return report(PROG, f"cannot resume: {exc}", EXIT_CHECKPOINT)
    except CollectiveError as exc:
        # printed by the rank that failed: the peer it lost may be rank 0
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_COLLECTIVE
    except KeyboardInterrupt:
        # out at once, as asked, but without a traceback
        print(f"{PROG}: {interrupted_message(resolved)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UserError as exc:
        return report(PROG, str(exc), exc.exit_code)
    return 0
