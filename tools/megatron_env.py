"""Build, from nothing, the scratch Megatron-Core environment the fixture tools compare against.

Megatron-Core is a test oracle and benchmark peer for shardwork, never a dependency: it lives in
its own virtual environment beside the workspace's, made by this script and used only by the
development tools that write fixtures (``tools/moe_router_golden.py``,
``tools/megatron_checkpoint_fixture.py``, ``tools/fused_kernels_mcore_router_fixture.py``) and by
the Megatron side of ``benchmarks/moe_router.py``. Nothing under ``packages/`` imports it.

What it builds (megatron-core 0.19.2 declares Python >= 3.12, but its Python code runs on the
project's 3.11; see ``../shared/ENVIRONMENT.md``):

1. ``uv venv --seed`` with the project's Python (``.python-version``) at ``$SHARDWORK_MEGATRON_VENV``,
   default ``<repo>/.venv-megatron`` (git-ignored);
2. the workspace's locked torch, numpy and triton (``uv export`` of ``uv.lock``), plus
   ``packaging>=24.2``, ``einops`` and ``psutil`` (what megatron-core imports on the paths used
   here; ``psutil`` by its checkpoint writer's workers);
3. the megatron-core 0.19.2 wheel, downloaded for CPython 3.12 (its only wheel, tagged cp312
   because of a compiled dataset helper the tools never load), copied to a
   ``py3-none-any`` name and installed with ``--no-deps --ignore-requires-python``;
4. a ``.pth`` file putting the workspace's torch-only packages (``packages/*/src`` of
   parallel-state, fused-kernels, moe-router, dist-checkpoint) on the path, so a tool can run
   shardwork's code and Megatron's in one process;
5. a check that ``import megatron.core`` works, then a stamp file recording the versions.

Usage::

    uv run python tools/megatron_env.py            # build if needed, print the interpreter path
    uv run python tools/megatron_env.py --rebuild  # delete and build again

A tool that needs Megatron calls :func:`reexec_under_megatron` before importing it: run with
any interpreter (``uv run python tools/moe_router_golden.py``), it builds the environment if it
is missing and re-executes the tool with the environment's interpreter. Needs the network
(PyPI) the first time; later runs reuse it (torch comes from uv's cache, hard-linked).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_CORE_VERSION = "0.19.2"
# What megatron-core 0.19.2 imports on the router / GPT-model paths beyond torch and numpy.
EXTRA_REQUIREMENTS = ("packaging>=24.2", "einops", "psutil")
# Locked workspace packages installed at exactly the workspace's versions.
LOCKED_PACKAGES = ("torch", "numpy", "triton")
# Torch-only workspace packages made importable from source in the scratch environment.
SOURCE_PACKAGES = ("parallel-state", "fused-kernels", "moe-router", "dist-checkpoint")
STAMP_NAME = "shardwork-megatron-env.json"
# `uv run` names its own binary in $UV: the tool works where uv is not on PATH (a pipx or
# per-user install called by its full path).
UV = os.environ.get("UV", "uv")
_REEXEC_FLAG = "SHARDWORK_MEGATRON_REEXEC"


def default_venv() -> Path:
    """Where the environment lives: ``$SHARDWORK_MEGATRON_VENV`` or ``<repo>/.venv-megatron``."""
    return Path(os.environ.get("SHARDWORK_MEGATRON_VENV", ROOT / ".venv-megatron"))


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def locked_requirements(names: tuple[str, ...] = LOCKED_PACKAGES) -> list[str]:
    """Pinned requirement lines (with their markers) for ``names``, exported from ``uv.lock``.

    A package may be pinned once per Python range (numpy is); the installer keeps the line whose
    marker matches the environment's interpreter.
    """
    exported = subprocess.run(
        [UV, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-header",
         "--no-annotate"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    lines = [line for line in exported if line.split("==")[0] in names]
    missing = set(names) - {line.split("==")[0] for line in lines}
    if missing:
        raise SystemExit(f"uv.lock pins none of {sorted(missing)}: cannot match the workspace")
    return lines


def pure_python_wheel_name(wheel_name: str) -> str:
    """``name-version-<python>-<abi>-<platform>.whl`` renamed with the tags ``py3-none-any``."""
    parts = wheel_name[: -len(".whl")].split("-")
    if not wheel_name.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"{wheel_name!r} is not a wheel file name")
    return "-".join([*parts[:-3], "py3", "none", "any"]) + ".whl"


def _run(cmd: list[str | Path], **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def _install_megatron(python: Path) -> None:
    """Download megatron-core's cp312 wheel, rename it py3-none-any, install it without deps."""
    with tempfile.TemporaryDirectory() as tmp:
        download = Path(tmp, "download")
        _run(
            [python, "-m", "pip", "download", f"megatron-core=={MEGATRON_CORE_VERSION}",
             "--no-deps", "--python-version", "3.12", "--only-binary=:all:", "-d", download,
             "--quiet", "--disable-pip-version-check"]
        )  # fmt: skip
        (wheel,) = download.glob("*.whl")
        renamed = Path(tmp, pure_python_wheel_name(wheel.name))
        shutil.copy(wheel, renamed)
        _run(
            [python, "-m", "pip", "install", "--no-deps", "--ignore-requires-python", "--quiet",
             "--disable-pip-version-check", renamed]
        )  # fmt: skip


def build(venv: Path) -> Path:
    """Build the environment at ``venv`` from nothing; return its interpreter."""
    if venv.exists():
        shutil.rmtree(venv)
    python_version = (ROOT / ".python-version").read_text().strip()
    _run([UV, "venv", "--seed", "--quiet", "--python", python_version, venv])
    python = venv_python(venv)
    pins = locked_requirements()
    _run([UV, "pip", "install", "--quiet", "--python", python, *pins, *EXTRA_REQUIREMENTS])
    _install_megatron(python)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    sources = [str(ROOT / "packages" / p / "src") for p in SOURCE_PACKAGES]
    Path(site, "shardwork-workspace-sources.pth").write_text("\n".join(sources) + "\n")
    report = subprocess.run(
        [python, "-c", "import json, importlib.metadata as m, megatron.core, torch; "
         "print(json.dumps({'megatron_core': m.version('megatron-core'), 'torch': torch.__version__}))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    stamp = {**json.loads(report), "workspace": str(ROOT)}
    (venv / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"built {venv}: {stamp}", file=sys.stderr)
    return python


def ensure(venv: Path | None = None) -> Path:
    """The environment's interpreter, building the environment first if it is not complete."""
    venv = default_venv() if venv is None else venv
    stamp = venv / STAMP_NAME
    if stamp.exists() and venv_python(venv).exists():
        recorded = json.loads(stamp.read_text())
        if recorded.get("megatron_core") == MEGATRON_CORE_VERSION:
            return venv_python(venv)
    return build(venv)


def reexec_under_megatron() -> None:
    """Return if ``megatron.core`` is importable here; else re-run this program under the scratch
    environment's interpreter (built first when missing). Call before importing Megatron."""
    if importlib.util.find_spec("megatron") is not None:
        return
    if os.environ.get(_REEXEC_FLAG):
        raise SystemExit(f"megatron.core is not importable under {sys.executable}")
    python = ensure()
    os.environ[_REEXEC_FLAG] = "1"
    os.execv(python, [str(python), *sys.argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv", type=Path, default=None, help=f"where to build it (default: {default_venv()})"
    )
    parser.add_argument("--rebuild", action="store_true", help="delete and build again")
    args = parser.parse_args()
    venv = default_venv() if args.venv is None else args.venv
    print(build(venv) if args.rebuild else ensure(venv))


if __name__ == "__main__":
    main()
