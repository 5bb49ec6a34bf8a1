"""PEFT export/import of LoRA adapters, with transformers + peft as the oracle.

- Export: random adapters on every shardwork target (linear_qkv, linear_proj, fc1, fc2); the
  shardwork side merges them in this test (``W += scaling * B @ A`` on the sharded state's
  views) and its logits equal ``PeftModel.from_pretrained(hf_model, folder)``'s (fp64).
- Import: adapters made and saved by peft itself (independent A per projection, rsLoRA, a
  partial target) merged into shardwork the same way give peft's logits.
- The file names what peft's own ``save_pretrained`` writes; export -> import is exact.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from shardwork.models import LoRAConfig, gather_logits, lora_key_names  # noqa: E402
from shardwork.models.hf import export_peft, from_pretrained, import_peft  # noqa: E402

pytestmark = pytest.mark.golden

_V = 250
_COMMON = dict(
    vocab_size=_V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# fp64 weights on both sides, but both stacks build their rotary tables in fp32: the base
# models already differ by up to 7e-8 (measured), the adapted ones by up to 5e-7 at logits of
# size ~1. An adapter error (a wrong row, part or scale) moves logits by > 1e-2 (the adapters
# here move them by > 0.05), so 1e-5 separates the two with room for other CPU kernels.
_TOL = dict(rtol=1e-5, atol=1e-5)


def _hf_folder(family: str, tmp_path):
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))
    else:  # qwen3: QK-norm and a head_dim that is not hidden / heads
        cfg = transformers.Qwen3Config(**_COMMON, head_dim=24, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    folder = tmp_path / family
    model.save_pretrained(folder)
    return folder


def _hf_model(folder, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, **kwargs
    ).eval()


def _ids():
    return torch.randint(0, _V, (2, 12), generator=torch.Generator().manual_seed(1))


def _merged_logits(folder, adapters: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
    """shardwork logits with ``W + scaling * B @ A`` merged into every adapted base weight."""
    model = from_pretrained(folder, params_dtype=torch.float64).eval()
    with torch.no_grad():
        for key, st in model.sharded_state_dict().items():
            if ".weight" not in key:
                continue
            a_key, b_key = lora_key_names(key)
            if b_key in adapters:
                st.data.add_(scaling * adapters[b_key] @ adapters[a_key])
        return gather_logits(model(_ids()), tp_group=None, vocab_size=_V)


def _random_adapters(folder, lora: LoRAConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random non-zero adapters on every linear of the model that ``lora`` targets."""
    model = from_pretrained(folder, params_dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, st in model.sharded_state_dict().items():
        prefix = key.partition(".weight")[0]
        if ".weight" not in key or key.endswith("norm.weight") or not lora.matches(prefix):
            continue
        a_key, b_key = lora_key_names(key)
        rows, cols = st.global_shape
        if a_key not in out:
            out[a_key] = 0.2 * torch.randn(lora.rank, cols, generator=gen, dtype=torch.float64)
        out[b_key] = 0.2 * torch.randn(rows, lora.rank, generator=gen, dtype=torch.float64)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_export_loads_in_peft_with_merged_logits(family, use_rslora, tmp_path):
    folder = _hf_folder(family, tmp_path)
    lora = LoRAConfig(rank=4, alpha=8.0, use_rslora=use_rslora)
    adapters = _random_adapters(folder, lora, seed=2)
    assert {k.split(".")[4] for k in adapters} == {"linear_qkv", "linear_proj", "fc1", "fc2"}
    config = from_pretrained(folder).config
    export_peft(adapters, lora, config, tmp_path / "adapter", base_model_name_or_path=str(folder))
    expected = _merged_logits(folder, adapters, lora.scaling)
    hf = _hf_model(folder)
    with torch.no_grad():
        base = hf(_ids()).logits
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(_ids()).logits
    assert (expected - base).abs().max() > 0.05  # the adapters change the logits
    torch.testing.assert_close(got, expected, **_TOL)


def test_export_of_some_layers_names_full_modules(tmp_path):
    folder = _hf_folder("llama", tmp_path)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=r"decoder\.layers\.1\..*")
    adapters = _random_adapters(folder, lora, seed=10)
    export_peft(adapters, lora, from_pretrained(folder).config, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_modules"] == [
        f"model.layers.1.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    hf = _hf_model(folder)
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(_ids()).logits
    torch.testing.assert_close(got, _merged_logits(folder, adapters, lora.scaling), **_TOL)


def test_export_writes_what_peft_writes(tmp_path):
    folder = _hf_folder("llama", tmp_path)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=_ALL, init_lora_weights=False, task_type="CAUSAL_LM"
    )
    peft.get_peft_model(_hf_model(folder), config).save_pretrained(tmp_path / "by_peft")
    lora = LoRAConfig(rank=4, alpha=8)
    export_peft(
        _random_adapters(folder, lora, 3), lora, from_pretrained(folder).config, tmp_path / "ours"
    )
    from safetensors import safe_open

    shapes = {}
    for name in ("by_peft", "ours"):
        with safe_open(tmp_path / name / "adapter_model.safetensors", "pt") as f:
            shapes[name] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["ours"] == shapes["by_peft"]
    theirs = json.loads((tmp_path / "by_peft" / "adapter_config.json").read_text())
    ours = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    for field in ("peft_type", "task_type", "r", "lora_alpha", "use_rslora", "lora_dropout"):
        assert ours[field] == theirs[field], field
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


def _peft_folder(folder, out, targets, use_rslora=False, seed=4):
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        init_lora_weights=False,  # random B as well as A: the adapters change the logits
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(_hf_model(folder), config).eval()
    model.save_pretrained(out)
    with torch.no_grad():
        return model(_ids()).logits


@pytest.mark.parametrize(
    ("family", "targets", "use_rslora", "k"),
    [
        ("llama", _ALL, False, 3),
        ("qwen3", _ALL, True, 3),
        ("llama", ["q_proj", "v_proj", "down_proj"], False, 2),
        ("qwen3", ["gate_proj", "o_proj"], True, 1),
    ],
)
def test_import_of_a_peft_adapter_gives_peft_logits(family, targets, use_rslora, k, tmp_path):
    folder = _hf_folder(family, tmp_path)
    expected = _peft_folder(folder, tmp_path / "adapter", targets, use_rslora)
    adapters, lora = import_peft(tmp_path / "adapter", from_pretrained(folder).config)
    # the rank-k r rule: k = the most parts of one fused block that peft targeted
    assert lora.rank == 4 * k
    assert lora.alpha == pytest.approx(8 * (math.sqrt(k) if use_rslora else k), rel=1e-15)
    assert lora.scaling == pytest.approx(8 / (2 if use_rslora else 4), rel=1e-15)
    with torch.no_grad():
        base = _hf_model(folder)(_ids()).logits
    got = _merged_logits(folder, adapters, lora.scaling)
    assert (expected - base).abs().max() > 0.05
    torch.testing.assert_close(got, expected, **_TOL)


def test_import_block_layout_is_exact(tmp_path):
    folder = _hf_folder("llama", tmp_path)
    _peft_folder(folder, tmp_path / "adapter", ["q_proj", "v_proj"])
    adapters, lora = import_peft(tmp_path / "adapter", from_pretrained(folder).config)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.{}_proj.lora_{}.weight"
    prefix = "decoder.layers.1.self_attention.linear_qkv"
    a = torch.cat([saved[name.format("q", "A")], saved[name.format("v", "A")]])
    assert torch.equal(adapters[f"{prefix}.lora_A.weight"], a)
    b_q = torch.cat([saved[name.format("q", "B")], torch.zeros(64, 4)], dim=1)
    b_v = torch.cat([torch.zeros(32, 4), saved[name.format("v", "B")]], dim=1)
    assert torch.equal(adapters[f"{prefix}.lora_B.weight.q"], b_q)
    assert torch.equal(adapters[f"{prefix}.lora_B.weight.k"], torch.zeros(32, 8))
    assert torch.equal(adapters[f"{prefix}.lora_B.weight.v"], b_v)
    assert lora.target_modules == ("linear_qkv",)


@pytest.mark.parametrize(
    "lora",
    [
        LoRAConfig(rank=4, alpha=8.0, dropout=0.1),
        LoRAConfig(rank=3, alpha=5.0, use_rslora=True, target_modules=("linear_qkv", "fc2")),
        LoRAConfig(rank=2, alpha=3.0, target_modules=r"decoder\.layers\.1\.mlp\.fc1"),
    ],
)
def test_export_import_round_trip_is_exact(lora, tmp_path):
    folder = _hf_folder("qwen3", tmp_path)
    config = from_pretrained(folder).config
    adapters = {k: v.float() for k, v in _random_adapters(folder, lora, 5).items()}
    export_peft(adapters, lora, config, tmp_path / "adapter")
    back, lora_back = import_peft(tmp_path / "adapter", config)
    assert lora_back == lora
    assert sorted(back) == sorted(adapters)
    for key, tensor in adapters.items():
        assert torch.equal(back[key], tensor), key


def _moe_folder(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    folder = tmp_path / "qwen3_moe"
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    return folder


_MOE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.mark.parametrize("targets", [_MOE_TARGETS, ("linear_fc1", "linear_fc2")])
def test_moe_export_with_experts_gives_peft_logits(targets, tmp_path):
    folder = _moe_folder(tmp_path)
    config = from_pretrained(folder).config
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    adapters = _random_adapters(folder, lora, seed=6)
    assert "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight.3.up" in adapters
    export_peft(adapters, lora, config, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    hf = _hf_model(folder, experts_implementation="eager")  # grouped_mm has no fp64
    with torch.no_grad():
        base = hf(_ids()).logits
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(_ids()).logits
    expected = _merged_logits(folder, adapters, lora.scaling)
    assert (expected - base).abs().max() > 0.05
    torch.testing.assert_close(got, expected, **_TOL)

    back, lora_back = import_peft(tmp_path / "adapter", config)
    assert lora_back == lora
    assert sorted(back) == sorted(adapters)
    assert all(torch.equal(back[k], v) for k, v in adapters.items())


@pytest.mark.parametrize("params", [["gate_up_proj", "down_proj"], ["down_proj"]])
def test_moe_import_of_peft_expert_adapters_gives_peft_logits(params, tmp_path):
    folder = _moe_folder(tmp_path)
    torch.manual_seed(9)
    by_peft = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=[f"mlp.experts.{p}" for p in params],
        init_lora_weights=False,
    )
    model = peft.get_peft_model(_hf_model(folder, experts_implementation="eager"), by_peft)
    model.eval().save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = model(_ids()).logits
    adapters, lora = import_peft(tmp_path / "adapter", from_pretrained(folder).config)
    fc = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}
    assert lora.target_modules == ("linear_qkv", *(fc[p] for p in params))
    assert (lora.rank, lora.alpha) == (8, 16)  # q and v with independent A: rank 2r
    torch.testing.assert_close(_merged_logits(folder, adapters, lora.scaling), expected, **_TOL)


def test_moe_refusals(tmp_path):
    folder = _moe_folder(tmp_path)
    config = from_pretrained(folder).config
    lora = LoRAConfig(rank=4, dropout=0.1, target_modules=("linear_fc2",))
    with pytest.raises(ValueError, match=r"dropout=0.1 cannot be exported with routed-expert"):
        export_peft(_random_adapters(folder, lora, 7), lora, config, tmp_path / "experts")
    assert not (tmp_path / "experts").exists()  # nothing half-written

    by_peft = peft.LoraConfig(r=4, target_parameters=["self_attn.o_proj.weight"])
    peft.get_peft_model(_hf_model(folder), by_peft).save_pretrained(tmp_path / "param")
    with pytest.raises(ValueError, match=r"target_parameters=\['self_attn.o_proj.weight'\]"):
        import_peft(tmp_path / "param", config)


def test_import_refuses_what_shardwork_cannot_express(tmp_path):
    folder = _hf_folder("llama", tmp_path)
    config = from_pretrained(folder).config
    head = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    with_head = peft.get_peft_model(_hf_model(folder), head)
    with_head.save_pretrained(tmp_path / "head", save_embedding_layers=False)
    with pytest.raises(ValueError, match=r"\['lm_head'\] \(1 modules\) have no shardwork linear"):
        import_peft(tmp_path / "head", config)
    with_head.save_pretrained(tmp_path / "head_saved")  # peft adds lm_head's base weight
    with pytest.raises(ValueError, match=r"'base_model.model.lm_head.base_layer.weight' is not"):
        import_peft(tmp_path / "head_saved", config)

    dora = peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    peft.get_peft_model(_hf_model(folder), dora).save_pretrained(tmp_path / "dora")
    with pytest.raises(ValueError, match=r"use_dora=True is not supported .* valid: False"):
        import_peft(tmp_path / "dora", config)

    _peft_folder(folder, tmp_path / "partial", ["q_proj"])
    (tmp_path / "partial" / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match=r"adapter_config.json is missing"):
        import_peft(tmp_path / "partial", config)
    with pytest.raises(ValueError, match=r"adapter_config.json is missing"):
        import_peft(tmp_path / "nowhere", config)
    (tmp_path / "dora" / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is missing"):
        import_peft(tmp_path / "dora", config)


def test_export_refuses_bad_adapters_before_writing(tmp_path):
    folder = _hf_folder("llama", tmp_path)
    config = from_pretrained(folder).config
    lora = LoRAConfig(rank=4)
    adapters = _random_adapters(folder, lora, seed=8)
    key = "decoder.layers.0.self_attention.linear_qkv.lora_B.weight.k"
    with pytest.raises(
        ValueError, match=r"linear_qkv.lora_B.weight.k'\] has shape \(32, 3\), expected \(32, 4\)"
    ):
        export_peft(adapters | {key: adapters[key][:, :3]}, lora, config, tmp_path / "a")
    with pytest.raises(
        ValueError, match=r"has no 'decoder.layers.0.self_attention.linear_qkv.lora_B.weight.k'"
    ):
        export_peft({k: v for k, v in adapters.items() if k != key}, lora, config, tmp_path / "a")
    with pytest.raises(ValueError, match=r"name no linear with a PEFT counterpart"):
        export_peft(
            adapters | {"output_layer.lora_A.weight": adapters[key]}, lora, config, tmp_path / "a"
        )
    assert not (tmp_path / "a").exists()
