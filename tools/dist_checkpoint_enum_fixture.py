"""Write the committed checkpoint whose DCP metadata pickles enum members by name (development aid).

CPython versions differ in how ``pickle`` records an enum member: by value (``Enum(value)``;
CPython 3.11.7, for one) or by name (``getattr(Enum, name)``; CPython 3.11.2, Debian 12's
``python3``). DCP's ``.metadata`` holds one such member per tensor (its memory format), so a
reader that allowed only the first form refused every checkpoint written under the second.
This script writes the fixture the test for the second form loads; it must run under a Python
that pickles by name, and refuses to run elsewhere:

    export UV_PROJECT_ENVIRONMENT=/tmp/env-3112   # Debian 12's python3 is CPython 3.11.2
    uv sync --locked --python /usr/bin/python3.11
    uv run --python /usr/bin/python3.11 python tools/dist_checkpoint_enum_fixture.py \
        packages/dist-checkpoint/tests/fixtures/enum_by_name

It saves `shardwork.dist_checkpoint.testing.example_state` (seed 13, one rank); the test loads
it into a fresh template and compares with `example_global(13)` (float64 draws rounded to
float32: the same on every CPU).
"""

import pickle
import pickletools
import platform
import shutil
import sys
from pathlib import Path

from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from shardwork.dist_checkpoint import save
from shardwork.dist_checkpoint.testing import example_state

SEED = 13


def pickles_enum_by_name() -> bool:
    """Whether this Python pickles an enum member as ``getattr(Enum, name)``."""
    raw = pickle.dumps(_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT)
    return any(arg == "getattr" for _, arg, _ in pickletools.genops(raw))


def main(target: str) -> None:
    if not pickles_enum_by_name():
        sys.exit(
            f"Python {platform.python_version()} pickles enum members by value; run this under "
            "one that pickles them by name (e.g. CPython 3.11.2)"
        )
    path = Path(target)
    if path.exists():
        shutil.rmtree(path)
    save(example_state(0, 1, seed=SEED), path)
    print(f"wrote {path} with Python {platform.python_version()}")


if __name__ == "__main__":
    main(sys.argv[1])
