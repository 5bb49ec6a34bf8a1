"""Test setup for shardwork-moe-router.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, before anything imports Triton, so the
optional fused path's Triton tests (test_fused.py) run on CPU through Triton's interpreter
whether this package's tests run alone, in any order, beside other packages' tests, or in
``.ci/run moe-router``. Nothing else in this package reads the variable.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
