"""``shardwork-train --help``, flag errors and reading a config file never load torch.

torch takes ~6 s to import on a loaded 2-core machine; the CLI parses flags and files first so
that help and user mistakes answer in a fraction of that (cli.py's docstring), and OpenMP's
wait policy is set before torch loads. Each case runs in a fresh interpreter and reports
whether ``torch`` ended up in ``sys.modules``.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

OLD_CONFIG = Path(__file__).with_name("fixtures") / "checkpoint_v0" / "old.toml"


def _torch_loaded_after(code: str) -> bool:
    probe = textwrap.dedent(code) + "\nimport sys\nprint('torch' in sys.modules)\n"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize(
    "code",
    [
        # --help exits through argparse/tyro before any run module is imported
        """
        from shardwork.trainer.cli import train_main
        try:
            train_main(["--help"])
        except SystemExit:
            pass
        """,
        # a misspelt flag is a usage error (exit 2) reported without the run's modules
        """
        from shardwork.trainer.cli import train_main
        try:
            train_main(["--schedule.trian_steps", "5"])
        except SystemExit:
            pass
        """,
        # a config file in the old format (converted with a notice) and nested model flags
        f"""
        from shardwork.trainer.config.cli import parse_train_args
        config, _ = parse_train_args(
            ["--config", {str(OLD_CONFIG)!r}, "--model.moe.router.top_k", "4"]
        )
        assert config.model.settings["moe"]["router"]["top_k"] == 4
        """,
    ],
    ids=["help", "flag-error", "config-and-model-flags"],
)
def test_cli_parsing_does_not_import_torch(code):
    assert not _torch_loaded_after(code)


def test_the_probe_sees_torch_when_it_is_imported():
    """The check itself can fail: validating a config does load torch."""
    assert _torch_loaded_after(
        """
        from shardwork.trainer.config.sections import TrainConfig
        from shardwork.trainer.config.validate import validate_config
        """
    )
