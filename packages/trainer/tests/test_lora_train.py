"""``[peft]`` LoRA runs on one process: fine-tuning from a Hugging Face folder trains only the
adapters (base unchanged bit-exactly, loss goes down), DDP and the optimizer hold only adapter
elements, checkpoints hold only adapters and resume to the uninterrupted run's losses, and bad
``[peft]`` values are refused before any work.
"""

import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import shardwork.trainer.run.trainer as trainer_module
from shardwork.models import GPTConfig, GPTModel
from shardwork.models.full_state import full_state_dict
from shardwork.models.hf import gpt_config_from_hf, import_peft, read_hf_config, save_pretrained
from shardwork.models.lora import is_lora_key
from shardwork.parallel_state.testing import run_on_ranks
from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.config.validate import validate_config
from shardwork.trainer.inference import load_for_inference
from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import first_global_batch, tiny_config

VOCAB = 260
LORA = {"method": "lora", "rank": 4, "alpha": 8.0, "target_modules": ("linear_qkv", "fc2")}


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A random 2-layer Llama-style model saved as a Hugging Face folder."""
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
    out = tmp_path_factory.mktemp("hf") / "source"
    save_pretrained(GPTModel(config).eval(), out)
    return str(out)


def _capture_assembly(monkeypatch) -> list:
    """Record the run's assembly and its full base weights right after it is built."""
    seen = []
    build = trainer_module.build_assembly

    def recording(*args, **kwargs):
        assembly = build(*args, **kwargs)
        (module,) = assembly.modules
        base = {k: v.clone() for k, v in full_state_dict(module).items() if not is_lora_key(k)}
        seen.append((assembly, base))
        return assembly

    monkeypatch.setattr(trainer_module, "build_assembly", recording)
    return seen


def test_lora_run_trains_adapters_only(tmp_path, folder, monkeypatch):
    seen = _capture_assembly(monkeypatch)
    config = tiny_config(
        tmp_path / "run",
        schedule={"train_steps": 8, "warmup_steps": 1},
        optimizer={"lr": 3e-2, "min_lr": 3e-3},
        eval={"interval": None, "at_end": False},
        checkpoint={"hf_init": folder, "save_at_end": True},
        peft=LORA,
    )
    result = train(config)
    losses = [result.train_losses[s] for s in sorted(result.train_losses)]
    assert losses[-1] < losses[0] - 0.05, losses
    ((assembly, base),) = seen
    (module,) = assembly.modules
    after = full_state_dict(module)
    for key, value in base.items():  # frozen: bit-exact after 8 optimizer steps
        assert torch.equal(after[key], value), key
    # Trainable = adapters: r·(h + qkv_out) + r·(ffn + h) per layer, from the shapes.
    h, ffn, qkv_out = 32, 64, (4 + 2 * 2) * 8
    adapters = 2 * (4 * (h + qkv_out) + 4 * (ffn + h))
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == adapters
    (chunk,) = assembly.chunks
    in_buffers = sum(p.numel() for buf in chunk.buffers.values() for p in buf.params)
    assert in_buffers == adapters
    # ZeRO masters (and with them AdamW's moments) cover exactly the adapter elements.
    parts = getattr(assembly.optimizer, "parts", [assembly.optimizer])  # chained for MoE only
    masters = sum(m.master.numel() for part in parts for m in part.masters)
    assert masters == adapters
    # The checkpoint holds the adapters only (plus optimizer state for them).
    keys = FileSystemReader(result.checkpoint).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))]
    assert model_keys and all(is_lora_key(k) for k in model_keys), model_keys
    assert set(model_keys) == set(full_state_dict(module, keys=is_lora_key))
    # shardwork-generate's loader rebuilds base (from hf_init) + adapters: the trained model.
    loaded, _, _ = load_for_inference(result.checkpoint)
    probe = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = module.eval()(input_ids=probe)
        torch.testing.assert_close(loaded(input_ids=probe), want, rtol=1e-5, atol=1e-5)


def test_lora_run_resumes_from_adapter_checkpoint(tmp_path, folder):
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
        peft=LORA,
    )
    full = train(tiny_config(tmp_path / "full", **common))
    shutil.rmtree(ckpt / "step_000000005")  # the newest complete checkpoint is now step 3
    resumed = train(tiny_config(tmp_path / "resumed", **common))
    assert sorted(resumed.train_losses) == [3, 4]
    for step in (3, 4):
        assert resumed.train_losses[step] == full.train_losses[step], step


def _problems(config) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(config, world_size=1)
    return str(err.value)


@pytest.mark.parametrize(
    ("change", "want"),
    [
        ({"method": "qlora"}, r"peft.method='qlora': must be one of \['none', 'lora'\]"),
        ({"rank": 0}, r"peft.rank=0 is invalid: it must be an integer >= 1"),
        ({"dropout": 1.5}, r"peft.dropout=1.5 is invalid: it must be in \[0, 1\)"),
        (
            {"target_modules": ("linear_qkv", "q_proj")},
            r"\['q_proj'\] match no module of this model; available module-name suffixes: "
            r"\['fc1', 'fc2', 'linear_proj', 'linear_qkv'\]",
        ),
        ({"target_modules": ("mlp",)}, r"matches 'decoder.layers.0.mlp' \(SwiGLUMLP\)"),
        ({"target_modules": "(("}, r"peft.target_modules='\(\(' is not a valid regular"),
    ],
    ids=["method", "rank", "dropout", "unknown-target", "not-a-linear", "bad-regex"],
)
def test_bad_peft_values_are_refused_before_any_work(tmp_path, change, want):
    base = tiny_config(tmp_path / "run")
    config = dataclasses.replace(base, peft=dataclasses.replace(base.peft, **(LORA | change)))
    message = _problems(config)
    assert re.search(want, message), message
    assert not (tmp_path / "run").exists()  # nothing written


def test_peft_refuses_muon_and_exports_it_cannot_write(tmp_path):
    base = tiny_config(tmp_path / "run")
    lora = dataclasses.replace(base.peft, **LORA)
    muon = dataclasses.replace(
        base, peft=lora, optimizer=dataclasses.replace(base.optimizer, name="muon")
    )
    assert "optimizer.name='muon' is not supported" in _problems(muon)
    target = str(tmp_path / "adapter")
    no_base = dataclasses.replace(base, peft=dataclasses.replace(lora, export=target))
    assert f"peft.export={target!r} needs checkpoint.hf_init" in _problems(no_base)
    no_lora = dataclasses.replace(base, peft=dataclasses.replace(base.peft, export=target))
    assert "needs peft.method='lora'" in _problems(no_lora)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "old.txt").write_text("x")
    taken = dataclasses.replace(base, peft=dataclasses.replace(lora, export=target))
    assert "exists and is not an empty directory" in _problems(taken)
    no_base_init = dataclasses.replace(base, peft=dataclasses.replace(lora, init=target))
    assert f"peft.init={target!r} needs checkpoint.hf_init" in _problems(no_base_init)
    assert not (tmp_path / "run").exists()  # nothing written


def _train_lora(run_dir, sections, cache):
    import os

    os.environ["SHARDWORK_CACHE"] = cache
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return train(tiny_config(run_dir, world_size=world, **sections)).train_losses


def _multirank_sections(hf_init: str | None = None, **optimizer):
    sections = {
        "model": {"num_layers": 4},
        "schedule": {"train_steps": 6, "warmup_steps": 2},
        "optimizer": {"lr": 3e-2, "min_lr": 3e-3, **optimizer},
        "eval": {"interval": None, "at_end": False},
        "checkpoint": {"interval": 3, "keep_last": 3, "save_at_end": True},
        "peft": LORA,
    }
    if hf_init is not None:  # the folder brings the architecture
        del sections["model"]
        sections["checkpoint"]["hf_init"] = hf_init
    return sections


@pytest.mark.multirank
def test_lora_zero_with_overlapped_param_gather_matches_one_process(tmp_path, tmp_path_factory):
    """DP=2 ZeRO-1 with the parameter all-gather overlapped with the next forward gives the
    one-process losses (that the gather's forward pre-hooks fire on the adapter factors is
    checked directly by the models package's ``test_factor_modules_run_their_forward_hooks``)."""
    cache = str(tmp_path_factory.getbasetemp() / "corpus")
    ref = _train_lora(str(tmp_path / "one"), _multirank_sections(), cache)
    dp = _multirank_sections(overlap_param_gather=True)
    (losses, _) = run_on_ranks(_train_lora, 2, args=(str(tmp_path / "dp2"), dp, cache), timeout=300)
    for step in range(6):
        assert losses[step] == pytest.approx(ref[step], rel=2e-4, abs=2e-4), step


@pytest.mark.multirank
@pytest.mark.parametrize("parallel", [{"pp": 2}, {"pp": 2, "vpp": 2}], ids=["pp2", "pp2-vpp2"])
def test_lora_only_on_the_last_stage_matches_one_process(tmp_path, tmp_path_factory, parallel):
    """A target regex that puts adapters on the last layer only leaves the first pipeline stage
    with nothing to train: its backward is skipped (its output needs no gradient), and the
    run gives the one-process losses."""
    cache = str(tmp_path_factory.getbasetemp() / "corpus")
    sections = _multirank_sections()
    sections["peft"] = {**LORA, "target_modules": r"decoder\.layers\.3\..*fc1"}
    sections["schedule"] = {**sections["schedule"], "micro_batch_size": 2}
    ref = _train_lora(str(tmp_path / "one"), sections, cache)
    piped = dict(sections, parallel=parallel)
    results = run_on_ranks(_train_lora, 2, args=(str(tmp_path / "pp"), piped, cache), timeout=300)
    losses = results[1]  # the last stage computes the loss
    for step in range(6):
        assert losses[step] == pytest.approx(ref[step], rel=2e-4, abs=2e-4), step


@pytest.mark.multirank
def test_lora_tp2_sp_run_matches_one_process_and_resumes_at_world_1(
    tmp_path, tmp_path_factory, folder
):
    """Fine-tuning a Hugging Face folder with LoRA at TP=2+SP and on one process gives the same
    losses (fp32 rounding); its TP=2 adapter checkpoint resumes on one process (base re-imported
    from the folder, adapters and their optimizer state resharded) to the one-process losses."""
    cache = str(tmp_path_factory.getbasetemp() / "corpus")
    sections = _multirank_sections(hf_init=folder)
    ref = _train_lora(str(tmp_path / "one"), sections, cache)
    tp = dict(sections, parallel={"tp": 2, "sequence_parallel": True})
    (losses, _) = run_on_ranks(_train_lora, 2, args=(str(tmp_path / "tp2"), tp, cache), timeout=300)
    assert sorted(losses) == list(range(6))
    for step in range(6):
        assert losses[step] == pytest.approx(ref[step], rel=2e-4, abs=2e-4), step
    assert ref[5] < ref[0]
    ckpt = str(tmp_path / "tp2" / "checkpoints" / "step_000000003")
    resumed = dict(sections, checkpoint={"hf_init": folder, "resume": ckpt, "save_at_end": False})
    again = _train_lora(str(tmp_path / "resumed"), resumed, cache)
    assert sorted(again) == [3, 4, 5]
    for step in (3, 4, 5):
        assert again[step] == pytest.approx(ref[step], rel=2e-4, abs=2e-4), step


def _rank_training_sizes(run_dir, sections, cache):
    """Train on this rank, then return its trainable elements and what training allocated for
    them: DDP buffer elements, fp32 master elements and AdamW state bytes."""
    os.environ["SHARDWORK_CACHE"] = cache
    seen = []
    build = trainer_module.build_assembly

    def recording(*args, **kwargs):
        seen.append(build(*args, **kwargs))
        return seen[-1]

    trainer_module.build_assembly = recording  # a pooled worker: restored below
    try:
        train(tiny_config(run_dir, world_size=torch.distributed.get_world_size(), **sections))
    finally:
        trainer_module.build_assembly = build
    ((module,), (chunk,)) = seen[0].modules, seen[0].chunks
    parts = getattr(seen[0].optimizer, "parts", [seen[0].optimizer])
    moments = [
        t
        for part in parts
        if part.optimizer is not None
        for state in part.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    ]
    return {
        "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "buffers": sum(p.numel() for buf in chunk.buffers.values() for p in buf.params),
        "masters": sum(m.master.numel() for part in parts for m in part.masters),
        "adam_bytes": sum(t.numel() * t.element_size() for t in moments),
    }


@pytest.mark.multirank
def test_lora_training_state_per_rank_is_adapter_sized_at_tp2(tmp_path, tmp_path_factory):
    """At TP=2+SP each rank's DDP buffers, fp32 masters and AdamW moments hold exactly its own
    adapter shards, counted here from the shapes: column-parallel ``linear_qkv`` keeps the
    whole ``A [r, h]`` and half of ``B [qkv_out, r]``, row-parallel ``fc2`` half of
    ``A [r, ffn]`` and the whole ``B [h, r]``; AdamW keeps two fp32 moments per element."""
    cache = str(tmp_path_factory.getbasetemp() / "corpus")
    sections = _multirank_sections()
    sections["schedule"] = {"train_steps": 1, "warmup_steps": 1}
    sections["checkpoint"] = {"save_at_end": False}
    sections["parallel"] = {"tp": 2, "sequence_parallel": True}
    sizes = run_on_ranks(
        _rank_training_sizes, 2, args=(str(tmp_path / "run"), sections, cache), timeout=300
    )
    layers, h, ffn, r = 4, 32, 64, LORA["rank"]
    qkv_out = (4 + 2 * 2) * (h // 4)
    per_rank = layers * (r * h + qkv_out // 2 * r + r * ffn // 2 + h * r)
    for rank_sizes in sizes:
        assert rank_sizes == {
            "trainable": per_rank,
            "buffers": per_rank,
            "masters": per_rank,  # DP=1: nothing to shard
            "adam_bytes": 2 * 4 * per_rank,
        }


def test_resume_refuses_a_checkpoint_of_other_lora_options(tmp_path):
    """Checked from the checkpoint's recorded LoRA options before any tensor is read."""
    from shardwork.trainer.run.checkpointing import ResumeError

    short = dict(
        schedule={"train_steps": 2, "warmup_steps": 1}, eval={"interval": None, "at_end": False}
    )
    saved = train(tiny_config(tmp_path / "a", peft=LORA, checkpoint={"save_at_end": True}, **short))
    resume = {"resume": saved.checkpoint}
    longer = dict(short, schedule={"train_steps": 4, "warmup_steps": 1})
    with pytest.raises(ResumeError, match=r"rank: saved 4, model 8; resume with the \[peft\]"):
        train(tiny_config(tmp_path / "b", peft=LORA | {"rank": 8}, checkpoint=resume, **longer))
    with pytest.raises(ResumeError, match=r"holds LoRA adapters only .* no \[peft\] section"):
        train(tiny_config(tmp_path / "c", checkpoint=resume, **longer))


def _train_and_export(run_dir, sections, cache):
    import os

    os.environ["SHARDWORK_CACHE"] = cache
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    result = train(tiny_config(run_dir, world_size=world, **sections))
    return result.hf_export, result.peft_export


@pytest.mark.multirank
def test_tp2_lora_fine_tune_exports_merged_model_and_peft_adapter(
    tmp_path, tmp_path_factory, folder
):
    """hf_init + LoRA at TP=2+SP fine-tunes, then writes the merged model (hf_export) and the
    adapters (peft.export). transformers' plain model on the merged folder and peft's adapter
    on the original folder compute the same logits, which differ from the untrained base."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cache = str(tmp_path_factory.getbasetemp() / "corpus")
    sections = _multirank_sections(hf_init=folder)
    sections["checkpoint"] |= {"hf_export": str(tmp_path / "merged")}
    sections["peft"] = dict(LORA, export=str(tmp_path / "adapter"))
    sections["parallel"] = {"tp": 2, "sequence_parallel": True}
    (paths, _) = run_on_ranks(
        _train_and_export, 2, args=(str(tmp_path / "run"), sections, cache), timeout=300
    )
    assert paths == (str(tmp_path / "merged"), str(tmp_path / "adapter"))

    def load(path):
        auto = transformers.AutoModelForCausalLM
        return auto.from_pretrained(path, dtype=torch.float64).eval()

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = load(folder)(ids).logits
        merged = load(tmp_path / "merged")(ids).logits
        adapted = peft.PeftModel.from_pretrained(load(folder), tmp_path / "adapter")(ids).logits
    # The merged weights were rounded to fp32 once (W + s·BA), peft adds s·B(Ax) in fp64 from
    # the fp32 factors: measured |merged - adapted| = 5.7e-8 at logits of size ~0.4, while
    # training moved them by 0.38 (a lost or mis-scaled adapter fails by orders of magnitude).
    assert (adapted - base).abs().max() > 0.05
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.multirank
def test_lora_run_starts_from_a_peft_folder(tmp_path, folder):
    """peft.init: adapters that peft itself made (independent A per projection, q and v but not
    k, so shardwork holds them as a rank-2r block) start the run: step 0's loss equals the
    cross entropy of the PeftModel's logits on the run's first batch, on one process and at
    PP=2. Validation names the LoRA
    options to write when the section's differ from the folder's."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    made = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False,  # random B: a zero B would hide a lost adapter
    )
    with_adapter = peft.get_peft_model(hf, made).eval()
    with_adapter.save_pretrained(tmp_path / "adapter")
    common = dict(
        schedule={"train_steps": 1, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        checkpoint={"hf_init": folder, "save_at_end": False},
    )
    wrong = dict(LORA, init=str(tmp_path / "adapter"))
    with pytest.raises(ConfigError, match=r"holds adapters with other LoRA options \(rank, alpha"):
        tiny_config(tmp_path / "bad", **common, peft=wrong)
    _, found = import_peft(tmp_path / "adapter", gpt_config_from_hf(read_hf_config(folder)))
    assert found.rank == 8  # q and v: two independent A's, one rank-2r block
    section = {
        "method": "lora",
        "init": str(tmp_path / "adapter"),
        "rank": found.rank,
        "alpha": found.alpha,
        "target_modules": found.target_modules,
    }
    config = tiny_config(tmp_path / "run", **common, peft=section)
    result = train(config)
    # Two pipeline stages: each reads the folder and keeps its own layer's adapters.
    cache = os.environ["SHARDWORK_CACHE"]
    staged = dict(common, peft=section, parallel={"pp": 2})
    (pp_losses, _) = run_on_ranks(
        _train_lora, 2, args=(str(tmp_path / "pp2"), staged, cache), timeout=300
    )
    rows = torch.cat(first_global_batch(config))
    with torch.no_grad():
        logits = with_adapter(rows[:, :-1]).logits
        with with_adapter.disable_adapter():  # the same modules with the adapters off
            base_logits = with_adapter(rows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    base = torch.nn.functional.cross_entropy(base_logits.flatten(0, 1), rows[:, 1:].flatten())
    assert abs(float(expected) - float(base)) > 1e-3  # the adapters change the loss
    assert result.train_losses[0] == pytest.approx(float(expected), rel=1e-5)
    assert pp_losses[0] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.slow
def test_lora_example_runs_under_torchrun(tmp_path):
    """examples/cpu/tiny-lora.toml (TP=2+SP) on 2 processes through torch.distributed.run,
    shortened to 3 steps: it exits 0, logs finite losses, and its final checkpoint holds the
    adapters of the four targeted linears and no base weight."""
    example = Path(__file__).resolve().parents[3] / "examples" / "cpu" / "tiny-lora.toml"
    assert re.search(r"^# world_size = 2$", example.read_text(), re.M)
    run_dir = tmp_path / "run"
    overrides = {
        "schedule.train_steps": "3",
        "schedule.warmup_steps": "1",
        "eval.interval": "3",
        "eval.steps": "1",
        "logging.interval": "1",
        "logging.run_dir": str(run_dir),
        "logging.plot": "false",
        "logging.tensorboard": "false",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "shardwork.trainer", "--config", str(example)]
    command += [part for key, value in overrides.items() for part in (f"--{key}", value)]
    env = {**os.environ, "SHARDWORK_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(tp=2 pp=1 cp=1 ep=1 dp=1)" in out.stderr
    train_records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in train_records)
    final = run_dir / "checkpoints" / "step_000000003"
    keys = FileSystemReader(str(final)).read_metadata().state_dict_metadata
    model_keys = {k for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))}
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in model_keys}
    assert model_keys and all(is_lora_key(k) for k in model_keys), sorted(model_keys)[:4]
    assert adapted == {"linear_qkv", "linear_proj", "fc1", "fc2"}
