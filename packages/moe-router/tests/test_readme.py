"""The README example runs as written and records its aux losses."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    summary = scope["tracker"].summary()
    assert summary["load_balancing_loss"] > 0 and summary["z_loss"] > 0
    assert scope["mlp"].router.weight.grad is not None
    assert all(p.grad is not None for p in scope["mlp"].experts.parameters())
