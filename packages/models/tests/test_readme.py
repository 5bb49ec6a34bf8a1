"""The README's fine-tuning and interop example runs as written on one process, and what it
writes is what it says: an adapters-only checkpoint, a PEFT folder and a merged export on
which peft and transformers compute the LoRA model's logits, and a Megatron-Core folder that
imports back to the same base weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from shardwork.models.full_state import full_state_dict
from shardwork.models.lora import is_base_key, is_lora_key
from shardwork.parallel_state.testing import assert_close_at_scale

pytestmark = pytest.mark.golden

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Fine-tuning and interop"


def _example() -> str:
    text = README.read_text()
    assert SECTION in text, f"{README} has no {SECTION!r} section"
    return re.search(r"```python\n(.*?)```", text[text.index(SECTION) :], re.S).group(1)


def test_interop_example_runs_and_its_outputs_load_elsewhere(capsys):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    scope: dict = {"__name__": "readme"}
    exec(compile(_example(), str(README), "exec"), scope)
    model, work, out, ids = scope["model"], scope["work"], scope["out"], scope["ids"]
    vocab, layers = model.config.vocab_size, model.config.num_layers
    assert capsys.readouterr().out.strip() == f"torch.Size([2, 16, {vocab}]) {layers + 1}"

    stored = FileSystemReader(str(work / "adapters")).read_metadata().state_dict_metadata
    tensors = {k for k in stored if not k.startswith("_shardwork/")}  # bookkeeping objects
    assert tensors == set(full_state_dict(model, keys=is_lora_key))

    auto = transformers.AutoModelForCausalLM
    with torch.no_grad():
        base = auto.from_pretrained(work / "hf").eval()
        plain = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, work / "peft")(ids).logits
        merged = auto.from_pretrained(work / "merged").eval()(ids).logits
    # fp32 on both sides. peft adds s·B(A x) as shardwork's unmerged forward does (measured
    # difference 0.0); the merged export folds s·B A into W (measured 6.7 fp32 ulps of
    # max|logit|). Bound 32 ulps (~3e-6 here); the adapters move the logits by 0.76.
    assert (out.logits - plain).abs().max() > 1e-2
    assert_close_at_scale(adapted, out.logits, rtol=0, ulps=32, name="peft logits")
    assert_close_at_scale(merged, out.logits, rtol=0, ulps=32, name="merged export logits")

    base_weights = full_state_dict(model, keys=is_base_key)  # the kept base, not merged
    for key, value in full_state_dict(scope["again"]).items():
        assert torch.equal(value, base_weights[key]), key
