"""The planner's enumeration against a brute force written here, and against the trainer.

The brute force restates the rules from their sources (the model's divisibility rules, the
pipeline split, the CP and node bounds of docs/planner.md) in the plainest way; every layout
the planner proposes must also pass ``shardwork-train``'s own ``validate_config``.
"""

from __future__ import annotations

import itertools

import pytest

from shardwork.models import GPTConfig, preset
from shardwork.trainer.plan.layouts import (
    MIN_CP_TOKENS,
    Layout,
    parallel_layouts,
    pipeline_split,
    variants,
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
        q = -(-L // pp)  # layers on the middle ranks; the ends absorb the deficit
        d = q * pp - L
        first, last = (q - d // 2, q - d + d // 2) if d else (None, None)
        counts = [q] * pp if d == 0 else [first] + [q] * (pp - 2) + [last]
        if pp == 1:
            counts = [L]
        if d and pp == 2 and first + last != L:
            continue
        if min(counts) < 0 or any(c % vpp for c in counts):
            continue
        for ep, etp in ep_choices(tp, cp, dp):
            out.add((tp, cp, pp, dp, ep, etp, vpp, first, last))
    return out


def _planner(model, n, per_node, batch, seq):
    return {
        (x.tp, x.cp, x.pp, x.dp, x.ep, x.etp, x.vpp, x.first_stage_layers, x.last_stage_layers)
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


def test_variants_cover_micro_batches_dividing_the_replica_batch():
    base = Layout(tp=2, cp=1, pp=2, dp=3)
    got = [[(x.micro_batch, x.recompute) for x in group] for group in variants(base, 24)]
    assert got == [[(b, r) for b in (1, 2, 4, 8)] for r in ("none", "selective", "full")]
    assert [x.micro_batch for x in next(variants(base, 18))] == [1, 2]  # 18 / 3 = 6


def test_every_proposed_layout_passes_the_trainers_validation(tmp_path):
    """``validate_config`` of shardwork-train (world size = the GPUs) accepts each layout."""
    from shardwork.trainer.model_factory import gpt_config
    from shardwork.trainer.testing import tiny_config

    model = {"num_layers": 6, "num_attention_heads": 4, "num_query_groups": 2}
    planner_model = gpt_config(tiny_config(tmp_path / "probe", model=model))
    n, batch, seq = 16, 32, 8192
    seen = 0
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
            },
        )  # fmt: skip; raises ConfigError if the trainer refuses the layout
        seen += 1
    assert seen == 16  # the number of layouts enumerated for this model and problem


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
            },
        )  # fmt: skip; raises ConfigError if the trainer refuses the layout
    assert {x.ep for x in layouts} == {1, 2, 4, 8}
    assert {x.etp for x in layouts} == {1, 2}  # tp <= 2: the tiny twin has 2 kv heads
