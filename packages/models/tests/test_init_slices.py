"""Layout-free initialisation draws only the local slice.

- ``normal_slice`` of any piece of a key (cut along its split axis, across block boundaries or not)
  equals that piece of the whole tensor's draw, and draws at most two blocks beyond it.
- A meta-built stage materialised for any rank of a tp/ep/etp layout (no processes, via
  ``layout_groups``) holds exactly the world-1 model's values in its slices, while drawing
  far fewer normal values than the global model holds.
"""

from __future__ import annotations

import hashlib
from unittest import mock

import pytest
import torch

from shardwork.models import GPTModel, layout_groups, preset
from shardwork.models.families.twins import tiny_moe
from shardwork.models.sharding import (
    INIT_BLOCK,
    ShardContext,
    UniformInit,
    describe_param,
    init_from_shards,
    normal_slice,
)
from shardwork.parallel_state import ParallelConfig, ParamMeta


class _CountDraws:
    """Wraps ``torch.randn`` and counts the elements drawn."""

    def __init__(self):
        self.elements = 0
        self._randn = torch.randn

    def __call__(self, *args, **kwargs):
        out = self._randn(*args, **kwargs)
        self.elements += out.numel()
        return out


def _drawn(fn):
    counter = _CountDraws()
    with mock.patch("torch.randn", counter):
        result = fn()
    return result, counter.elements


@pytest.mark.parametrize(
    ("gshape", "axis"), [((3 * INIT_BLOCK + 5, 7), 0), ((6, 2 * INIT_BLOCK + 9), 1)]
)
def test_any_slice_equals_the_slice_of_the_whole_draw(gshape, axis):
    whole = normal_slice(5, "k", gshape, (0, 0), gshape, axis=axis)
    assert whole.shape == gshape and whole.dtype == torch.float32
    assert 0.8 < float(whole.std()) < 1.2 and abs(float(whole.mean())) < 0.2
    lines = gshape[axis]
    for start, extent in [(0, 1), (3, INIT_BLOCK), (INIT_BLOCK - 1, 2), (17, lines - 17)]:
        offset, shape = [0, 0], list(gshape)
        offset[axis], shape[axis] = start, extent
        piece, drawn = _drawn(
            lambda o=offset, s=shape: normal_slice(5, "k", gshape, o, s, axis=axis)
        )
        torch.testing.assert_close(piece, whole.narrow(axis, start, extent), rtol=0, atol=0)
        other = gshape[1 - axis]
        assert drawn <= (extent + 2 * INIT_BLOCK) * other
    # the documented definition, computed here: block b is randn of its lines from a CPU
    # generator seeded by the first 63 bits (little-endian) of sha256("5:k#b")
    blocks = []
    for b, begin in enumerate(range(0, lines, INIT_BLOCK)):
        digest = hashlib.sha256(f"5:k#{b}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        block_shape = list(gshape)
        block_shape[axis] = min(INIT_BLOCK, lines - begin)
        blocks.append(torch.randn(block_shape, generator=gen))
    torch.testing.assert_close(whole, torch.cat(blocks, dim=axis), rtol=0, atol=0)
    # blocks are independent streams, and the key and seed matter
    assert not torch.equal(whole.narrow(axis, 0, 4), whole.narrow(axis, INIT_BLOCK, 4))
    assert not torch.equal(whole, normal_slice(5, "k2", gshape, (0, 0), gshape, axis=axis))
    assert not torch.equal(whole, normal_slice(6, "k", gshape, (0, 0), gshape, axis=axis))
    # the blocks follow the split axis, not the cut: another axis gives other values
    assert not torch.equal(whole, normal_slice(5, "k", gshape, (0, 0), gshape, axis=1 - axis))


def test_slice_cut_off_the_split_axis_is_rejected():
    with pytest.raises(
        ValueError, match="cut along axis 1; this key may only be split along axis 0"
    ):
        normal_slice(0, "k", (8, 8), (0, 2), (8, 4), axis=0)


def _params(model):
    return {k: st for k, st in model.sharded_state_dict().items()}


_DENSE = dict(hidden_size=256, num_query_groups=4, ffn_hidden_size=512, vocab_size=1000)
_MOE = dict(num_layers=1, moe=tiny_moe(ffn_hidden_size=256))


@pytest.mark.parametrize(
    ("name", "overrides", "parallel", "world"),
    [
        ("tiny-llama3-8b", _DENSE, {"tp": 4}, 4),
        ("tiny-mixtral-8x7b", _MOE, {"ep": 2, "etp": 2}, 4),
    ],
    ids=["dense-tp4", "moe-ep2-etp2"],
)
def test_every_rank_holds_world1_values_and_draws_only_its_share(name, overrides, parallel, world):
    """Old behaviour (the whole global tensor per key on every rank) fails both bounds."""
    cfg = preset(name, **overrides)
    ref = {k: st.data for k, st in _params(GPTModel(cfg)).items()}
    global_normal = sum(t.numel() for t in ref.values() if t.dim() > 1)
    keys_seen = set()
    for rank in range(world):
        groups = layout_groups(ParallelConfig(**parallel), world, rank)
        stage = GPTModel(cfg, groups, device="meta")
        _, drawn = _drawn(lambda s=stage: s.materialize("cpu"))
        local = _params(stage)
        local_normal = sum(st.data.numel() for st in local.values() if st.data.dim() > 1)
        assert drawn <= 1.5 * local_normal and drawn < 0.6 * global_normal, (rank, drawn)
        for key, st in local.items():
            index = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.data.shape))
            assert torch.equal(st.data, ref[key][index]), (rank, key)
            keys_seen.add(key)
    assert keys_seen == set(ref)


def test_uniform_init_is_layout_free_and_follows_its_formula():
    """A ``UniformInit`` parameter split over tp=2 holds the halves of the world-1 values, which
    are ``transform(low + (high - low)·u)`` of the same per-key uniform draws."""
    gshape = (2 * INIT_BLOCK + 6,)
    rule = UniformInit(1.0, 16.0, torch.log)

    def init_at(tp_rank, tp_size):
        param = torch.nn.Parameter(torch.empty(gshape[0] // tp_size, dtype=torch.float64))
        meta = ParamMeta(tp_axis=0) if tp_size > 1 else ParamMeta()
        describe_param(param, meta, init=rule)
        ctx = ShardContext(tp_rank=tp_rank, tp_size=tp_size)
        init_from_shards(param, "A_log", ctx, init_seed=3, std=0.02, num_layers=2)
        return param.detach()

    whole = init_at(0, 1)
    unit = normal_slice(3, "A_log", gshape, (0,), gshape, draw=torch.rand)
    torch.testing.assert_close(whole, torch.log(1.0 + 15.0 * unit).double(), rtol=0, atol=0)
    assert bool((whole >= 0).all() and (whole <= torch.log(torch.tensor(16.0))).all())
    assert whole.unique().numel() == whole.numel()  # real draws, not a constant
    halves = torch.cat([init_at(r, 2) for r in range(2)])
    assert torch.equal(halves, whole)
