"""The README's examples run as written: the block-level one records its aux losses, the
transformers one trains a step and saves a model stock transformers loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example(heading: str) -> str:
    """The first ```python block after the line ``heading``."""
    text = README.read_text()
    start = text.index(heading + "\n")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def run(code: str) -> dict:
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    return scope


def test_readme_example_runs():
    scope = run(readme_example("## Inside your own transformer block"))
    summary = scope["tracker"].summary()
    assert summary["load_balancing_loss"] > 0 and summary["z_loss"] > 0
    assert scope["mlp"].router.weight.grad is not None
    assert all(p.grad is not None for p in scope["mlp"].experts.parameters())


def test_readme_transformers_example_runs():
    pytest.importorskip("transformers")
    scope = run(readme_example("## In a transformers model"))
    out, moe = scope["out"], scope["moe"]
    assert len(moe.routers) == 2
    assert float(out.aux_loss) > 0
    # the loss the example trained on is cross-entropy plus the aux losses
    logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
    ce = torch.nn.functional.cross_entropy(logits, scope["tokens"][:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ce + out.aux_loss, rtol=1e-6, atol=0)
    assert set(moe.last_step_summary) >= {"seq_load_balancing_loss", "load_imbalance"}
