"""Which ranks read data: only the first and last pipeline stages open the dataset files.

A middle stage receives activations and sends gradients; it needs the step's batch size (from
the schedule) and the evaluation's micro-batch count (broadcast from the first stage, tested
in test_multirank.py), never a sample. Here the data set-up of one rank is run for the
first, a middle and the last stage of a 3-stage pipeline with ``open`` spied on.
"""

import builtins
import io
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from shardwork.trainer.run.trainer import _datasets, _train_set_for, reads_data
from shardwork.trainer.testing import tiny_config


@dataclass
class PipelineRank:
    """The part of ProcessGroups the data set-up asks: stage position and dp size."""

    stage: int
    stages: int = 3

    @property
    def is_first_pp_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.stage == self.stages - 1

    def size(self, name: str) -> int:
        return 1


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["first", "middle", "last"])
def test_only_first_and_last_stages_open_the_data(tmp_path_factory, monkeypatch, stage):
    cache = str(tmp_path_factory.getbasetemp() / "corpus")
    tmp_path = tmp_path_factory.mktemp("run")
    monkeypatch.setenv("SHARDWORK_CACHE", cache)
    config = tiny_config(tmp_path / "run", eval={"steps": None})
    from shardwork.trainer.data.builder import split_components

    split_components(config.data)  # the corpus is built (by whichever rank comes first)

    opened = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike) and os.fspath(file).startswith(cache):
            opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)  # pathlib opens through io.open
    rank = PipelineRank(stage)
    comps, valid_set, eval_micro = _datasets(config, rank)
    fresh = SimpleNamespace(data_offset=0, sample_order="blocks")  # a run that resumes nothing
    train_set = _train_set_for(config, comps, rank, fresh)
    if stage == 1:
        assert not reads_data(rank)
        assert opened == []
        assert (train_set, valid_set, eval_micro) == (None, None, 0)
        assert all(not parts for parts in comps.values())
    else:
        assert reads_data(rank)
        assert {os.path.splitext(p)[1] for p in opened} == {".idx", ".bin"}
        assert len(train_set) == 40 * 8  # every sample of the run: steps × global batch
        # the whole validation split in whole global batches of 8, as micro-batches of 4:
        # what the middle stage is sent
        assert eval_micro == len(valid_set) // 8 * 8 // 4 > 0
