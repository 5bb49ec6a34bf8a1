"""Shared fixtures for shardwork-models tests.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, before anything imports Triton, so that the
tests that run the model with ``kernel_backend="triton"`` (what ``"auto"`` picks on CUDA) run
its kernels on CPU through Triton's interpreter. ``"auto"`` still picks the torch kernels on
CPU, so every other test is unaffected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
