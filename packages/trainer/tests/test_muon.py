"""optimizer.name = "muon": which parameters get Muon, the trained values against a plain loop
with dist-optimizer's Muon on an unwrapped model, exact resume, and tp=2 / dp=2 against one
process."""

import io

import pytest
import torch

from shardwork.parallel_state.testing import run_on_ranks
from shardwork.trainer.run.optimizers import is_muon_matrix
from shardwork.trainer.run.trainer import _train_samples, train
from shardwork.trainer.testing import tiny_config

MUON = {
    "name": "muon",
    "lr": 3e-3,
    "min_lr": 3e-3,
    "muon_lr": 0.03,
    "muon_momentum": 0.9,
    "muon_ns_steps": 4,
}
SCHEDULE = {"train_steps": 6, "warmup_steps": 0, "lr_schedule": "constant"}


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def test_muon_gets_hidden_matrices_adamw_the_rest():
    from shardwork.models.pipeline import build_model_chunks
    from shardwork.models.presets import preset
    from shardwork.parallel_state import ProcessGroups

    (model,) = build_model_chunks(
        preset("tiny-deepseek-v3"), ProcessGroups.single(), device=torch.device("cpu")
    )
    muon = {n for n, p in model.named_parameters() if is_muon_matrix(n, p)}
    assert "decoder.layers.0.self_attention.linear_q_up_proj.weight" in muon
    assert "decoder.layers.0.mlp.fc1.weight" in muon
    assert "mtp.layers.0.eh_proj.weight" in muon
    assert "mtp.layers.0.transformer_layer.mlp.shared_experts.fc2.weight" in muon
    assert "mtp.layers.0.transformer_layer.mlp.router.weight" in muon
    for name in (
        "embedding.weight",
        "output_layer.linear.weight",
        "decoder.final_norm.weight",
        "mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight",  # [E, 2f, h]
    ):
        assert name not in muon
    assert not any(p.ndim != 2 for n, p in model.named_parameters() if n in muon)


def _plain_muon_losses(config, steps):
    """The same model trained by a plain loop: backward of the per-token mean, clipping, and
    dist-optimizer's Muon on the unwrapped parameters (matrices by name, as documented)."""
    from shardwork.dist_optimizer import Muon
    from shardwork.models import GPTModel
    from shardwork.trainer.data.builder import build_blend, micro_batch, split_components
    from shardwork.trainer.model_factory import gpt_config

    model = GPTModel(gpt_config(config))
    o, s = config.optimizer, config.schedule
    named = list(model.named_parameters())
    head_or_embedding = ("embedding.weight", "output_layer.linear.weight")
    matrices = [p for n, p in named if p.ndim == 2 and n not in head_or_embedding]
    adam_2d = [p for n, p in named if p.ndim == 2 and n in head_or_embedding]
    adam_1d = [p for n, p in named if p.ndim == 1]
    assert len(matrices) + len(adam_2d) + len(adam_1d) == len(named)
    opt = Muon(
        [
            {"params": matrices, "use_muon": True, "lr": o.muon_lr},
            {"params": adam_2d, "use_muon": False},
            {"params": adam_1d, "use_muon": False, "weight_decay": 0.0},
        ],
        lr=o.lr,
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_steps=o.muon_ns_steps,
        weight_decay=o.weight_decay,
        adam_betas=(o.beta1, o.beta2),
        adam_eps=o.eps,
    )
    data = build_blend(
        split_components(config.data)["train"],
        size=_train_samples(config),
        seq_length=config.data.seq_length,
        seed=config.seed,
        shuffle=config.data.shuffle,
    )
    losses = []
    for step in range(steps):
        batches = [
            micro_batch(
                data,
                consumed=step * s.global_batch_size,
                index=m,
                micro_batch_size=s.micro_batch_size,
                dp_rank=0,
                dp_size=1,
            )
            for m in range(s.global_batch_size // s.micro_batch_size)
        ]
        total = sum(b[:, 1:].numel() for b in batches)
        loss = 0.0
        for rows in batches:
            loss_sum, _ = model(input_ids=rows[:, :-1], labels=rows[:, 1:])
            (loss_sum / total).backward()
            loss += float(loss_sum.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss / total)
    return losses


def test_muon_run_equals_a_plain_muon_loop(tmp_path):
    config = tiny_config(
        tmp_path,
        optimizer=MUON,
        schedule=SCHEDULE,
        eval={"interval": None, "at_end": False},
    )
    result = train(config)
    reference = _plain_muon_losses(config, 6)
    for step in range(6):
        assert result.train_losses[step] == pytest.approx(reference[step], rel=1e-4), step
    assert result.train_losses[5] < result.train_losses[0] - 0.3
    # and it is not AdamW: the same run with AdamW takes another path after step 0
    adamw = train(
        tiny_config(
            tmp_path / "adamw",
            optimizer={"lr": 3e-3, "min_lr": 3e-3},
            schedule=SCHEDULE,
            eval={"interval": None, "at_end": False},
        )
    )
    assert adamw.train_losses[0] == result.train_losses[0]
    assert abs(adamw.train_losses[3] - result.train_losses[3]) > 1e-3


def test_muon_resume_reproduces_uninterrupted_losses_exactly(tmp_path):
    common = dict(
        optimizer=MUON,
        schedule={**SCHEDULE, "train_steps": 8},
        eval={"interval": 8, "steps": 2},
        checkpoint={"interval": 4, "keep_last": 3},
    )
    full = train(tiny_config(tmp_path / "a", **common))
    ckpt = tmp_path / "a" / "checkpoints" / "step_000000004"
    resumed = train(tiny_config(tmp_path / "b", **{**common, "checkpoint": {"resume": str(ckpt)}}))
    assert sorted(resumed.train_losses) == list(range(4, 8))
    for step in range(4, 8):
        assert resumed.train_losses[step] == full.train_losses[step], step
    assert resumed.valid_losses[8] == full.valid_losses[8]


def test_muon_trains_an_moe_model(tmp_path):
    result = train(
        tiny_config(
            tmp_path,
            model={"preset": "tiny-mixtral-8x7b"},
            optimizer=MUON,
            schedule={**SCHEDULE, "train_steps": 4},
            eval={"interval": None, "at_end": False},
        )
    )
    assert result.train_losses[3] < result.train_losses[0] - 0.3


def _train(run_dir, sections, cache):
    import os

    import torch.distributed as dist

    os.environ["SHARDWORK_CACHE"] = cache
    world = dist.get_world_size() if dist.is_initialized() else 1
    result = train(tiny_config(run_dir, world_size=world, **sections), stream=io.StringIO())
    return result.train_losses


LAYOUT_SECTIONS = {
    "model": {"num_layers": 4},
    "optimizer": MUON,
    "schedule": {**SCHEDULE, "train_steps": 5},
    "eval": {"interval": None, "at_end": False},
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(corpus cache, losses of the one-process Muon run the layouts are compared with)."""
    cache = str(tmp_path_factory.mktemp("corpus"))
    return cache, _train(str(tmp_path_factory.mktemp("ref")), LAYOUT_SECTIONS, cache)


@pytest.mark.multirank
@pytest.mark.parametrize("parallel", [{"tp": 2}, {}], ids=["tp2", "dp2"])
def test_muon_layouts_match_one_process(tmp_path, parallel, one_process):
    cache, reference = one_process
    layout = {**LAYOUT_SECTIONS, "parallel": parallel}
    for losses in run_on_ranks(_train, 2, args=(str(tmp_path / "par"), layout, cache), timeout=300):
        for step in range(5):
            assert losses[step] == pytest.approx(reference[step], rel=2e-4, abs=2e-4), step
