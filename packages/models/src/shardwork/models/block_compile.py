"""``torch.compile`` per transformer layer: :func:`compile_blocks`, its preconditions, its report.

- Unit: every :class:`~shardwork.models.transformer_layer.TransformerLayer` of a model chunk
  (decoder layers and MTP depths), compiled in place with ``nn.Module.compile``: the module,
  its parameters, state-dict keys and hooks stay what they were, so DDP's gradient and
  parameter-gather hooks, LoRA adapters, checkpoints and pipeline stages see the same objects.
  Embedding, head, loss and pipeline communication stay eager. Layers of one kind share their
  code, so they reuse one compiled graph (guards on shapes and the module's structure).
- Compilation is lazy: the first forward of each layer traces and compiles (seconds to minutes
  with inductor's C++ backend on a CPU); `compile_report` says afterwards what was compiled and
  where the graphs broke.
- MoE MLPs (:class:`~shardwork.models.moe.layer.MoELayer`) run eagerly inside the compiled
  layer (``torch.compiler.disable``): routing makes token counts data-dependent (per-expert
  counts, all-to-all split sizes read as Python ints), so the dispatch would break the graph at
  each of them and recompile for every new count pattern. The layer then compiles as two graphs
  (norm, attention, residual, pre-MLP norm | residual add) around the eager MoE block, whose
  router side effects (aux-loss tracker, recompute replay) stay plain Python.
- Dropout: inductor draws random numbers its own way, so masks would differ from eager.
  With dropout in the config, inductor's ``fallback_random`` is switched on (a process-wide
  setting) so compiled dropout draws from torch's generator as eager does; the model's
  :class:`~shardwork.models.rng.RNGTracker` forks run eagerly (graph breaks).
- Activation recompute: ``recompute="full"`` checkpoints each compiled layer (the recompute
  reruns the compiled forward); ``"selective"`` checkpoints core attention inside the layer.
- Generation (``shardwork-generate``, :mod:`shardwork.trainer.inference`) builds its own model
  and never calls this: decoding with a KV cache stays eager.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.utils import counters

from shardwork.models.config import GPTConfig
from shardwork.models.moe.layer import MoELayer
from shardwork.models.transformer_layer import TransformerLayer

__all__ = ["BACKENDS", "CompileReport", "compile_blocks", "compile_problem", "compile_report"]

BACKENDS = ("inductor", "aot_eager", "eager")
"""``torch.compile`` backends :func:`compile_blocks` accepts: inductor (generated C++ on CPU,
Triton on GPU) for speed; aot_eager and eager trace without generating code (fast, for tests
of tracing and graph breaks)."""


def _cxx() -> str:
    """The C++ compiler inductor runs on this OS: ``$CXX``, else g++ (clang++ on macOS)."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def compile_problem(
    device: torch.device | str, backend: str = "inductor", *, config: GPTConfig | None = None
) -> str | None:
    """Why ``torch.compile`` with ``backend`` cannot run on ``device`` here (None: it can).

    Checks what would otherwise fail minutes into the first step: a Python/torch build without
    dynamo, inductor on CPU without a C++ compiler, inductor on CUDA without Triton, and (with
    the model's ``config``) Triton kernels on a CPU, which run in Triton's interpreter
    (``TRITON_INTERPRET=1``) that dynamo cannot trace.
    """
    if backend not in BACKENDS:
        return f"backend={backend!r} is not supported; valid: {', '.join(BACKENDS)}"
    device_type = torch.device(device).type
    if config is not None and config.kernel_backend == "triton" and device_type == "cpu":
        return (
            "kernel_backend='triton' on a CPU runs Triton's interpreter, which torch.compile "
            "cannot trace; use kernel_backend 'auto' or 'torch' (inductor compiles the torch ops)"
        )
    if not torch._dynamo.is_dynamo_supported():
        return (
            f"torch.compile is not supported by this build (Python {sys.version.split()[0]}, "
            f"torch {torch.__version__})"
        )
    if backend != "inductor":
        return None
    if device_type == "cpu":
        cxx = _cxx()
        if shutil.which(cxx.split()[0]) is None:
            return (
                f"inductor compiles C++ on a CPU and the compiler {cxx!r} was not found (it uses "
                "$CXX, else g++; clang++ on macOS): install one (Debian/Ubuntu: apt-get install "
                "g++; Fedora: dnf install gcc-c++; macOS: xcode-select --install) or point CXX "
                "at one"
            )
    elif device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "inductor generates Triton kernels on CUDA and triton is not installed"
    return None


def _layers(model: torch.nn.Module) -> list[TransformerLayer]:
    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def _config_of(model: torch.nn.Module) -> GPTConfig | None:
    """The model's GPTConfig, also through a wrapper holding it as ``.module`` (DDP)."""
    config = getattr(model, "config", None)
    if config is None:
        config = getattr(getattr(model, "module", None), "config", None)
    return config if isinstance(config, GPTConfig) else None


def compile_blocks(model: torch.nn.Module, *, backend: str = "inductor") -> int:
    """Compile every transformer layer of ``model`` in place; return how many were compiled.

    ``model``: a :class:`~shardwork.models.gpt_model.GPTModel` (or any module holding
    :class:`TransformerLayer` s), before or after LoRA and DDP wrapping (hooks registered before
    its first forward are traced with it). Raises ValueError (see :func:`compile_problem`)
    before touching the model if compilation cannot run here, or if no layer was found.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    config = _config_of(model)
    problem = compile_problem(device, backend, config=config)
    if problem is not None:
        raise ValueError(f"compile_blocks: {problem}")
    layers = _layers(model)
    if not layers:
        raise ValueError(
            f"compile_blocks: {type(model).__name__} holds no TransformerLayer to compile"
        )
    if config is not None and (config.hidden_dropout or config.attention_dropout):
        # Without it inductor's own RNG draws the dropout masks, not torch's generator (the
        # compiled run's losses would then differ from eager from the first step).
        torch._inductor.config.fallback_random = True
    for layer in layers:
        if isinstance(layer.mlp, MoELayer):
            # Bound to this instance: the MoE block runs eagerly, with its hooks (see module doc).
            layer.mlp.forward = torch.compiler.disable(layer.mlp.forward, recursive=True)
        layer.compile(backend=backend)
    return len(layers)


@dataclass
class CompileReport:
    """What dynamo did in this process (all compiled regions together), from its start or
    since an earlier report (`compile_report`)."""

    graphs: int
    """Distinct graphs compiled (each layer kind's forward, split at graph breaks)."""
    graph_breaks: dict[str, int] = field(default_factory=dict)
    """Reason (its first line, as dynamo words it) -> times it broke a graph while tracing."""
    frames: int = 0
    """Python frames dynamo traced (a graph break resumes tracing in a new frame)."""

    def lines(self) -> list[str]:
        """Human-readable summary: one line, then one per graph-break reason."""
        breaks = sum(self.graph_breaks.values())
        head = (
            f"torch.compile: {self.graphs} graph(s), {breaks} graph break(s), "
            f"{self.frames} frame(s) traced"
        )
        return [head] + [f"  graph break x{n}: {why}" for why, n in self.graph_breaks.items()]


def compile_report(since: CompileReport | None = None) -> CompileReport:
    """The :class:`CompileReport` of this process from ``torch._dynamo``'s counters.

    The counters are process-wide and cumulative; ``since``: a report taken earlier, whose
    counts are subtracted (what happened after it, e.g. during one run's first step).
    """
    breaks: Counter[str] = Counter()
    for reason, count in counters["graph_break"].items():
        breaks[str(reason).strip().splitlines()[0]] += count
    graphs, frames = int(counters["stats"]["unique_graphs"]), int(counters["frames"]["total"])
    if since is not None:
        breaks.subtract(since.graph_breaks)
        graphs, frames = graphs - since.graphs, frames - since.frames
    kept = {why: n for why, n in breaks.most_common() if n > 0}
    return CompileReport(graphs=graphs, graph_breaks=kept, frames=frames)
