"""The planner's enumeration against a brute force written here, and against the trainer.

The brute force restates the rules from their sources (the model's divisibility rules, the
pipeline splits per rank and per virtual stage, the CP and node bounds of docs/planner.md) in
the plainest way; every layout the planner proposes must also pass ``shardwork-train``'s own
``validate_config``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from shardwork.models import GPTConfig, preset
from shardwork.trainer.plan.layouts import (
    MIN_CP_TOKENS,
    Layout,
    parallel_layouts,
    pipeline_split,
    variants,
    virtual_split,
)


def _brute_force(model: GPTConfig, n: int, per_node: int, batch: int, seq: int, ep_choices):
    heads, kv, ffn, vocab = (
        model.num_attention_heads,
        model.kv_heads,
        model.ffn_hidden_size,
        model.padded_vocab_size,
    )
    L = model.num_layers
    out = set()
    for tp, cp, pp, vpp in itertools.product(range(1, n + 1), range(1, n + 1), range(1, L + 1),
                                             range(1, 9)):  # fmt: skip
        if n % (tp * cp * pp) or tp > per_node or (pp == 1 and vpp > 1):
            continue
        dp = n // (tp * cp * pp)
        if any(x % tp for x in (heads, kv, ffn, vocab)) or batch % dp:
            continue
        if cp > 1 and (seq % (2 * cp) or seq // cp < MIN_CP_TOKENS):
            continue
        if tp > 1 and (seq // cp) % tp:
            continue
        for split in _splits(L, pp, vpp):
            for ep, etp in ep_choices(tp, cp, dp):
                out.add((tp, cp, pp, dp, ep, etp, vpp, *split))
    return out


def _splits(L, pp, vpp):
    """(first, last, first virtual, last virtual) of the per-rank split and, when it exists
    and places the layers differently, the per-virtual-stage one."""
    out, chunks = [], []
    q = -(-L // pp)  # layers on the middle ranks; the ends absorb the deficit
    d = q * pp - L
    first, last = (q - d // 2, q - d + d // 2) if d else (None, None)
    counts = [q] * pp if d == 0 else [first] + [q] * (pp - 2) + [last]
    if pp == 1:
        counts = [L]
    fits = not (d and pp == 2 and first + last != L)
    if fits and min(counts) >= 0 and not any(c % vpp for c in counts):
        out.append((first, last, None, None))
        chunks.append([[c // vpp] * vpp for c in counts])
    stages = pp * vpp
    Q = -(-L // stages)  # layers on the middle virtual stages; the end ones absorb the deficit
    D = Q * stages - L
    if vpp > 1 and D and Q - D // 2 >= 0 and Q - D + D // 2 >= 0:
        per_stage = [Q - D // 2] + [Q] * (stages - 2) + [Q - D + D // 2]
        # virtual stage c·pp + r is chunk c of rank r
        virtual = [[per_stage[c * pp + r] for c in range(vpp)] for r in range(pp)]
        if virtual not in chunks:
            out.append((None, None, per_stage[0], per_stage[-1]))
    return out


def _planner(model, n, per_node, batch, seq):
    return {
        (
            x.tp,
            x.cp,
            x.pp,
            x.dp,
            x.ep,
            x.etp,
            x.vpp,
            x.first_stage_layers,
            x.last_stage_layers,
            x.first_virtual_stage_layers,
            x.last_virtual_stage_layers,
        )
        for x in parallel_layouts(
            model, num_gpus=n, gpus_per_node=per_node, global_batch=batch, seq_length=seq
        )
    }


def test_dense_enumeration_equals_brute_force():
    model = GPTConfig(
        num_layers=6, hidden_size=96, num_attention_heads=12, num_query_groups=4,
        ffn_hidden_size=192, vocab_size=250, make_vocab_size_divisible_by=16,
    )  # fmt: skip
    args = (model, 48, 8, 96, 16384)
    expected = _brute_force(*args, ep_choices=lambda tp, cp, dp: [(1, 1)])
    got = _planner(*args)
    assert got == expected
    assert len(got) > 40 and {x[0] for x in got} == {1, 2, 4}  # tp | kv heads = 4
    assert {x[1] for x in got} == {1, 2, 4}  # 16384 / cp >= 4096
    assert any(x[7] is not None for x in got)  # uneven splits (pp = 4: 2, 1+1 / 1, 2, 2, 1)
    assert any(x[9] is not None for x in got)  # and per virtual stage (pp = 4, vpp = 2: 0+..+0)


def test_moe_enumeration_equals_brute_force():
    model = preset("tiny-mixtral-8x7b", num_layers=4)
    experts = model.moe.router.num_experts

    def ep_choices(tp, cp, dp):
        for ep in range(1, experts + 1):
            for etp in sorted({1, tp}):
                if experts % ep == 0 and (tp * cp * dp) % (ep * etp) == 0:
                    yield ep, etp

    args = (model, 16, 8, 32, 256)
    assert _planner(*args) == _brute_force(*args, ep_choices=ep_choices)


@pytest.mark.parametrize(
    ("layers", "pp", "split"),
    [(126, 16, (7, 7)), (70, 12, (5, 5)), (61, 16, (3, 2)), (128, 64, (None, None))],
)
def test_pipeline_split_takes_layers_from_the_ends(layers, pp, split):
    """Llama 3 405B (7 + 14·8 + 7), BLOOM (5 + 10·6 + 5), DeepSeek-V3, an even split."""
    assert pipeline_split(layers, pp) == split
    first, last = split
    if first is not None:
        q = -(-layers // pp)
        assert first + last + (pp - 2) * q == layers


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "split"),
    [(126, 16, 8, (0, 0)), (126, 16, 4, (1, 1)), (70, 12, 2, (2, 2)), (61, 16, 2, (1, 0)),
     (128, 16, 8, (None, None)), (100, 8, 4, (None, None))],
)  # fmt: skip
def test_virtual_split_takes_layers_from_the_end_virtual_stages(layers, pp, vpp, split):
    """Llama 3 405B (0 + 126·1 + 0, Dubey et al. 2024 §3.3.2; 1 + 62·2 + 1 at vpp 4), BLOOM at
    vpp 2 (2 + 22·3 + 2), DeepSeek-V3 (1 + 30·2 + 0), an even split, and a deficit (28) larger
    than two virtual stages hold (none)."""
    assert virtual_split(layers, pp, vpp) == split
    first, last = split
    if first is not None:
        q = -(-layers // (pp * vpp))
        assert first + last + (pp * vpp - 2) * q == layers


def test_variants_cover_micro_batches_dividing_the_replica_batch():
    base = Layout(tp=2, cp=1, pp=2, dp=3)
    got = [[(x.micro_batch, x.recompute) for x in group] for group in variants(base, 24)]
    assert got == [[(b, r) for b in (1, 2, 4, 8)] for r in ("none", "selective", "full")]
    assert [x.micro_batch for x in next(variants(base, 18))] == [1, 2]  # 18 / 3 = 6
    # interleaved: 24 / 3 = 8 sequences per replica, micro-batch counts 8, 4, 2, 1 of which
    # only those divisible by pp = 4 (the schedule's groups of pp micro-batches)
    interleaved = Layout(tp=2, cp=1, pp=4, dp=3, vpp=2)
    assert [x.micro_batch for x in next(variants(interleaved, 24))] == [1, 2]


def test_every_proposed_layout_passes_the_trainers_validation(tmp_path):
    """``validate_config`` of shardwork-train (world size = the GPUs) accepts each layout."""
    from shardwork.trainer.model_factory import gpt_config
    from shardwork.trainer.testing import tiny_config

    model = {"num_layers": 6, "num_attention_heads": 4, "num_query_groups": 2}
    planner_model = gpt_config(tiny_config(tmp_path / "probe", model=model))
    n, batch, seq = 16, 32, 8192
    seen = virtual = 0
    for lay in parallel_layouts(
        planner_model, num_gpus=n, gpus_per_node=8, global_batch=batch, seq_length=seq
    ):
        tiny_config(
            tmp_path / "run",
            world_size=n,
            model=model,
            data={"seq_length": seq},
            schedule={"global_batch_size": batch, "micro_batch_size": 1},
            parallel={
                "tp": lay.tp,
                "cp": lay.cp,
                "pp": lay.pp,
                "vpp": lay.vpp if lay.vpp > 1 else None,
                "sequence_parallel": lay.tp > 1,
                "first_stage_layers": lay.first_stage_layers,
                "last_stage_layers": lay.last_stage_layers,
                "first_virtual_stage_layers": lay.first_virtual_stage_layers,
                "last_virtual_stage_layers": lay.last_virtual_stage_layers,
            },
        )  # fmt: skip; raises ConfigError if the trainer refuses the layout
        seen += 1
        virtual += lay.first_virtual_stage_layers is not None
    # the layouts enumerated for this model and problem, 12 of them split per virtual stage
    # (pp 2 × vpp 2: 1 + 2 + 2 + 1; pp 2 × vpp 4 and pp 4 × vpp 2: 0 + 6 × 1 + 0)
    assert (seen, virtual) == (28, 12)


def test_every_proposed_moe_layout_passes_the_trainers_validation(tmp_path):
    """The same for a MoE model: ep and etp choices included."""
    from shardwork.trainer.model_factory import gpt_config
    from shardwork.trainer.testing import tiny_config

    model = {"preset": "tiny-mixtral-8x7b"}
    planner_model = gpt_config(tiny_config(tmp_path / "probe", model=model))
    n, batch, seq = 8, 16, 256
    layouts = list(
        parallel_layouts(
            planner_model, num_gpus=n, gpus_per_node=8, global_batch=batch, seq_length=seq
        )
    )
    for lay in layouts:
        tiny_config(
            tmp_path / "run",
            world_size=n,
            model=model,
            data={"seq_length": seq},
            schedule={"global_batch_size": batch, "micro_batch_size": 1},
            parallel={
                "tp": lay.tp,
                "cp": lay.cp,
                "pp": lay.pp,
                "vpp": lay.vpp if lay.vpp > 1 else None,
                "ep": lay.ep,
                "etp": lay.etp,
                "sequence_parallel": lay.tp > 1,
                "first_stage_layers": lay.first_stage_layers,
                "last_stage_layers": lay.last_stage_layers,
                "first_virtual_stage_layers": lay.first_virtual_stage_layers,
                "last_virtual_stage_layers": lay.last_virtual_stage_layers,
            },
        )  # fmt: skip; raises ConfigError if the trainer refuses the layout
    assert {x.ep for x in layouts} == {1, 2, 4, 8}
    assert {x.etp for x in layouts} == {1, 2}  # tp <= 2: the tiny twin has 2 kv heads


def test_describe_shows_a_per_rank_uneven_split():
    """A row must say how its layers split: 3 layers at pp = 2 run only with
    parallel.first_stage_layers = 2 / last_stage_layers = 1 (the trainer refuses an even split),
    and the row used to read just "PP2"."""
    uneven = Layout(tp=2, cp=1, pp=2, dp=1, first_stage_layers=2, last_stage_layers=1)
    assert uneven.describe() == "TP2 CP1 PP2[2+..+1] DP1 mb1 none"
    even = Layout(tp=2, cp=1, pp=2, dp=1)
    assert even.describe() == "TP2 CP1 PP2 DP1 mb1 none"
    virtual = Layout(tp=8, cp=1, pp=16, dp=64, vpp=8, recompute="full")
    virtual = dataclasses.replace(
        virtual, first_virtual_stage_layers=0, last_virtual_stage_layers=0
    )
    assert virtual.describe() == "TP8 CP1 PP16x8(0+..+0) DP64 mb1 full"


def test_a_moe_row_names_its_expert_sizes():
    """Experts at etp 1 below tp 2 must say so: the trainer's etp defaults to tp, and the row of
    tiny Mixtral at tp 2, ep 1, etp 1 used to read like a dense one ("TP2 CP1 PP1 DP1 mb8")."""
    model = preset("tiny-mixtral-8x7b", num_layers=4)
    rows = {
        (x.tp, x.ep, x.etp): x.describe()
        for x in parallel_layouts(model, num_gpus=2, gpus_per_node=8, global_batch=8, seq_length=64)
    }
    assert rows[(2, 1, 1)] == "TP2 CP1 PP1 DP1 EP1 ETP1 mb1 none"
    assert rows[(2, 1, 2)] == "TP2 CP1 PP1 DP1 EP1 ETP2 mb1 none"
    dense = Layout(tp=2, cp=1, pp=1, dp=1)  # a dense model's rows name no experts
    assert dense.describe() == "TP2 CP1 PP1 DP1 mb1 none"
