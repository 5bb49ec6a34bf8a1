"""The model's float32 CPU products on oneDNN (``kernel_backend="auto"`` on a non-Intel CPU)
against the same weights on torch's MKL products (``kernel_backend="torch"``).

Which products take oneDNN is read from the autograd graph: every linear the forward runs
(attention, MLA's projections, MLPs, shared experts, MTP's projection) and the routed experts'
SwiGLU MLP, run expert by expert in one function, never under ``"torch"``. Losses and gradients
agree at float32 rounding. The fused experts still call their projection modules (whose forward
hooks run) and step aside for LoRA-adapted projections.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from shardwork.fused_kernels import cpu_gemm
from shardwork.models import GPTModel, preset
from shardwork.models.lora import apply_lora
from shardwork.models.lora_config import LoRAConfig
from shardwork.models.mla import ReplicatedLinear
from shardwork.models.moe import experts as experts_module
from shardwork.models.moe.experts import ExpertLinear
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.testing import random_batch, randomize_lora_b
from shardwork.parallel_state.testing import assert_close_at_scale

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="this torch build has no oneDNN",
)

# Measured over the cases below: oneDNN vs MKL differ by at most 5.9 ulp of a gradient's max
# |entry| (float32), the losses not at all; 32 leaves ~5x.
ULPS = 32


@pytest.fixture
def amd(monkeypatch):
    """Pretend the CPU is not Intel's, so ``auto`` takes oneDNN on any machine; one torch
    thread, where the experts' MLP runs expert by expert whatever the size of its groups
    (and whatever ``SHARDWORK_CPU_GEMM`` the shell running the tests set)."""
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.delenv(cpu_gemm.CPU_GEMM_ENV, raising=False)
    with torch_threads(1):
        yield


@contextmanager
def torch_threads(count: int):
    """torch's intra-op thread count set to ``count`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _graph_nodes(t: torch.Tensor) -> Counter:
    """Class names of every autograd node behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], Counter()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names[type(node).__name__] += 1
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def _run(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss_sum, count = model(ids, labels=labels)
    loss = loss_sum / count
    nodes = _graph_nodes(loss)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, nodes


@pytest.mark.parametrize("name", ["tiny-llama3-8b", "tiny-mixtral-8x7b", "tiny-deepseek-v3"])
def test_auto_runs_the_products_on_onednn_and_agrees_with_mkl(amd, name):
    results = {}
    weights = None
    for backend in ("auto", "torch"):
        cfg = preset(name, params_dtype=torch.float32, kernel_backend=backend)
        torch.manual_seed(0)
        model = GPTModel(cfg)
        if weights is None:
            weights = model.state_dict()
        model.load_state_dict(weights)
        ids, labels = random_batch(cfg.vocab_size, batch=2, seq=16, seed=1)
        results[backend] = _run(model, ids, labels)
    linears = sum(
        isinstance(m, ColumnParallelLinear | RowParallelLinear | ReplicatedLinear)
        for m in model.modules()
    )
    experts = sum(isinstance(m, ExpertLinear) for m in model.modules())
    # The head's linear runs inside the fused loss (its own oneDNN products), not as a linear.
    assert results["auto"][2]["_OneDnnLinearBackward"] == linears - 1
    # Two stacked projections per MoE layer, one fused expert MLP.
    assert results["auto"][2]["_GroupedSwiGLUMLPBackward"] == experts // 2
    assert "_OneDnnGroupedLinearBackward" not in results["auto"][2]
    for node in (
        "_OneDnnLinearBackward",
        "_OneDnnGroupedLinearBackward",
        "_GroupedSwiGLUMLPBackward",
    ):
        assert node not in results["torch"][2]
    auto_loss, auto_grads, _ = results["auto"]
    torch_loss, torch_grads, _ = results["torch"]
    assert_close_at_scale(auto_loss, torch_loss, rtol=0, ulps=ULPS, name="loss")
    for key, grad in torch_grads.items():
        assert_close_at_scale(auto_grads[key], grad, rtol=0, ulps=ULPS, name=key)


def test_fused_experts_run_their_projections_forward_hooks(amd):
    """The distributed optimizer waits for a weight's all-gather in a forward pre-hook of the
    module owning it; the fused MLP asks each projection module for its weight, so the hooks of
    both run once per forward."""
    cfg = preset("tiny-mixtral-8x7b", params_dtype=torch.float32, kernel_backend="auto")
    torch.manual_seed(0)
    model = GPTModel(cfg)
    calls = Counter()
    projections = [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertLinear)]
    for name, module in projections:
        module.register_forward_pre_hook(lambda _m, _args, name=name: calls.update([name]))
    ids, labels = random_batch(cfg.vocab_size, batch=2, seq=16, seed=1)
    loss_sum, _count = model(ids, labels=labels)
    assert _graph_nodes(loss_sum)["_GroupedSwiGLUMLPBackward"] == len(projections) // 2
    assert calls == Counter({name: 1 for name, _ in projections})


def test_on_two_threads_small_expert_groups_take_the_whole_tensor_path(amd, monkeypatch):
    """Two threads: the expert-by-expert MLP only for groups of FUSED_MLP_MIN_GROUP rows × ffn
    on average; either path gives the same loss and gradients, bit for bit."""
    cfg = preset("tiny-mixtral-8x7b", params_dtype=torch.float32, kernel_backend="auto")
    torch.manual_seed(0)
    model = GPTModel(cfg)
    ids, labels = random_batch(cfg.vocab_size, batch=2, seq=16, seed=1)
    layer = next(m for m in model.modules() if isinstance(m, experts_module.GroupedExperts))
    rows = ids.numel() * cfg.moe.router.top_k  # every routed row of a layer (no token dropped)
    mean_group = rows * layer.linear_fc2.weight.shape[-1] / layer.num_local_experts
    runs = {}
    for threshold in (mean_group, mean_group + 1):  # just reached, just missed
        monkeypatch.setattr(experts_module, "FUSED_MLP_MIN_GROUP", threshold)
        with torch_threads(2):
            runs[threshold] = _run(model, ids, labels)
    fused, unfused = runs[mean_group], runs[mean_group + 1]
    experts = sum(isinstance(m, ExpertLinear) for m in model.modules())
    assert fused[2]["_GroupedSwiGLUMLPBackward"] == experts // 2
    assert "_OneDnnGroupedLinearBackward" not in fused[2]
    assert "_GroupedSwiGLUMLPBackward" not in unfused[2]
    assert unfused[2]["_OneDnnGroupedLinearBackward"] == experts
    assert torch.equal(fused[0], unfused[0])
    for key, grad in unfused[1].items():
        assert torch.equal(fused[1][key], grad), key


def test_lora_adapted_experts_keep_their_adapters_under_auto(amd):
    """With adapters on the experts' fc2 (nonzero ``B``), ``auto`` leaves the fused MLP and its
    loss equals the MKL path's; a fused MLP that skipped the adapter would change it by O(1)."""
    losses = {}
    for backend in ("auto", "torch"):
        cfg = preset("tiny-mixtral-8x7b", params_dtype=torch.float32, kernel_backend=backend)
        torch.manual_seed(0)
        model = GPTModel(cfg)
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=("experts.linear_fc2",)))
        randomize_lora_b(model)
        ids, labels = random_batch(cfg.vocab_size, batch=2, seq=16, seed=1)
        loss_sum, count = model(ids, labels=labels)
        losses[backend] = loss_sum / count
        nodes = _graph_nodes(loss_sum)
        assert "_GroupedSwiGLUMLPBackward" not in nodes
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, ExpertLinear) and hasattr(module, "lora_B"):
                    module.lora_B.weight.zero_()
            unadapted = model(ids, labels=labels)
        assert (unadapted[0] / unadapted[1] - losses[backend]).abs() > 1e-4  # adapters matter
    assert_close_at_scale(losses["auto"], losses["torch"], rtol=0, ulps=ULPS, name="loss")
