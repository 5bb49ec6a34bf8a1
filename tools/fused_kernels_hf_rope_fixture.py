"""Write the Hugging Face RoPE fixture used by packages/fused-kernels/tests/test_rotary.py.

Run in the workspace (transformers is a dev dependency, not a runtime one)::

    uv run python tools/fused_kernels_hf_rope_fixture.py

For each RoPE scaling case of the tests (``ROPE_CASES`` in test_rotary.py) it stores the inverse frequencies and the attention
scale that transformers' ``ROPE_INIT_FUNCTIONS`` compute for a Llama config. The rotary tests
compare against this file when transformers is not installed (the package's isolated CI job),
and check that the file still equals a fresh transformers computation when it is.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "packages/fused-kernels/tests"
OUT = TESTS / "data" / "hf_rope.pt"


def main() -> int:
    import transformers

    spec = importlib.util.spec_from_file_location("test_rotary", TESTS / "test_rotary.py")
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    fixture = {"transformers": transformers.__version__, "cases": {}}
    for name in cases.ROPE_CASES:
        inv, scale = cases.transformers_inv_freq(name)
        fixture["cases"][name] = {"inv_freq": inv.double(), "attention_scale": float(scale)}
    torch.save(fixture, OUT)
    print(f"wrote {OUT} ({len(cases.ROPE_CASES)} cases, transformers {transformers.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
