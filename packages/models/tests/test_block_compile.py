"""`compile_blocks`: torch.compile per transformer layer, checked against the same model eager.

The tests trace with the ``aot_eager`` backend (dynamo + AOTAutograd, no generated code:
seconds, not minutes; the MoE and dropout ones ~13 s each, so ``slow``); the last one runs
inductor's C++ backend (``slow``). Each compares the
compiled model's loss and every gradient with an eager copy holding the same weights:

- keys, parameter objects and hooks stay the same (DDP and checkpoints see one model);
- MoE MLPs run eagerly inside the compiled layer: the only graph break is the disabled block;
- with dropout, masks come from the model's RNG tracker streams as in eager (the forks run
  eagerly; inductor's fallback_random makes compiled dropout draw from torch's generator);
- a machine without a C++ compiler is refused before the model is touched.

Tolerances: gradients at ``assert_close_at_scale(rtol=1e-5, ulps=64)``; measured on the AMD
EPYC: aot_eager and inductor differ from eager by at most 6e-7 relative at the loss and
(inductor) 3 ulp of a gradient's max, as AOTAutograd's decompositions and inductor's fusions
reorder sums.
"""

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.utils import counters

from shardwork.models import GPTConfig, GPTModel, compile_blocks, compile_problem, compile_report
from shardwork.models.presets import preset
from shardwork.parallel_state.testing import assert_close_at_scale

DENSE = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=128,
    max_position_embeddings=64,
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test traces from scratch and counts only its own graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    fallback = torch._inductor.config.fallback_random
    yield
    torch._inductor.config.fallback_random = fallback
    torch._dynamo.reset()


def _batch(config: GPTConfig, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (2, 17), generator=gen)


def _loss_and_grads(model: GPTModel, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss, count = model(ids[:, :-1], labels=ids[:, 1:])
    (loss / count).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return (loss / count).detach(), grads


def _assert_same(compiled: GPTModel, eager: GPTModel, config: GPTConfig, steps: int = 2):
    for step in range(steps):
        ids = _batch(config, seed=step)
        loss, grads = _loss_and_grads(compiled, ids)
        ref_loss, ref_grads = _loss_and_grads(eager, ids)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert_close_at_scale(grad, ref_grads[name], rtol=1e-5, ulps=64, name=name)


def _twins(config: GPTConfig) -> tuple[GPTModel, GPTModel]:
    """Two builds of ``config``: initialisation is a function of the keys and the seed."""
    model, eager = GPTModel(config), GPTModel(config)
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name
    return model, eager


def test_compiled_layers_keep_keys_parameters_and_match_eager():
    config = GPTConfig(**DENSE)
    model, eager = _twins(config)
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    assert compile_blocks(model, backend="aot_eager") == 2
    assert list(model.state_dict()) == keys
    assert [id(p) for p in model.parameters()] == params
    assert all(layer._compiled_call_impl is not None for layer in model.decoder.layers)
    assert model.embedding._compiled_call_impl is None  # embedding, head, loss stay eager
    _assert_same(model, eager, config)
    report = compile_report()
    assert report.graphs >= 1 and report.graph_breaks == {}
    # Counts since an earlier report: nothing new after the graphs exist.
    _assert_same(model, eager, config, steps=1)
    assert compile_report(since=report) == type(report)(graphs=0, graph_breaks={}, frames=0)


@pytest.mark.slow  # ~13 s of tracing on the 2-core machine
def test_moe_mlp_runs_eagerly_inside_the_compiled_layer():
    config = preset("tiny-mixtral-8x7b").replace(num_layers=2)
    model, eager = _twins(config)
    compile_blocks(model, backend="aot_eager")
    _assert_same(model, eager, config)
    # One reason only: the disabled MoE block; the router's data-dependent shapes never reach
    # dynamo (no "Dynamic shape operator" / "returned non-Tensor" breaks).
    (reason,) = compile_report().graph_breaks
    assert "torch.compiler.disable" in reason


@pytest.mark.slow  # ~13 s of tracing on the 2-core machine
def test_dropout_masks_match_eager_through_the_rng_tracker():
    config = GPTConfig(**DENSE, hidden_dropout=0.2, attention_dropout=0.1)
    model, eager = _twins(config)
    torch._inductor.config.fallback_random = False
    compile_blocks(model, backend="aot_eager")
    assert torch._inductor.config.fallback_random is True
    _assert_same(model, eager, config)
    # Planted bug: the same weights with other dropout streams (the tracker's seed) draw other
    # masks, and the check sees it.
    other_masks = GPTModel(config.replace(dropout_seed=config.dropout_seed + 1))
    with pytest.raises(AssertionError):
        _assert_same(model, other_masks, config, steps=1)


def test_no_compiler_is_refused_before_the_model_is_touched(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-cxx-compiler")
    problem = compile_problem("cpu")
    assert "'no-such-cxx-compiler' was not found" in problem
    assert "apt-get install g++" in problem
    model = GPTModel(GPTConfig(**DENSE))
    with pytest.raises(ValueError, match="compile_blocks: inductor compiles C\\+\\+ on a CPU"):
        compile_blocks(model)
    assert all(layer._compiled_call_impl is None for layer in model.decoder.layers)
    # Backends that generate no code need no compiler.
    assert compile_problem("cpu", "aot_eager") is None


def test_triton_kernels_on_a_cpu_are_refused():
    """Triton on a CPU is its interpreter, which dynamo fails on (measured: an
    InternalTorchDynamoError on ``__triton_builtin__`` at the first forward)."""
    model = GPTModel(GPTConfig(**DENSE, kernel_backend="triton"))
    with pytest.raises(ValueError, match="kernel_backend='triton' on a CPU runs Triton's interp"):
        compile_blocks(model, backend="aot_eager")
    assert compile_problem("cpu", config=GPTConfig(**DENSE, kernel_backend="torch")) is None


def test_bad_backend_and_model_without_layers_are_refused():
    assert compile_problem("cpu", "tvm") == (
        "backend='tvm' is not supported; valid: inductor, aot_eager, eager"
    )
    with pytest.raises(ValueError, match="holds no TransformerLayer"):
        compile_blocks(torch.nn.Linear(2, 2), backend="eager")


@pytest.mark.slow
@pytest.mark.skipif(compile_problem("cpu") is not None, reason="inductor cannot compile here")
@pytest.mark.timeout(1200)
def test_inductor_matches_eager_with_dropout_and_selective_recompute():
    """Inductor's C++ kernels; dropout (fallback_random) and selective recompute (the core
    attention checkpoint inside the layer runs eagerly: a graph break dynamo reports)."""
    config = GPTConfig(**DENSE, hidden_dropout=0.1, attention_dropout=0.1, recompute="selective")
    model, eager = _twins(config)
    compile_blocks(model)
    _assert_same(model, eager, config, steps=3)
    assert compile_report().graph_breaks
