"""The README's example runs as written on one process, and what it says holds: a committed
checkpoint under ``ckpts/`` whose tensors read back (with plain DCP too) as saved, and a load
at another layout (a dp = 2 rank's half of the ZeRO moment) that gives exactly that half."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    """The README's first Python block."""
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_readme_example_saves_reshards_and_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {"__name__": "readme"}
    exec(compile(_example(), str(README), "exec"), scope)
    state, loaded, model_only = scope["state"], scope["loaded"], scope["model_only"]
    step = tmp_path / "ckpts" / "step_000000100"
    assert (step / "COMMITTED").is_file()  # committed by finalize(), not left half-written
    # plain DCP reads the same files (keys as the README names them): the weight, and the
    # moment in its global coordinates (the flat range of an 8 x 4 rectangle)
    weight, moment = torch.empty(8, 4), torch.empty(8, 4)
    plain = {"fc1.weight": weight, "optimizer.exp_avg.fc1.weight": moment}
    dcp_load(plain, storage_reader=FileSystemReader(str(step)))
    assert torch.equal(weight, state["model"]["fc1.weight"].data)
    assert torch.equal(moment.reshape(-1), state["optimizer"]["exp_avg"].data)
    # the dp = 2 rank 1 template got the second half of the flat moment, and the model alone
    assert torch.equal(loaded["optimizer"]["exp_avg"], moment.reshape(-1)[16:])
    assert loaded["optimizer"]["step"] == 100
    assert torch.equal(model_only["model"]["fc1.weight"], weight)
