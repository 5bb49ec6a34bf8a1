"""Async save of CUDA tensors (needs a GPU): staging copies into pinned host buffers with
non-blocking copies, then waits for them, so the files equal a sync save's and the state
modified on the GPU right after `save` returns does not leak into the checkpoint."""

import json
import os

import pytest
import torch

from shardwork.dist_checkpoint import ShardedObject, ShardedTensor, StagingBuffers, load, save

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _state(device, fill):
    """A few MiB on ``device``: a full matrix, a column block (a strided view of a wider
    tensor), a bf16 table and two ZeRO-style flat ranges crossing rows, both views of one
    flat buffer; values from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(1024, 2048, generator=gen)
    wide = torch.randn(512, 1024, generator=gen)
    table = torch.randn(768, 512, generator=gen).to(torch.bfloat16)
    moment = torch.randn(300, 700, generator=gen)
    split = 123_457

    def put(t):
        t = t.to(device)
        return t if fill else torch.full_like(t, float("nan"))

    wide_dev = put(wide)
    flat = put(moment.flatten())
    return {
        "model": {
            "full": ShardedTensor.from_rank_offsets("full", put(full)),
            # columns 256:768 of the (512, 1024) tensor: a non-contiguous view
            "block": ShardedTensor.from_rank_offsets("block", wide_dev[:, 256:768]),
            "table": ShardedTensor.from_rank_offsets("table", put(table)),
        },
        "optimizer": {
            "moment": [
                ShardedTensor.from_flattened(
                    "moment",
                    flat[a:b],
                    local_shape=(300, 700),
                    global_shape=(300, 700),
                    global_offset=(0, 0),
                    flattened_range=(a, b),
                )
                for a, b in ((0, split), (split, moment.numel()))
            ],
        },
        "rng": ShardedObject("rng", {"seed": 11} if fill else None),
    }


def _tensors(state):
    return {
        "full": state["model"]["full"].data,
        "block": state["model"]["block"].data,
        "table": state["model"]["table"].data,
        "moment0": state["optimizer"]["moment"][0].data,
        "moment1": state["optimizer"]["moment"][1].data,
    }


def _data_files(path):
    with open(os.path.join(path, "shardwork.json")) as f:
        files = json.load(f)["files"]
    return {name: rec for name, rec in files.items() if name.endswith(".distcp")}


def _loaded(path):
    template = _state("cpu", fill=False)
    out = load(template, path)
    return {
        "full": out["model"]["full"],
        "block": out["model"]["block"],
        "table": out["model"]["table"],
        "moment0": out["optimizer"]["moment"][0],
        "moment1": out["optimizer"]["moment"][1],
    }


def test_async_save_of_cuda_tensors(tmp_path):
    state = _state("cuda", fill=True)
    before = {k: v.cpu().clone() for k, v in _tensors(state).items()}
    save(state, tmp_path / "sync")

    buffers = StagingBuffers()
    # keep the GPU busy so the device-to-host copies are still queued when staging starts:
    # returning before they completed would let the writer read unfilled host buffers
    torch.cuda._sleep(200_000_000)
    handle = save(state, tmp_path / "async", async_save=True, staging_buffers=buffers)
    # the training step right after save returns, on the GPU
    for tensor in _tensors(state).values():
        tensor.add_(1000)
    modified = {k: v.cpu().clone() for k, v in _tensors(state).items()}
    handle.finalize()

    assert buffers.tensors() and all(
        b.is_pinned() and b.device.type == "cpu" for b in buffers.tensors()
    )
    assert _data_files(tmp_path / "async") == _data_files(tmp_path / "sync")
    for name, value in _loaded(tmp_path / "async").items():
        assert torch.equal(value, before[name]), name

    # the next async save restages into the same pinned buffers: the modified state
    torch.cuda._sleep(200_000_000)
    again = save(
        state, tmp_path / "async2", async_save=True, staging_buffers=buffers, previous=handle
    )
    for tensor in _tensors(state).values():
        tensor.mul_(0)
    again.finalize()
    for name, value in _loaded(tmp_path / "async2").items():
        assert torch.equal(value, modified[name]), name
