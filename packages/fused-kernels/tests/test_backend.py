"""Backend selection: per-call choice, process default, clear errors, TE gating, logging, launch counting."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import shardwork.fused_kernels as fk
from shardwork.fused_kernels import backend as backend_mod
from shardwork.fused_kernels import te_support
from shardwork.fused_kernels.launches import count_launches

# Where the Triton backend runs in these tests: CUDA where present; otherwise the CPU, through
# the interpreter that the conftest turns on only when there is no CUDA.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def restore_default():
    before = fk.get_default_backend()
    yield
    fk.set_default_backend(before)


def test_auto_is_torch_on_cpu_even_with_interpreter():
    for op in fk.OPS:
        assert fk.resolve_backend(op, "auto", "cpu") == "torch"
        assert fk.resolve_backend(op, "torch", "cpu") == "torch"


def test_auto_on_cuda_prefers_triton_then_te_when_configured(monkeypatch, restore_default):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    assert fk.resolve_backend("rms_norm", "auto", "cuda") == "triton"
    monkeypatch.setattr(te_support, "unavailable_reason", lambda op: None)
    fk.set_default_backend("auto", prefer_te=True)
    assert fk.resolve_backend("rms_norm", None, "cuda") == "te"
    assert fk.resolve_backend("rms_norm", "auto", "cuda") == "te"
    monkeypatch.setattr(backend_mod, "triton_available", lambda: False)
    fk.set_default_backend("auto")
    assert fk.resolve_backend("rms_norm", None, "cuda") == "torch"


def test_default_backend_is_read_at_each_call(restore_default):
    fk.set_default_backend("torch")
    assert fk.get_default_backend() == "torch"
    assert fk.resolve_backend("swiglu", None, "cpu") == "torch"
    fk.set_default_backend("triton")
    assert fk.resolve_backend("swiglu", None, TRITON_DEVICE) == "triton"
    assert fk.resolve_backend("swiglu", "torch", TRITON_DEVICE) == "torch"  # the call wins


def test_same_request_same_answer():
    answers = {fk.resolve_backend("cross_entropy", "triton", TRITON_DEVICE) for _ in range(5)}
    assert answers == {"triton"}


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(fk.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        fk.resolve_backend("rms_norm", "triton", "cpu")
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(fk.BackendUnavailableError, match="TRITON_INTERPRET"):
        fk.rms_norm(x, w, backend="triton")


def test_triton_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(backend_mod, "triton_available", lambda: False)
    with pytest.raises(fk.BackendUnavailableError, match=r"shardwork-fused-kernels\[triton\]"):
        fk.resolve_backend("rms_norm", "triton", "cpu")


def test_bad_names_are_value_errors(restore_default):
    with pytest.raises(ValueError, match="backend='cuda'"):
        fk.resolve_backend("rms_norm", "cuda", "cpu")
    with pytest.raises(ValueError, match="op_name='softmax'"):
        fk.resolve_backend("softmax", "auto", "cpu")
    with pytest.raises(ValueError, match="valid: auto, torch, triton, te"):
        fk.set_default_backend("fast")


def test_te_is_gated_with_a_reason():
    reason = te_support.unavailable_reason("rms_norm")
    if reason is not None:
        with pytest.raises(fk.BackendUnavailableError, match="backend='te' for rms_norm"):
            fk.resolve_backend("rms_norm", "te", "cuda")
    assert "does not implement rotary" in te_support.unavailable_reason("rotary")
    assert "does not implement permute" in te_support.unavailable_reason("permute")
    assert set(te_support.MIN_TE_VERSION) <= set(fk.OPS)


@pytest.mark.parametrize(
    ("version", "op", "expect_none"),
    [((1, 9), "rms_norm", False), ((2, 6), "router_topk", False), ((2, 7), "router_topk", True)],
)
def test_te_version_gate_in_one_place(monkeypatch, version, op, expect_none):
    monkeypatch.setattr(te_support, "_load", lambda: (object(), version, None))
    reason = te_support.unavailable_reason(op)
    assert (reason is None) == expect_none
    if reason is not None:
        need = te_support.MIN_TE_VERSION[op]
        assert f">= {need[0]}.{need[1]}" in reason


@pytest.mark.parametrize(("version", "expect_none"), [((2, 12), False), ((2, 13), True)])
def test_te_feature_gate(monkeypatch, version, expect_none):
    monkeypatch.setattr(te_support, "_load", lambda: (object(), version, None))
    reason = te_support.feature_unavailable_reason("router_topk.sqrtsoftplus")
    assert (reason is None) == expect_none
    if reason is not None:
        assert ">= 2.13" in reason


def test_te_on_cpu_tensor_is_refused(monkeypatch):
    monkeypatch.setattr(te_support, "_load", lambda: (object(), (2, 9), None))
    with pytest.raises(fk.BackendUnavailableError, match="needs a CUDA tensor"):
        fk.resolve_backend("cross_entropy", "te", "cpu")


def test_choice_is_logged(caplog):
    backend_mod._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="shardwork.fused_kernels"):
        fk.resolve_backend("geglu", "triton", TRITON_DEVICE)
    message = f"geglu on {TRITON_DEVICE}: backend 'triton' -> triton"
    assert any(message in r.getMessage() for r in caplog.records)


def test_launch_counter_sees_triton_and_not_torch(triton_device):
    x = torch.randn(4, 16, device=triton_device)
    w = torch.randn(16, device=triton_device)
    with count_launches() as launches:
        fk.rms_norm(x, w, backend="torch")
    assert launches["rms_norm_fwd"] == 0
    with count_launches() as launches:
        fk.rms_norm(x, w, backend="triton")
    assert launches["rms_norm_fwd"] == 1


def test_import_needs_neither_triton_nor_te():
    code = (
        "import sys, shardwork.fused_kernels as fk; "
        "fk.rms_norm(__import__('torch').randn(2, 4), __import__('torch').ones(4), backend='torch'); "
        "print(sorted(m for m in ('triton', 'transformer_engine') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_bad_backend_variable_fails_the_first_op_not_the_import():
    """``SHARDWORK_KERNEL_BACKEND`` is read when the default is first needed: the package imports,
    ``environment_problems`` names the variable, its value and the valid ones, and the first op
    that takes the default raises that sentence (an explicit backend still runs)."""
    code = (
        "import torch, shardwork.fused_kernels as fk\n"
        "print(fk.environment_problems())\n"
        "x, w = torch.randn(3, 8), torch.ones(8)\n"
        "print(fk.rms_norm(x, w, backend='torch').shape)\n"
        "try:\n"
        "    fk.rms_norm(x, w)\n"
        "except ValueError as exc:\n"
        "    print('ValueError:', exc)\n"
        "fk.set_default_backend('torch')\n"
        "print(fk.rms_norm(x, w).shape, fk.get_default_backend())\n"
    )
    env = {**os.environ, "SHARDWORK_KERNEL_BACKEND": "cuda"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    message = "SHARDWORK_KERNEL_BACKEND='cuda' is not a backend; valid: auto, torch, triton, te"
    assert out.stdout.splitlines() == [
        repr([message + " (unset: auto)"]),
        "torch.Size([3, 8])",
        f"ValueError: {message} (unset: auto)",
        "torch.Size([3, 8]) torch",
    ]
