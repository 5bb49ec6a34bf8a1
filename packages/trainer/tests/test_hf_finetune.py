"""Fine-tuning from a Hugging Face folder (``checkpoint.hf_init``) and exporting to one
(``checkpoint.hf_export``) on one process; validation of both before any work.

The folder is written by shardwork.models.hf from a random Llama-style GPTModel (norms
randomised away from 1), so this needs no transformers; tests-integration/test_hf_roundtrip.py
does the same at parallel layouts against transformers itself.
"""

import dataclasses
import json
import shutil

import pytest
import torch

from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.config.validate import validate_config
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import first_global_batch, tiny_config

VOCAB = 260  # the byte tokenizer's 257 ids fit


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``(folder, model)``: a random 2-layer Llama-style model saved as a Hugging Face folder."""
    from shardwork.models import GPTConfig, GPTModel, TokenIds
    from shardwork.models.hf import save_pretrained

    config = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        init_seed=7,
    )
    model = GPTModel(config).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
    folder = tmp_path_factory.mktemp("hf") / "source"
    model.token_ids = TokenIds(bos=1, eos=(2, 7), pad=0)  # not transformers' Llama defaults
    save_pretrained(model, folder)
    return str(folder), model


def _mean_loss(model, rows) -> float:
    with torch.no_grad():
        loss_sum, count = model(input_ids=rows[:, :-1], labels=rows[:, 1:])
    return float(loss_sum) / int(count)


def test_finetune_from_and_export_to_a_hugging_face_folder(tmp_path, source):
    from shardwork.models.hf import from_pretrained
    from shardwork.trainer.inference import load_for_inference

    folder, model = source
    out = tmp_path / "exported"
    config = tiny_config(
        tmp_path / "run",
        schedule={"train_steps": 3, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        checkpoint={"hf_init": folder, "hf_export": str(out), "save_at_end": True},
    )
    # the architecture came from the folder
    settings = config.model.settings
    assert (settings["num_layers"], settings["hidden_size"], settings["vocab_size"]) == (
        2,
        32,
        VOCAB,
    )
    result = train(config)
    # step 0 trained the imported weights: its loss is the source model's on that batch
    assert result.train_losses[0] == pytest.approx(
        _mean_loss(model, torch.cat(first_global_batch(config))), rel=1e-5
    )
    assert result.hf_export == str(out)
    exported = from_pretrained(out).eval()
    ids = exported.token_ids  # the source folder's ids, exported
    assert (ids.bos, ids.eos, ids.pad) == (1, (2, 7), 0)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": [2, 7],
        "pad_token_id": 0,
    }
    trained, _, _ = load_for_inference(result.checkpoint)  # through the shardwork checkpoint
    probe = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = trained(input_ids=probe)
        torch.testing.assert_close(exported(input_ids=probe), want, rtol=1e-5, atol=1e-5)
        assert (model(input_ids=probe) - want).abs().max() > 1e-3  # and training moved it


def test_a_resumed_run_reads_its_checkpoint_not_the_hugging_face_folder(
    tmp_path, source, monkeypatch
):
    """With ``hf_init`` and ``resume='auto'`` a run whose checkpoint directory holds a complete
    checkpoint continues from it: the folder's weights are not imported again (the import is
    made to fail), and steps 3 and 4 equal those of the uninterrupted run from the folder."""
    import io

    import shardwork.trainer.run.hf as hf_module

    folder, _ = source
    ckpt = tmp_path / "ckpt"
    common = dict(
        schedule={"train_steps": 5, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        checkpoint={
            "hf_init": folder,
            "dir": str(ckpt),
            "interval": 3,
            "save_at_end": True,
            "resume": "auto",
        },
    )
    full = train(tiny_config(tmp_path / "full", **common))
    shutil.rmtree(ckpt / "step_000000005")  # the newest complete checkpoint is now step 3

    def no_import(*args, **kwargs):
        raise AssertionError("the Hugging Face folder was imported on resume")

    monkeypatch.setattr(hf_module, "import_hf_weights", no_import)
    said = io.StringIO()
    resumed = train(tiny_config(tmp_path / "resumed", **common), stream=said)
    assert "not read: the run resumes a checkpoint" in said.getvalue()
    assert sorted(resumed.train_losses) == [3, 4]
    for step in (3, 4):
        assert resumed.train_losses[step] == full.train_losses[step], step


def _problems(config, world_size=1) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(config, world_size=world_size)
    return str(err.value)


def _with(config, **checkpoint):
    return dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint, **checkpoint)
    )


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "not-hf",
        "preset",
        "dimension",
        "shape-override",
        "vocabulary",
        "export-not-empty",
        "export-vpp",
    ],
)
def test_hf_options_are_validated_before_any_work(tmp_path, source, case):
    folder, _ = source
    base = tiny_config(tmp_path / "run", checkpoint={"hf_init": folder})
    model = base.model
    if case == "missing":
        config, want = _with(base, hf_init=str(tmp_path / "nowhere")), "no such directory"
    elif case == "not-hf":
        (tmp_path / "empty").mkdir()
        config = _with(base, hf_init=str(tmp_path / "empty"))
        want = "not a Hugging Face checkpoint folder"
    elif case == "preset":
        model = dataclasses.replace(model, preset="tiny-llama3-8b")
        config, want = dataclasses.replace(base, model=model), "model.preset='tiny-llama3-8b'"
    elif case == "dimension":
        config = dataclasses.replace(
            base, model=dataclasses.replace(model, settings={**model.settings, "num_layers": 3})
        )
        want = "model.num_layers=3 differs from checkpoint.hf_init"
    elif case == "shape-override":
        model = dataclasses.replace(model, settings={**model.settings, "qk_layernorm": True})
        config = dataclasses.replace(base, model=model)
        want = "q_layernorm.weight only here"
    elif case == "vocabulary":
        small = tmp_path / "small-vocab"
        shutil.copytree(folder, small)
        hf = json.loads((small / "config.json").read_text())
        (small / "config.json").write_text(json.dumps({**hf, "vocab_size": 200}))
        config = _with(base, hf_init=str(small))
        want = "has 257 ids but the vocabulary of checkpoint.hf_init"
    elif case == "export-not-empty":
        config = _with(base, hf_export=folder)
        want = f"checkpoint.hf_export={folder!r}: exists and is not an empty directory"
    else:
        parallel = dataclasses.replace(base.parallel, pp=2, vpp=2)
        config = _with(dataclasses.replace(base, parallel=parallel), hf_export=str(tmp_path / "x"))
        want = "with parallel.vpp=2: the export writes one model chunk per rank"
    problems = _problems(config, world_size=2 if case == "export-vpp" else 1)
    assert want in problems, problems
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_folder_missing_a_tensor_is_refused_by_validation_and_by_the_load(tmp_path, source):
    """A tensor the model needs that the files lack: validation names it from the safetensors
    headers, before any work; a load that meets it anyway (a caller that skipped validation)
    ends in `CheckpointError` (exit 4) naming ``checkpoint.hf_init``, not a ValueError."""
    from safetensors.torch import load_file, save_file

    from shardwork.models import GPTModel
    from shardwork.trainer.errors import EXIT_CHECKPOINT, CheckpointError
    from shardwork.trainer.run.hf import import_hf_weights

    folder, model = source
    partial = tmp_path / "partial"
    shutil.copytree(folder, partial)
    tensors = load_file(partial / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, partial / "model.safetensors")
    base = tiny_config(tmp_path / "run", checkpoint={"hf_init": folder})
    problems = _problems(_with(base, hf_init=str(partial)))
    assert "has no tensor 'model.layers.1.post_attention_layernorm.weight'" in problems, problems
    assert not (tmp_path / "run").exists()
    with pytest.raises(CheckpointError, match=r"checkpoint\.hf_init='.*partial': its weights do "
                       r"not fit the model: .*'model\.layers\.1\.post_attention_layernorm"):  # fmt: skip
        import_hf_weights([GPTModel(model.config)], str(partial))
    assert CheckpointError.exit_code == EXIT_CHECKPOINT
