"""Hugging Face bridge usability, with transformers as the oracle (tiny random-weight models):

- token ids and ``generation_config.json`` survive import and export (a reloaded model's
  ``generate()`` stops at the EOS), and bad ids are refused naming the field;
- ``from_pretrained`` builds this rank's stage at any pipeline layout in one call (PP=2,
  TP=2×PP=2 logits equal transformers');
- ``hf_outputs`` returns transformers' ``logits``, ``hidden_states`` and ``router_logits`` (and
  the chosen experts) for a dense Llama and Mixtral / Qwen3-MoE at world 1 and TP=2+SP;
- the model comes back in eval mode, and ``.train()`` turns dropout on.

Tolerances: float results are compared with ``assert_close_at_scale`` at ``_ULPS`` fp32 ulps of
the tensor's max|ref|. Measured over world 1, TP=2+SP, PP=2 and TP=2×PP=2 with
``ATEN_CPU_CAPABILITY`` default, avx2 and avx512: logits <= 4.0, hidden states <= 3.8, router
logits <= 3.4 ulps (the two implementations sum attention and MLP products in different
orders). Integer things (expert choices, token ids) are compared exactly.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwork.models import GPTModel, TokenIds, gather_logits  # noqa: E402
from shardwork.models.hf import (  # noqa: E402
    from_pretrained,
    gpt_config_from_hf,
    hf_outputs,
    save_pretrained,
)
from shardwork.models.pipeline import GPTStage  # noqa: E402
from shardwork.parallel_state import ParallelConfig, init_process_groups  # noqa: E402
from shardwork.parallel_state.testing import assert_close_at_scale, run_on_ranks  # noqa: E402

# Golden / cross-implementation: CI reruns these with other CPU kernels (.ci/run).
pytestmark = pytest.mark.golden

_ULPS = 16  # 4x the largest measured error (4.0 ulps of max|ref|, logits)
_COMMON = dict(
    vocab_size=250,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_FAMILIES = {
    "llama": dict(intermediate_size=96, num_hidden_layers=3),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(
        intermediate_size=96,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,
    ),
}


def _hf_model(model_type: str, **changes):
    """A tiny transformers model with random non-default weights (norms away from 1)."""
    cfg = transformers.AutoConfig.for_model(
        model_type, **(_COMMON | _FAMILIES[model_type] | changes)
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if name.endswith("gate.weight") else 0.05
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model


def _ids():
    return torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))


def _reference(model):
    """transformers' logits, hidden states, router logits and sorted router indices."""
    indices = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: indices.append(out[2].sort(-1).values))
        for name, m in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    moe = hasattr(model.config, "num_experts_per_tok")
    with torch.no_grad():
        out = model(_ids(), output_hidden_states=True, output_router_logits=moe)
    for h in hooks:
        h.remove()
    return {
        "logits": out.logits,
        "hidden_states": out.hidden_states,
        "router_logits": out.router_logits if moe else None,
        "router_choices": tuple(indices) if moe else None,
    }


def _check(ours, ref) -> None:
    assert_close_at_scale(ours.logits, ref["logits"], ulps=_ULPS, name="logits")
    assert len(ours.hidden_states) == len(ref["hidden_states"])
    for i, (a, b) in enumerate(zip(ours.hidden_states, ref["hidden_states"], strict=True)):
        assert_close_at_scale(a, b, ulps=_ULPS, name=f"hidden_states[{i}]")
    if ref["router_logits"] is None:
        assert ours.router_logits == () and ours.router_choices == ()
        return
    assert len(ours.router_logits) == len(ref["router_logits"]) > 0
    for i, (a, b) in enumerate(zip(ours.router_logits, ref["router_logits"], strict=True)):
        assert_close_at_scale(a, b, ulps=_ULPS, name=f"router_logits[{i}]")
    for a, b in zip(ours.router_choices, ref["router_choices"], strict=True):
        assert torch.equal(a, b)


def _folder(tmp_path, model_type, **changes):
    model = _hf_model(model_type, **changes)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    return folder, model


# ---- token ids and generation config ------------------------------------------------------


def test_token_ids_and_generation_config_survive_import_and_export(tmp_path):
    folder, _ = _folder(tmp_path, "llama", bos_token_id=5, eos_token_id=[7, 9], pad_token_id=3)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["temperature"] = 0.6  # a sampling default the export must keep
    (folder / "generation_config.json").write_text(json.dumps(generation))

    model = from_pretrained(folder)
    assert model.token_ids == TokenIds(bos=5, eos=(7, 9), pad=3, generation_config=generation)
    save_pretrained(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert (back.config.bos_token_id, back.config.eos_token_id, back.config.pad_token_id) == (
        5,
        [7, 9],
        3,
    )
    assert back.generation_config.eos_token_id == [7, 9]
    assert back.generation_config.temperature == 0.6


def test_generate_on_an_export_stops_at_eos(tmp_path):
    """The issue's case: a folder without generation_config.json (DeepSeek-like ids 1/2 that
    differ from transformers' defaults) exports ids that ``generate()`` obeys."""
    ref = _hf_model("llama", bos_token_id=None, eos_token_id=None)
    prompt = _ids()[:1, :4]
    free = ref.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
    eos = int(free[0, 4 + 2])  # the third greedy token becomes the EOS
    ref.config.bos_token_id, ref.config.eos_token_id = 1, eos
    ref.generation_config.bos_token_id = 1
    ref.generation_config.eos_token_id = eos
    ref.save_pretrained(tmp_path / "in")
    (tmp_path / "in" / "generation_config.json").unlink()

    model = from_pretrained(tmp_path / "in")
    assert model.token_ids == TokenIds(bos=1, eos=eos, pad=None)
    save_pretrained(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written == {"bos_token_id": 1, "eos_token_id": eos}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    stopped = back.generate(prompt, max_new_tokens=6, do_sample=False)
    # the prompt, two tokens, then the EOS, where the free run had gone on to six
    assert stopped.shape[1] == free.shape[1] - 3 and int(stopped[0, -1]) == eos
    assert torch.equal(stopped, free[:, : 4 + 3])


def test_model_without_token_ids_writes_none(tmp_path):
    folder, _ = _folder(tmp_path, "llama")
    model = GPTModel(gpt_config_from_hf(json.loads((folder / "config.json").read_text())))
    assert model.token_ids is None
    save_pretrained(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not {"bos_token_id", "eos_token_id", "pad_token_id"} & written.keys()
    assert not (tmp_path / "out" / "generation_config.json").exists()


@pytest.mark.parametrize(("field", "value"), [("bos_token_id", "<s>"), ("eos_token_id", [2, -1])])
def test_bad_token_ids_are_refused(tmp_path, field, value):
    folder, _ = _folder(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(ValueError, match=rf"config\.json: TokenIds\.{field[:3]}="):
        from_pretrained(folder)
    with pytest.raises(ValueError, match=r"TokenIds\.pad=True"):
        TokenIds(pad=True)  # a bool is not token id 1


# ---- train/eval mode ----------------------------------------------------------------------


def test_from_pretrained_returns_eval_mode_and_train_turns_dropout_on(tmp_path):
    folder, ref = _folder(tmp_path, "llama")
    model = from_pretrained(folder, hidden_dropout=0.2, attention_dropout=0.2)
    assert not model.training and not any(m.training for m in model.modules())
    with torch.no_grad():  # eval: dropout off, so the checkpoint's own logits
        logits = gather_logits(model(_ids()), tp_group=None, vocab_size=250)
    assert_close_at_scale(logits, _reference(ref)["logits"], ulps=_ULPS, name="eval logits")
    model.train()
    with torch.no_grad():
        a, b = model(_ids()), model(_ids())
    assert not torch.equal(a, b)  # fresh dropout masks on every call
    # hf_outputs runs in eval mode (the same logits, bit for bit) and restores training mode
    assert torch.equal(hf_outputs(model, _ids()).logits, logits)
    assert model.training and all(m.training for m in model.modules())


# ---- hf_outputs and one-call import, world 1 and TP=2 ---------------------------------------


@pytest.mark.parametrize("model_type", sorted(_FAMILIES))
def test_hf_outputs_world1_match_transformers(tmp_path, model_type):
    folder, ref = _folder(tmp_path, model_type)
    model = from_pretrained(folder)
    _check(
        hf_outputs(model, _ids(), output_hidden_states=True, output_router_logits=True),
        _reference(ref),
    )


def _tp2_outputs(folders, refs):
    groups = init_process_groups(ParallelConfig(tp=2))
    for folder, ref in zip(folders, refs, strict=True):
        model = from_pretrained(folder, groups, sequence_parallel=True)
        out = hf_outputs(model, _ids(), output_hidden_states=True, output_router_logits=True)
        _check(out, ref)
    return True


@pytest.mark.multirank
def test_hf_outputs_tp2_sp_match_transformers(tmp_path):
    pairs = [_folder(tmp_path, t) for t in sorted(_FAMILIES)]
    refs = [_reference(model) for _, model in pairs]
    assert all(run_on_ranks(_tp2_outputs, 2, args=([str(f) for f, _ in pairs], refs)))


# ---- one call at any pipeline layout ------------------------------------------------------


def _pipeline_logits(folder, parallel_kwargs):
    groups = init_process_groups(ParallelConfig(**parallel_kwargs))
    # this rank's stage, its shards only; Llama's 3 layers split unevenly (1 + 2)
    uneven = {"first_stage_layers": 1} if "llama" in folder else {}
    model = from_pretrained(folder, groups, **uneven)
    assert isinstance(model, GPTStage) and not model.training
    with pytest.raises(ValueError, match=r"output_hidden_states=True.*pp=2"):
        hf_outputs(model, _ids(), output_hidden_states=True)
    out = hf_outputs(model, _ids())
    return None if out is None else out.logits


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("model_type", "kwargs", "world"),
    [
        ("llama", {"pp": 2}, 2),
        ("qwen3_moe", {"pp": 2}, 2),
        ("llama", {"tp": 2, "pp": 2}, 4),
    ],
    ids=["llama-pp2", "qwen3moe-pp2", "llama-tp2-pp2"],
)
def test_from_pretrained_at_pipeline_layout_matches_transformers(
    tmp_path, model_type, kwargs, world
):
    folder, ref = _folder(tmp_path, model_type)
    results = run_on_ranks(_pipeline_logits, world, args=(str(folder), kwargs), timeout=400)
    # ranks are numbered with pp outermost: the last world/pp ranks are the last stage
    last = world // kwargs["pp"]
    assert all(r is None for r in results[:-last])
    for logits in results[-last:]:
        assert_close_at_scale(logits, _reference(ref)["logits"], ulps=_ULPS, name="logits")


def test_from_pretrained_refuses_virtual_pipeline_stages(tmp_path):
    folder, _ = _folder(tmp_path, "llama")
    # only the layout's vpp is read before anything is built, so no process group is needed
    groups = types.SimpleNamespace(config=ParallelConfig(pp=2, vpp=2))
    with pytest.raises(ValueError, match=r"vpp=2.*build_model_chunks"):
        from_pretrained(folder, groups)


def _cp2_refused(folder):
    groups = init_process_groups(ParallelConfig(cp=2))
    model = from_pretrained(folder, groups)
    with pytest.raises(ValueError, match="cp=2, use cp=1"):
        hf_outputs(model, _ids())
    return True


@pytest.mark.multirank
def test_hf_outputs_refuses_context_parallel(tmp_path):
    folder, _ = _folder(tmp_path, "llama")
    assert all(run_on_ranks(_cp2_refused, 2, args=(str(folder),)))


def test_hf_outputs_refuses_a_partial_model_at_pp1(tmp_path):
    folder, _ = _folder(tmp_path, "llama")
    first_layers = from_pretrained(folder, layer_range=(0, 2))  # no final norm and head
    with pytest.raises(ValueError, match="post_process=False"):
        hf_outputs(first_layers, _ids())
