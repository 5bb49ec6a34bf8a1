"""Write the committed checkpoint that later readers must keep loading (development aid).

Run from the repository root with the package version whose format the fixture pins:

    uv run python tools/dist_checkpoint_v1_fixture.py packages/dist-checkpoint/tests/fixtures/v1

It saves `shardwork.dist_checkpoint.testing.example_state` (seed 11, one rank): a row-sharded
matrix, a replicated vector, a flat optimizer moment, a per-rank object and a plain value,
and writes the global tensors it saved to `<target>_values.pt` (plain `torch.save`). A test
loads the checkpoint into a fresh template and compares with those values, so any change to
the reader that stops old checkpoints from loading fails there. (The committed `v1_values.pt`
was written later, from `example_global(11)` of the version that wrote `v1`: float32 normal
draws of an AVX2 CPU.)
"""

import shutil
import sys
from pathlib import Path

import torch

from shardwork.dist_checkpoint import save
from shardwork.dist_checkpoint.testing import example_global, example_state

SEED = 11


def main(target: str) -> None:
    path = Path(target)
    if path.exists():
        shutil.rmtree(path)
    save(example_state(0, 1, seed=SEED), path)
    torch.save(example_global(SEED), path.with_name(path.name + "_values.pt"))
    print(f"wrote {path}: {sorted(p.name for p in path.iterdir())}")


if __name__ == "__main__":
    main(sys.argv[1])
