"""The README example runs as written; its fused loss equals the one from materialised logits."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["out"].shape == scope["tokens"].shape
    hidden, head, labels = scope["hidden"], scope["head"], scope["labels"]
    h = hidden.detach().clone().requires_grad_(True)
    w = head.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(h @ w.t(), labels)
    ref.backward()
    torch.testing.assert_close(scope["lm_loss"].detach(), ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(hidden.grad, h.grad, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(head.grad, w.grad, rtol=1e-4, atol=1e-8)
