"""The hybrid mixers' optional fast paths (:mod:`shardwork.models.scan_kernels`).

Two kinds of tests:

- In the repo's environment (neither mamba-ssm nor flash-linear-attention installed):
  ``kernel_backend="triton"`` fails when the ``GPTConfig`` is built (before any model) with
  an error naming the field, the value and the package; ``"auto"`` and ``"torch"`` on CPU
  run the plain-torch reference (spied on); bad values are refused by the config.
- Where a kernel imports, the kernel path against the reference, forward and gradients, at
  awkward shapes (sequence not a multiple of the chunk), and a ``"triton"`` forward the
  tensor cannot take refused before any work. On a CPU machine this needs
  ``TRITON_INTERPRET=1`` and the shims of :func:`mamba_kernel_env`; the commands that ran
  these tests are in docs/models.md ("Fast paths"). flash-linear-attention's kernel does not
  run under Triton's interpreter (measured with fla 0.6.0: its kernels call ``.to`` on a
  ``range`` loop index, a Python int there), so its kernel test needs CUDA; on CPU its
  argument mapping is checked against fla's own naive recurrence instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import types

import pytest
import torch

import shardwork.models.deltanet as deltanet_module
import shardwork.models.mamba as mamba_module
from shardwork.fused_kernels.backend import triton_interpreter_enabled
from shardwork.models import (
    AttentionInputs,
    GatedDeltaNetConfig,
    GPTConfig,
    Mamba2Mixer,
    MambaConfig,
)
from shardwork.models.delta_rule import gated_delta_rule_chunked
from shardwork.models.deltanet import GatedDeltaNetMixer
from shardwork.models.deltanet_kernels import (
    fla_arguments,
    fla_device_refusal,
    gated_delta_rule_kernel,
    hopper_triton_refusal,
)
from shardwork.models.mamba_kernels import ssd_chunked_kernel
from shardwork.models.scan_kernels import OptionalKernel
from shardwork.models.sharding import init_from_shards
from shardwork.models.ssd import ssd_chunked
from shardwork.parallel_state import ProcessGroups
from shardwork.parallel_state.testing import assert_close_at_scale

NO_POSITIONS = AttentionInputs(cos=torch.empty(0), sin=torch.empty(0), mask=None)
MAMBA = MambaConfig(num_heads=4, head_dim=8, state_size=8, num_groups=2, chunk_size=16)
GDN = GatedDeltaNetConfig(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8)
# Kernel vs reference in float32 under Triton's interpreter (tl.dot in full float32):
# measured at most 2.5 float32 ulps of each tensor's scale (mamba-ssm: outputs, final state
# and all input gradients); 16 leaves headroom.
INTERPRETER_ULPS = 16
# On a GPU, tl.dot on float32 inputs rounds them to TF32 (10 mantissa bits, float32 has 23):
# the same 16 ulps counted in TF32's. Derived, not yet measured on a GPU.
GPU_ULPS = 16 * 2**13


def _ulps() -> float:
    return GPU_ULPS if torch.cuda.is_available() else INTERPRETER_ULPS


def _config(**kw) -> GPTConfig:
    base = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=100,
        params_dtype=torch.float32,
    )
    return GPTConfig(**(base | kw))


def _init(mixer):
    for key, param, module in mixer.named_param_keys():
        init_from_shards(param, key, module.shard_ctx, init_seed=5, std=0.3, num_layers=1)
    return mixer


def _single() -> ProcessGroups:
    return ProcessGroups.single()


def _spy(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records its calls and then runs it."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


# ---- in the repo's environment -------------------------------------------------------------
@pytest.mark.parametrize("owner", [MambaConfig, GatedDeltaNetConfig])
def test_invalid_kernel_backend_is_refused_by_the_config(owner):
    base = MAMBA if owner is MambaConfig else GDN
    with pytest.raises(ValueError, match=rf"{owner.__name__}\.kernel_backend='te' is invalid"):
        base.replace(kernel_backend="te")


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None, reason="mamba-ssm here")
def test_mamba_triton_without_mamba_ssm_fails_at_model_config():
    triton = MAMBA.replace(kernel_backend="triton")  # the mixer config alone is valid
    with pytest.raises(ValueError) as err:
        _config(mamba=triton)
    message = str(err.value)
    assert "MambaConfig.kernel_backend='triton'" in message
    assert "pip install mamba-ssm" in message
    assert "'mamba_ssm' is not installed" in message


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla installed here")
def test_deltanet_triton_without_fla_fails_at_model_config():
    triton = GDN.replace(kernel_backend="triton")  # the mixer config alone is valid
    with pytest.raises(ValueError) as err:
        _config(linear_attention=triton)
    message = str(err.value)
    assert "GatedDeltaNetConfig.kernel_backend='triton'" in message
    assert "pip install flash-linear-attention" in message


def _mamba_forward_calls(monkeypatch, backend: str) -> tuple[list, list]:
    reference = _spy(monkeypatch, mamba_module, "ssd_chunked")
    kernel = _spy(monkeypatch, mamba_module, "ssd_chunked_kernel")
    mixer = _init(Mamba2Mixer(_config(mamba=MAMBA.replace(kernel_backend=backend)), _single()))
    mixer(torch.randn(11, 2, 32), NO_POSITIONS)
    return reference, kernel


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mamba_auto_and_torch_on_cpu_run_the_reference(monkeypatch, backend):
    reference, kernel = _mamba_forward_calls(monkeypatch, backend)
    assert reference == ["ssd_chunked"] and kernel == []


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_deltanet_auto_and_torch_on_cpu_run_the_reference(monkeypatch, backend):
    reference = _spy(monkeypatch, deltanet_module, "gated_delta_rule_chunked")
    kernel = _spy(monkeypatch, deltanet_module, "gated_delta_rule_kernel")
    cfg = _config(linear_attention=GDN.replace(kernel_backend=backend))
    mixer = _init(GatedDeltaNetMixer(cfg, _single()))
    mixer(torch.randn(11, 2, 32), NO_POSITIONS)
    assert reference == ["gated_delta_rule_chunked"] and kernel == []


# ---- where the kernels import --------------------------------------------------------------
@pytest.fixture
def mamba_kernel_env(monkeypatch):
    """On CPU, let mamba-ssm's Triton SSD run under Triton's interpreter.

    Test-only accommodations, none of which changes what a kernel computes: a CPU-only
    install of mamba-ssm lacks its CUDA extension ``selective_scan_cuda``, which its package
    ``__init__`` imports although the SSD kernels never use it (an empty module stands in);
    its launchers enter ``torch.cuda.device(index)`` and read the SM count (a no-op context
    and 2 SMs); Triton's autotuner times configs through a GPU driver the interpreter lacks
    (each autotuned kernel runs its config with the smallest blocks instead of the fastest).
    """
    if importlib.util.find_spec("mamba_ssm") is None:
        pytest.skip("mamba-ssm (optional fast path) is not installed")
    if torch.cuda.is_available():
        yield
        return
    if not triton_interpreter_enabled():
        pytest.skip("CPU run of a Triton kernel needs TRITON_INTERPRET=1 set before importing")
    from triton.runtime import autotuner

    monkeypatch.setitem(sys.modules, "selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: types.SimpleNamespace(multi_processor_count=2),
    )
    prune = autotuner.Autotuner.prune_configs

    def smallest_blocks(self, kwargs):
        def blocks(config):
            sizes = [v for k, v in config.kwargs.items() if k.startswith("BLOCK")]
            return math.prod(sizes)

        return [min(prune(self, kwargs), key=blocks)]

    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", smallest_blocks)
    yield


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ssd_inputs(gen: torch.Generator, b=2, s=37, nh=4, p=8, g=2, n=8):
    dev = _device()
    tensors = (
        torch.randn(b, s, nh, p, generator=gen),  # x
        torch.rand(b, s, nh, generator=gen) * 0.5 + 0.01,  # dt (after softplus/clamp)
        -(torch.rand(nh, generator=gen) + 0.5),  # A < 0
        torch.randn(b, s, g, n, generator=gen),  # B
        torch.randn(b, s, g, n, generator=gen),  # C
        torch.randn(b, nh, p, n, generator=gen),  # initial state
    )
    return [t.to(dev).requires_grad_() for t in tensors]


def _compare_with_grads(kernel_fn, reference_fn, inputs, names, gen, *, grads=True):
    """Outputs of both, then (``grads``) gradients of a random projection of all outputs."""
    got, want = kernel_fn(*inputs), reference_fn(*inputs)
    weights = [torch.randn(w.shape, generator=gen).to(w.device) for w in want]
    for name, a, e in zip(("output", "final state"), got, want):
        assert_close_at_scale(a, e, rtol=0, ulps=_ulps(), name=name)
    if not grads:
        return
    grads_got = torch.autograd.grad(sum((a * w).sum() for a, w in zip(got, weights)), inputs)
    grads_want = torch.autograd.grad(sum((e * w).sum() for e, w in zip(want, weights)), inputs)
    for name, a, e in zip(names, grads_got, grads_want):
        assert_close_at_scale(a, e, rtol=0, ulps=_ulps(), name=f"d{name}")


def test_mamba_ssd_kernel_matches_reference(mamba_kernel_env):
    gen = torch.Generator().manual_seed(3)
    inputs = _ssd_inputs(gen)  # s=37 with chunks of 16: a partial last chunk

    def kernel(x, dt, A, B, C, h0):
        return ssd_chunked_kernel(x, dt, A, B, C, 16, h0)

    def reference(x, dt, A, B, C, h0):
        return ssd_chunked(x, dt, A, B, C, 16, h0)

    _compare_with_grads(kernel, reference, inputs, ("x", "dt", "A", "B", "C", "h0"), gen)


def test_mamba_mixer_triton_matches_torch(mamba_kernel_env):
    hidden = torch.randn(21, 2, 32, generator=torch.Generator().manual_seed(4)).to(_device())
    outs, grads = [], []
    for backend in ("triton", "torch"):
        cfg = _config(mamba=MAMBA.replace(kernel_backend=backend))
        mixer = _init(Mamba2Mixer(cfg, _single(), device=_device()))
        h = hidden.clone().requires_grad_()
        out = mixer(h, NO_POSITIONS)
        out.square().sum().backward()
        outs.append(out)
        grads.append([h.grad] + [p.grad for p in mixer.parameters()])
    assert_close_at_scale(outs[0], outs[1], rtol=0, ulps=_ulps(), name="mixer output")
    for i, (a, e) in enumerate(zip(*grads)):
        assert_close_at_scale(a, e, rtol=0, ulps=_ulps(), name=f"gradient {i}")


def _rule_inputs(gen: torch.Generator, b=2, s=45, nh=4, dk=16, dv=8):
    """Inputs as the mixer hands them to the rule: unit-norm q (scaled) and k, log decays."""
    q = torch.nn.functional.normalize(torch.randn(b, s, nh, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, s, nh, dk, generator=gen), dim=-1)
    v = torch.randn(b, s, nh, dv, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(b, s, nh, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(b, s, nh, generator=gen))
    h0 = torch.randn(b, nh, dk, dv, generator=gen)
    tensors = (q * dk**-0.5, k, v, g, beta, h0)
    return [t.to(_device()).requires_grad_() for t in tensors]


def test_fla_argument_mapping_matches_fla_naive_recurrence():
    pytest.importorskip("fla", reason="flash-linear-attention (optional fast path) not installed")
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, g, beta, h0 = (t.detach() for t in _rule_inputs(torch.Generator().manual_seed(6)))
    o_fla, state_fla = naive_recurrent_gated_delta_rule(**fla_arguments(q, k, v, g, beta, h0))
    o_ref, state_ref = gated_delta_rule_chunked(q, k, v, g, beta, 16, h0)
    # fla's naive recurrence is plain float32 torch on either device.
    assert_close_at_scale(o_fla, o_ref, rtol=0, ulps=INTERPRETER_ULPS, name="output")
    assert_close_at_scale(state_fla, state_ref, rtol=0, ulps=INTERPRETER_ULPS, name="final state")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need CUDA")
def test_fla_gated_delta_rule_kernel_matches_reference():
    pytest.importorskip("fla", reason="flash-linear-attention (optional fast path) not installed")
    gen = torch.Generator().manual_seed(7)
    inputs = _rule_inputs(gen)  # s=45: not a multiple of fla's 64 nor of our 16

    def reference(q, k, v, g, beta, h0):
        return gated_delta_rule_chunked(q, k, v, g, beta, 16, h0)

    # Where fla refuses its own backward (Hopper with Triton 3.4.0-3.7.0, as on the H200 this
    # ran on), the forward is still compared; the mixer's "auto" falls back to the reference.
    refused = fla_device_refusal(inputs[0].device)
    _compare_with_grads(
        gated_delta_rule_kernel,
        reference,
        inputs,
        ("q", "k", "v", "g", "beta", "h0"),
        gen,
        grads=refused is None,
    )


@pytest.mark.parametrize(
    ("capability", "triton_version", "refused"),
    [
        ((9, 0), "3.6.0", True),
        ((9, 0), "3.4.0", True),
        ((9, 0), "3.7.0+git1a2b3c", True),
        ((9, 0), "3.7.1", False),
        ((9, 0), "3.3.1", False),
        ((8, 0), "3.6.0", False),
        ((10, 0), "3.6.0", False),
    ],
)
def test_fla_refusal_window(capability, triton_version, refused):
    reason = hopper_triton_refusal(capability, triton_version)
    assert (reason is not None) == refused
    if refused:
        assert triton_version in reason and "issue #640" in reason


def test_device_refusal_falls_back_under_auto_and_stops_triton():
    cuda_float = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    importable = dict(owner="GatedDeltaNetConfig", distribution="x", module="math")
    refused = OptionalKernel(**importable, function="sqrt", device_refusal=lambda d: "bad GPU")
    allowed = OptionalKernel(**importable, function="sqrt", device_refusal=lambda d: None)
    assert allowed.use_kernel("auto", "auto", cuda_float)
    assert not refused.use_kernel("auto", "auto", cuda_float)
    with pytest.raises(ValueError, match=r"kernel_backend='triton' cannot run here: bad GPU"):
        refused.use_kernel("triton", "auto", cuda_float)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU tensor's refusal")
def test_mamba_triton_on_cpu_without_interpreter_refuses_before_work(mamba_kernel_env, monkeypatch):
    mixer = _init(Mamba2Mixer(_config(mamba=MAMBA.replace(kernel_backend="triton")), _single()))
    projections = _spy(monkeypatch, mixer.in_proj, "forward")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(
        ValueError, match=r"MambaConfig\.kernel_backend='triton' cannot run on a cpu"
    ):
        mixer(torch.randn(11, 2, 32), NO_POSITIONS)
    assert projections == []
