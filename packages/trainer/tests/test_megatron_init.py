"""Starting a run from a Megatron-Core checkpoint (``checkpoint.megatron_init``) on one process,
and the validation of the option before any work.

The checkpoint is the fixture megatron-core 0.19.2 wrote (packages/models/tests/data/megatron,
see tools/megatron_checkpoint_fixture.py), whose import shardwork.models' tests compare with
Megatron's own logits; here the run's step-0 loss must be that imported model's loss on the
run's first batch.
"""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from shardwork.models import GPTModel
from shardwork.models.lora import apply_lora, load_lora_state
from shardwork.models.megatron import load_megatron_weights
from shardwork.parallel_state.testing import run_on_ranks
from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.config.validate import validate_config
from shardwork.trainer.config.validate_peft import lora_config_of
from shardwork.trainer.inference import load_for_inference
from shardwork.trainer.model_factory import gpt_config
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import first_global_batch, tiny_config

SOURCE = Path(__file__).parents[2] / "models/tests/data/megatron/llama_w1_te"
MODEL = {
    "preset": "tiny-llama3-8b",
    "vocab_size": 260,  # the checkpoint's; the byte tokenizer's 257 ids fit
    "ffn_hidden_size": 64,
    "rope_theta": 10000.0,
}


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _config(run_dir, world_size=1, parallel=None, **checkpoint):
    return tiny_config(
        run_dir,
        world_size=world_size,
        model=MODEL,
        parallel=parallel or {},
        schedule={"train_steps": 2, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        checkpoint={"megatron_init": str(SOURCE), **checkpoint},
    )


def test_step0_trains_the_imported_megatron_weights(tmp_path):
    config = _config(tmp_path / "run")
    result = train(config)
    model = load_megatron_weights(GPTModel(gpt_config(config)), SOURCE).eval()
    rows = torch.cat(first_global_batch(config))
    with torch.no_grad():
        loss_sum, count = model(input_ids=rows[:, :-1], labels=rows[:, 1:])
    assert result.train_losses[0] == pytest.approx(float(loss_sum) / int(count), rel=1e-5)


def _train_at_layout(run_dir, parallel, cache):
    import os

    os.environ["SHARDWORK_CACHE"] = cache
    config = _config(run_dir, world_size=2, parallel=parallel, save_at_end=False)
    return train(config).train_losses


@pytest.mark.multirank
@pytest.mark.parametrize(
    "parallel", [{"tp": 2, "sequence_parallel": True}, {"pp": 2}], ids=["tp2-sp", "pp2"]
)
def test_step0_at_a_layout_trains_the_imported_weights(tmp_path, tmp_path_factory, parallel):
    """Each rank imports its own slices (TP: q/k/v and gate/up rows of the interleaved QKV and
    fused fc1; PP: its layers): step 0's loss equals the one-process imported model's."""
    config = _config(tmp_path / "one")
    model = load_megatron_weights(GPTModel(gpt_config(config)), SOURCE).eval()
    rows = torch.cat(first_global_batch(config))
    with torch.no_grad():
        loss_sum, count = model(input_ids=rows[:, :-1], labels=rows[:, 1:])
    cache = str(tmp_path_factory.getbasetemp() / "corpus")
    losses = run_on_ranks(_train_at_layout, 2, args=(str(tmp_path / "run"), parallel, cache))
    for rank_losses in losses:
        assert rank_losses[0] == pytest.approx(float(loss_sum) / int(count), rel=1e-5)


def _problems(config) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(config, world_size=1)
    return str(err.value)


@pytest.mark.parametrize("case", ["with-hf", "with-resume-path", "not-megatron", "shape"])
def test_megatron_init_is_validated_before_any_work(tmp_path, case):
    base = _config(tmp_path / "run")
    c = base.checkpoint
    if case == "with-hf":
        config = dataclasses.replace(base, checkpoint=dataclasses.replace(c, hf_init=str(SOURCE)))
        want = "both set the initial weights; valid: one of them"
    elif case == "with-resume-path":
        resume = str(tmp_path / "other" / "step_000000002")
        config = dataclasses.replace(base, checkpoint=dataclasses.replace(c, resume=resume))
        want = f"with checkpoint.resume={resume!r}: resuming another run"
    elif case == "not-megatron":
        (tmp_path / "empty").mkdir()
        folder = str(tmp_path / "empty")
        config = dataclasses.replace(base, checkpoint=dataclasses.replace(c, megatron_init=folder))
        want = "is not a Megatron-Core checkpoint: it has no metadata.json"
    else:
        model = dataclasses.replace(base.model, settings={**base.model.settings, "num_layers": 3})
        config = dataclasses.replace(base, model=model)
        want = "missing keys for this config: ['decoder.layers.2."
    problems = _problems(config)
    assert want in problems, problems
    assert not (tmp_path / "run").exists()  # nothing started


def test_lora_on_a_megatron_base_resumes_and_generates_from_that_base(tmp_path):
    """A LoRA run's checkpoints hold adapters only, so its frozen base is re-imported from
    megatron_init on resume (equal to the uninterrupted run's losses) and by
    load_for_inference (equal to the trained model's logits, computed here from the importer,
    the adapters of the final checkpoint and the LoRA forward)."""
    ckpt = tmp_path / "ckpt"
    common = dict(
        model=MODEL,
        schedule={"train_steps": 5, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        checkpoint={
            "megatron_init": str(SOURCE),
            "dir": str(ckpt),
            "interval": 3,
            "save_at_end": True,
            "resume": "auto",
        },
        peft={"method": "lora", "rank": 4, "alpha": 8.0, "target_modules": ("linear_qkv",)},
    )
    full = train(tiny_config(tmp_path / "full", **common))
    final = str(ckpt / "step_000000005")
    model, config, _ = load_for_inference(final)
    reference = load_megatron_weights(GPTModel(gpt_config(config)), SOURCE)
    apply_lora(reference, lora_config_of(config))
    trained = dict(model.sharded_state_dict())
    load_lora_state(reference, {k: st.data for k, st in trained.items() if ".lora_" in k})
    ids = torch.randint(0, 260, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference.eval()(ids), rtol=0, atol=0)

    shutil.rmtree(final)  # the newest complete checkpoint is now step 3
    resumed = train(tiny_config(tmp_path / "resumed", **common))
    assert sorted(resumed.train_losses) == [3, 4]
    for step in (3, 4):
        assert resumed.train_losses[step] == full.train_losses[step], step
