"""Config: TOML loading, CLI overrides, whole-config validation (a table of bad inputs)."""

import dataclasses
import importlib.util

import pytest

from shardwork.trainer.config.cli import parse_train_args
from shardwork.trainer.config.load import ConfigError, config_from_dict, config_to_toml, load_config
from shardwork.trainer.config.sections import ModelSection, TrainConfig
from shardwork.trainer.config.validate import validate_config
from shardwork.trainer.model_factory import gpt_config


def _with(**sections):
    """TrainConfig with fields replaced: _with(optimizer={"lr": 0})."""
    config = TrainConfig()
    for name, values in sections.items():
        if name == "model":  # the [model] table: a preset and GPTConfig settings
            settings = {k: v for k, v in values.items() if k != "preset"}
            model = ModelSection(preset=values.get("preset"), settings=settings)
            config = dataclasses.replace(config, model=model)
        elif isinstance(values, dict):
            config = dataclasses.replace(
                config, **{name: dataclasses.replace(getattr(config, name), **values)}
            )
        else:
            config = dataclasses.replace(config, **{name: values})
    return config


def test_defaults_are_valid_and_resolved(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    resolved = validate_config(TrainConfig(), world_size=1)
    assert (
        resolved.model.settings["num_layers"] == 4 and resolved.model.settings["vocab_size"] == 257
    )
    assert resolved.logging.run_dir == "runs/demo"
    assert resolved.checkpoint.dir == "runs/demo/checkpoints"


def test_toml_roundtrip(tmp_path):
    config = _with(
        optimizer={"lr": 3e-4, "weight_decay_end": None},
        schedule={"batch_size_ramp": [(0, 4), (10, 16)], "lr_schedule": "wsd"},
        model={"rope_theta": 500000.0, "qk_layernorm": True, "moe": {"router": {"top_k": 4}}},
        eval={"interval": None},
    )
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_cli_overrides_win_over_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optimizer]\nlr = 0.1\nbeta2 = 0.99\n[schedule]\ntrain_steps = 7\n")
    config, show = parse_train_args(
        ["--config", str(path), "--optimizer.lr", "3e-4", "--eval.at_end", "false"]
    )
    assert config.optimizer.lr == 3e-4 and config.optimizer.beta2 == 0.99
    assert config.schedule.train_steps == 7 and config.eval.at_end is False and not show
    _, show = parse_train_args(["--print-config"])
    assert show


def test_model_flags_set_nested_fields_over_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[model]\npreset = "tiny-mixtral-8x7b"\n'
        "[model.moe.router]\naux_loss_coeff = 0.1\nz_loss_coeff = 0.002\n"
    )
    flags = ["--model.moe.router.aux_loss_coeff", "0.01", "--model.num_layers=3"]
    flags += ["--model.moe.layer_freq", "[1, 0, 1]", "--model.hidden_size", "32"]
    config, _ = parse_train_args(["--config", str(path), *flags])
    assert config.model.settings == {
        "moe": {"router": {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.002}, "layer_freq": [1, 0, 1]},
        "num_layers": 3,
        "hidden_size": 32,
    }
    model = gpt_config(validate_config(config, world_size=1))
    router = model.moe.router
    assert (router.aux_loss_coeff, router.z_loss_coeff, router.top_k) == (0.01, 0.002, 2)
    assert model.num_layers == 3 and model.moe.layer_freq == (1, 0, 1)
    # the router reads the hidden states: a new model width reaches it
    assert model.hidden_size == router.hidden_size == 32


def test_the_fused_loss_is_on_by_default_and_a_model_flag_turns_it_off():
    on = gpt_config(validate_config(config_from_dict({}), world_size=1))
    config, _ = parse_train_args(["--model.fused_linear_cross_entropy", "false"])
    off = gpt_config(validate_config(config, world_size=1))
    assert on.fused_linear_cross_entropy is True and off.fused_linear_cross_entropy is False


def test_a_moe_table_on_a_dense_model_builds_the_moe_config():
    table = {
        "model": {"num_layers": 2, "moe": {"ffn_hidden_size": 32, "router": {"num_experts": 4}}}
    }
    model = gpt_config(validate_config(config_from_dict(table), world_size=1))
    assert model.moe.router.num_experts == 4 and model.moe.ffn_hidden_size == 32
    # what the table leaves out of the new router comes from the model
    assert (model.moe.router.hidden_size, model.moe.router.init_std) == (128, model.init_method_std)


def test_a_pattern_and_the_mtp_table_it_needs_apply_together():
    """A pattern with an MTP depth is invalid without ``[model.mtp]`` and the other way round:
    the settings apply in one step (the pattern's layers, the MTP depth's attention + MLP)."""
    table = {
        "model": {
            "preset": "tiny-nemotron-h-8b",
            "num_layers": 6,
            "hybrid_layer_pattern": "M-*-M-/*-",
            "mtp": {"num_layers": 1, "loss_coeff": 0.2},
        }
    }
    model = gpt_config(validate_config(config_from_dict(table), world_size=1))
    assert model.hybrid_layer_pattern == "M-*-M-/*-" and model.num_layers == 6
    assert (model.mtp.num_layers, model.mtp.loss_coeff) == (1, 0.2)
    # still checked: a depth count the table does not give is named
    table["model"]["mtp"] = {"num_layers": 2}
    with pytest.raises(ConfigError, match=r"1 MTP depths but mtp.num_layers=2"):
        validate_config(config_from_dict(table), world_size=1)


def test_a_linear_attention_table_builds_the_gated_deltanet_config():
    gdn = {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 16, "value_head_dim": 8}
    model = gpt_config(
        validate_config(config_from_dict({"model": {"linear_attention": gdn}}), world_size=1)
    )
    assert dataclasses.asdict(model.linear_attention) == {
        **gdn,
        "conv_kernel": 4,
        "chunk_size": 64,
        "qk_l2norm_epsilon": 1e-6,
        "kernel_backend": "auto",
    }
    table = {"model": {"linear_attention": gdn}, "parallel": {"cp": 2}}
    with pytest.raises(ConfigError, match=r"do not support context parallelism \(cp=2\)"):
        validate_config(config_from_dict(table), world_size=2)


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla installed here")
def test_a_triton_deltanet_backend_without_fla_is_a_config_error():
    gdn = {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 16, "value_head_dim": 8}
    table = {"model": {"linear_attention": gdn | {"kernel_backend": "triton"}}}
    with pytest.raises(ConfigError, match=r"kernel_backend='triton'.*pip install flash-linear"):
        validate_config(config_from_dict(table), world_size=1)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"optimizer": {"lrr": 1}}, "optimizer.lrr: unknown key; valid keys in [optimizer]: "),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr='fast': invalid type; valid: float"),
        ({"schedule": {"lr_schedule": "step"}}, "valid: one of 'constant', 'linear', 'cosine'"),
        ({"schedule": {"train_steps": 1.5}}, "schedule.train_steps=1.5: invalid type; valid: int"),
        ({"optimizer": 3}, "optimizer=3: must be a table"),
        ({"nonsense": {}}, "nonsense: unknown key"),
        ({"schedule": {"batch_size_ramp": [[1, 2, 3]]}}, "schedule.batch_size_ramp="),
    ],
)
def test_toml_type_errors(table, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(table)
    assert message in str(err.value)


CASES = [
    # (sections, world_size, expected fragment naming field, value and what is valid)
    ({"optimizer": {"lr": 0.0}}, 1, "optimizer.lr=0.0: must be > 0"),
    ({"optimizer": {"min_lr": 1.0}}, 1, "optimizer.min_lr=1.0: must be in [0, optimizer.lr=0.003]"),
    ({"optimizer": {"beta2": 1.0}}, 1, "optimizer.beta2=1.0: must be in [0, 1)"),
    ({"optimizer": {"weight_decay_schedule": "linear"}}, 1, "needs optimizer.weight_decay_end"),
    ({"optimizer": {"name": "sgd"}}, 1, "optimizer.name='sgd': must be 'adamw' or 'muon'"),
    ({"optimizer": {"name": "muon", "muon_lr": 0.0}}, 1, "optimizer.muon_lr=0.0: must be > 0"),
    (
        {"optimizer": {"name": "muon", "muon_momentum": 1.0}},
        1,
        "optimizer.muon_momentum=1.0: must be in [0, 1)",
    ),
    (
        {"optimizer": {"name": "muon", "muon_ns_steps": 0}},
        1,
        "optimizer.muon_ns_steps=0: must be an integer >= 1",
    ),
    (
        {"schedule": {"global_batch_size": 24, "micro_batch_size": 16}},
        1,
        "schedule.global_batch_size=24: must be a multiple of micro_batch_size × dp = 16 × 1 = 16",
    ),
    (
        {"schedule": {"global_batch_size": 16, "micro_batch_size": 4}},
        8,
        "micro_batch_size × dp = 4 × 8 = 32",
    ),
    ({"schedule": {"batch_size_ramp": [(5, 16), (3, 32)]}}, 1, "steps must be >= 0 and increasing"),
    (
        {"schedule": {"warmup_steps": 1000}},
        1,
        "schedule.warmup_steps=1000: must be in [0, train_steps=300]",
    ),
    ({"schedule": {"pipeline_schedule": "interleaved"}}, 1, "needs parallel.vpp > 1"),
    ({"schedule": {"wsd_decay_steps": 5000}}, 1, "schedule.wsd_decay_steps=5000"),
    ({"parallel": {"tp": 3}}, 4, "not divisible by tp*cp*pp"),
    ({"parallel": {"tp": 8}}, 8, "num_attention_heads=4 is not divisible by tp=8"),
    (
        {"parallel": {"sequence_parallel": True}},
        1,
        "parallel.sequence_parallel=True needs parallel.tp > 1",
    ),
    ({"parallel": {"pp": 8}}, 8, "pipeline split of model.num_layers=4"),
    ({"parallel": {"pp": 2, "first_stage_layers": 5}}, 2, "pipeline split of model.num_layers=4"),
    (
        {"parallel": {"pp": 2, "vpp": 2, "first_virtual_stage_layers": 2}},
        2,
        "first_virtual_stage_layers=2 and last_virtual_stage_layers=None: the 2 remaining "
        "layers must split evenly over the 3 other virtual stages",
    ),
    (
        {"parallel": {"pp": 2, "first_stage_layers": 1, "last_virtual_stage_layers": 1}},
        2,
        "exclude each other",
    ),
    (
        {"parallel": {"pp": 2, "vpp": 2}},  # 16 sequences, micro-batches of 16
        2,
        "schedule.global_batch_size=16: with parallel.vpp=2 the 1 micro-batches per step must "
        "be a multiple of parallel.pp=2",
    ),
    (
        {"parallel": {"pp": 2, "mtp_standalone": True}},
        2,
        "parallel.mtp_standalone=True needs a model with multi-token prediction",
    ),
    (
        {"model": {"mtp": {"num_layers": 1}}, "parallel": {"mtp_standalone": True}},
        1,
        "parallel.mtp_standalone=True needs pp >= 2 (the MTP depths get the last pipeline "
        "rank), got pp=1",
    ),
    (
        {
            "model": {"mtp": {"num_layers": 1}},
            "parallel": {"pp": 2, "vpp": 2, "mtp_standalone": True},
        },
        2,
        "parallel.mtp_standalone=True needs vpp=1 or None, got vpp=2",
    ),
    (
        {
            "model": {"mtp": {"num_layers": 1}},
            "parallel": {"pp": 2, "last_stage_layers": 1, "mtp_standalone": True},
        },
        2,
        "parallel.last_stage_layers=1 conflicts with mtp_standalone=True",
    ),
    (
        {"model": {"hidden_size": 102}},
        1,
        "hidden_size=102 is not divisible by num_attention_heads=4",
    ),
    ({"model": {"preset": "gpt-17"}}, 1, "model.preset='gpt-17': unknown preset"),
    (
        {"model": {"moe": {"router": {"aux_loss_coeff": 0.01}}}},
        1,
        "[model.moe]: builds a new MoEConfig (the base model has none) and must set "
        "ffn_hidden_size",
    ),
    (
        {"model": {"preset": "tiny-mixtral-8x7b", "moe": {"router": {"aux_los": 0.01}}}},
        1,
        "model.moe.router.aux_los: unknown key; valid keys in [model.moe.router] (RouterConfig): ",
    ),
    (
        {"model": {"params_dtype": "bf16"}},
        1,
        "model.params_dtype: not set in [model]; it is precision.dtype",
    ),
    (
        {"model": {"preset": "tiny-mixtral-8x7b", "moe": {"router": {"hidden_size": 8}}}},
        1,
        "model.moe.router.hidden_size: not set in [model.moe.router]; it is model.hidden_size",
    ),
    (
        {"model": {"preset": "tiny-mixtral-8x7b", "moe": {"router": {"top_k": "two"}}}},
        1,
        "model.moe.router.top_k='two': invalid type; valid: int",
    ),
    ({"data": {"split": "90,10"}}, 1, "data.split='90,10': must be three non-negative numbers"),
    ({"data": {"split": "100,0,0"}}, 1, "has no validation part but evaluation is on"),
    (
        {"data": {"corpus": "shakespeare"}},
        1,
        "data.corpus='shakespeare': not built in; valid: ['pydoc']",
    ),
    (
        {"data": {"prefixes": ["/nonexistent/x"]}},
        1,
        "'/nonexistent/x' has no /nonexistent/x.bin and /nonexistent/x.idx (build the dataset",
    ),
    ({"data": {"weights": [1.0]}}, 1, "data.weights has 1 entries but data.prefixes has 0"),
    ({"data": {"tokenizer": "/no/tok.json"}}, 1, "data.tokenizer='/no/tok.json': must be 'byte'"),
    ({"checkpoint": {"keep_last": 0}}, 1, "checkpoint.keep_last=0: must be an integer >= 1"),
    (
        {"checkpoint": {"resume": "/no/ckpt"}},
        1,
        "checkpoint.resume='/no/ckpt': must be 'auto', 'none'",
    ),
    ({"eval": {"interval": 0}}, 1, 'eval.interval=0: must be an integer >= 1 or "none"'),
    ({"reliability": {"max_consecutive_skips": 0}}, 1, "reliability.max_consecutive_skips=0"),
    ({"seed": -1}, 1, "seed=-1: must be an integer >= 0"),
    ({"parallel": {"fsdp": "zero3"}}, 2, "parallel.fsdp='zero3': must be one of ['off', 'full'"),
    ({"parallel": {"fsdp_prefetch": -1}}, 2, "parallel.fsdp_prefetch=-1: must be an integer >= 0"),
    (
        {"parallel": {"fsdp": "full"}, "optimizer": {"name": "muon"}},
        2,
        "parallel.fsdp='full' with optimizer.name='muon' is not supported: Muon orthogonalises "
        "whole weight matrices",
    ),
    (
        {"parallel": {"fsdp": "full"}, "peft": {"method": "lora"}},
        2,
        "parallel.fsdp='full' with peft.method='lora' is not supported",
    ),
    (
        {"parallel": {"fsdp": "zero2"}, "precision": {"dtype": "fp16"}},
        2,
        "parallel.fsdp='zero2' with precision.dtype='fp16' is not supported: use 'bf16'",
    ),
    (
        {"parallel": {"fsdp": "full"}},
        1,
        "parallel.fsdp='full' needs torch.distributed with at least 2 ranks (world size 1)",
    ),
    (
        {"parallel": {"fsdp": "full"}, "precision": {"compile": True}},
        2,
        "parallel.fsdp='full' with precision.compile=true is not supported yet",
    ),
    (
        {"parallel": {"fsdp": "full"}, "reliability": {"check_dp_params_interval": 10}},
        2,
        "reliability.check_dp_params_interval=10: under FSDP no two data-parallel ranks hold",
    ),
]


@pytest.mark.parametrize(("sections", "world", "message"), CASES)
def test_validation_errors_name_field_value_and_valid(
    sections, world, message, tmp_path, monkeypatch
):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        validate_config(_with(**sections), world_size=world)
    assert message in str(err.value), str(err.value)


def test_all_problems_reported_together(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        validate_config(_with(optimizer={"lr": -1.0, "eps": 0.0}, seed=-3), world_size=1)
    assert len(err.value.problems) >= 3


def test_a_missing_dataset_names_the_files_that_are_not_there(tmp_path):
    half = tmp_path / "half"
    (tmp_path / "half.bin").write_bytes(b"\0" * 8)  # the index was never written
    blend = tmp_path / "blend.json"
    blend.write_text(f'{{"train": [[1.0, "{tmp_path / "gone"}"]]}}')
    how = "(build the dataset with shardwork-preprocess --output PREFIX)"
    for data, expected in [
        ({"prefixes": [str(half)]}, f"data.prefixes: {str(half)!r} has no {half}.idx {how}"),
        (
            {"data_config": str(blend)},
            f"data.data_config={str(blend)!r}: the 'train' blend names {str(tmp_path / 'gone')!r}"
            f", which has no {tmp_path / 'gone'}.bin and {tmp_path / 'gone'}.idx {how}",
        ),
    ]:
        config = _with(data=data)
        with pytest.raises(ConfigError) as err:
            validate_config(config, world_size=1)
        assert expected in err.value.problems
