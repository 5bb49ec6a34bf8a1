"""Benchmark one dense Llama-style training step: shardwork against its peers, same process.

Every side trains the same model from the same weights on the same batches with the same
optimizer (``torch.optim.AdamW``), so a ratio measures the model code (forward, loss,
backward) and nothing else. ``--optimizer fused`` (the default) is torch's one-kernel AdamW,
the implementation shardwork's trainer, TorchTitan (``implementation = "fused"``) and
transformers' Trainer with torch >= 2.8 (``adamw_torch_fused``) choose themselves, and
Megatron-Core for CPU-offloaded parameters (``fused=True``; its
plain path without Transformer Engine or Apex keeps torch's default); ``foreach`` is
torch's default multi-tensor loop, which every side ran before 2026-11-29 (~28 ms a step more
on the CPU shape, the same on every side, so it pulls every ratio towards 1):

- transformers' ``LlamaForCausalLM`` (SDPA attention) makes the random weights and writes
  them to a folder; shardwork's ``GPTModel`` loads that folder through its Hugging Face
  bridge, and TorchTitan's Llama 3 model takes them through TorchTitan's own
  ``Llama3StateDictAdapter.from_hf``;
- the step-0 losses of all sides are compared before any timing: a side whose loss differs by
  more than the dtype's tolerance is reported as wrong and not timed;
- the sides run interleaved, round by round, and each round times ``--steps`` steps of one
  side; the table gives the median step time over rounds and the ratio
  ``peer time / shardwork time`` (> 1: shardwork is faster);
- on a GPU it also gives tokens/s, model FLOPs utilisation (shardwork's
  ``flops_per_token``: causal attention, no recompute, against the datasheet's dense bf16 peak
  of the device) and the peak memory of one step.
- ``--floor`` (CPU, float32) also times, in each round after the sides, what no step can do
  without: the linears' products at the faster of MKL and oneDNN, SDPA forward + backward and
  the optimizer step (``dense_floor.py``), and gives each side's step over their sum: the
  largest ratio shardwork could reach against that side if its other work took no time.

Peers are benchmark-only: transformers is in the workspace's dev group; TorchTitan 0.3.0
(``uv pip install --no-deps --target DIR torchtitan==0.3.0 spmd_types==0.2.3 einops tyro
docstring-parser typeguard shtab``) and megatron-core 0.19.2 (its wheel is tagged cp312 but
its Python code runs on 3.11: unzip the wheel into DIR) go into a folder given as
``--peer-path`` (default ``$SHARDWORK_PEERS``). Megatron-Core runs its GPTModel with the local
layer spec (no Transformer Engine), in a one-rank process group, with two CPU shims (the CUDA
device query and the CUDA RNG fork). A peer that cannot be imported is recorded with the
reason, which counts as a goal not met, never as a pass.
shardwork runs once per kernel backend asked for (``--backends``; "auto" picks the Triton
kernels on a GPU).

    uv run python benchmarks/dense_step.py                       # the CPU shape of issue 24
    uv run python benchmarks/dense_step.py --rounds 10 --floor   # ... and the step's floor
    python benchmarks/dense_step.py --shape 1b --device cuda     # Llama-3.2-1B-like, bf16

Writes benchmarks/results/dense_step-<device><suffix>.json and .md (``--suffix=-zen5``: the
record of a Zen 5 machine beside the Zen 4 one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime_env import RUNTIME_ENV  # before torch: shardwork-train's environment, every side

# isort: split
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dense_floor
from machine import machine_record

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    # Issue 24's CPU model: 4 layers, hidden 512, GQA 8/4, SwiGLU 1408, vocab 8192, seq 256 x 4.
    "cpu-small": dict(layers=4, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=8192,
                      seq=256, batch=4, tied=False),
    # Llama 3.2 1B's shape (tied embeddings), 2 x 4096 tokens per step.
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
               seq=4096, batch=2, tied=True),
}  # fmt: skip
# Dense bf16 tensor-core peak from the vendor's datasheets (FLOP/s, without sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# Step-0 loss agreement: bf16 rounds each side's activations differently.
LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
TITAN_IMPORT: dict[str, str] = {}


@dataclass
class Side:
    """One contender: a training step on a fixed batch and where its parameters are."""

    name: str
    loss: Callable[[], torch.Tensor]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None = None

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def hf_llama(shape: dict, dtype: torch.dtype, device: torch.device):
    """transformers' LlamaForCausalLM with seeded random weights, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["seq"],
        rms_norm_eps=1e-5, tie_word_embeddings=shape["tied"], attention_dropout=0.0,
        initializer_range=0.02,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1B model inits fast on a GPU
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype).train()


def rope_theta(hf_config) -> float:
    """RoPE base of a transformers config (5.x keeps it in ``rope_parameters``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def import_titan_llama3() -> str:
    """Import TorchTitan's Llama 3 package; returns how.

    TorchTitan 0.3.0's ``models/llama3/__init__`` imports its FSDP wiring, which needs names
    that torch 2.11 lacks (``torch.distributed.fsdp.DataParallelMeshDims``). The model code
    itself does not: on such a torch the package is registered without running its
    ``__init__``, and its ``model`` and ``state_dict_adapter`` modules load unchanged."""
    try:
        import torchtitan.models.llama3

        return "package import"
    except ImportError as err:
        import torchtitan.models

        name = "torchtitan.models.llama3"
        package = types.ModuleType(name)
        package.__path__ = [str(Path(torchtitan.models.__file__).parent / "llama3")]
        sys.modules[name] = package
        return f"model modules only (package __init__ failed: {err})"


def titan_llama(shape: dict, hf_model, dtype: torch.dtype, device: torch.device):
    """TorchTitan's Llama 3 model with SDPA attention, loaded through its HF adapter."""
    TITAN_IMPORT["how"] = import_titan_llama3()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    h, heads = shape["hidden"], shape["heads"]
    init = {"weight": torch.nn.init.ones_}
    linear = {"weight": torch.nn.init.normal_}
    rope = ComplexRoPE.Config(dim=h // heads, max_seq_len=shape["seq"],
                              theta=rope_theta(hf_model.config))  # fmt: skip
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=h, param_init=init),
            ffn_norm=RMSNorm.Config(normalized_shape=h, param_init=init),
            attention=make_gqa_config(
                dim=h, n_heads=heads, n_kv_heads=shape["kv_heads"], wqkv_param_init=linear,
                wo_param_init=linear, inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=False, rope=rope,
            ),
            feed_forward=make_ffn_config(dim=h, hidden_dim=shape["ffn"], w1_param_init=linear,
                                         w2w3_param_init=linear),
        )
        for _ in range(shape["layers"])
    ]  # fmt: skip
    config = Llama3Model.Config(
        dim=h, vocab_size=shape["vocab"], enable_weight_tying=shape["tied"],
        tok_embeddings=Embedding.Config(num_embeddings=shape["vocab"], embedding_dim=h,
                                        param_init=linear),
        norm=RMSNorm.Config(normalized_shape=h, param_init=init),
        lm_head=Linear.Config(in_features=h, out_features=shape["vocab"], param_init=linear),
        layers=layers,
    )  # fmt: skip
    with torch.device(device):
        model = config.build()
        model.init_states(buffer_device=device)
    hf_state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    state = Llama3StateDictAdapter(config, None).from_hf(hf_state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("freqs" not in k and "cache" not in k for k in missing):
        raise RuntimeError(f"TorchTitan state dict mismatch: missing {missing}, "
                           f"unexpected {unexpected}")  # fmt: skip
    for param in model.parameters():
        # Parameters only: ``Module.to(dtype)`` would also cast the complex RoPE table to real.
        param.data = param.data.to(dtype)
    return model.train()


def megatron_state_from_hf(hf_state: dict, shape: dict) -> dict:
    """transformers Llama tensors under Megatron-Core's local-spec names: Q|K|V fused and
    interleaved per query group (each group's query heads, then its key, then its value),
    ``linear_fc1`` = [gate; up]. Megatron's RoPE rotates halves as transformers' does."""
    heads, groups = shape["heads"], shape["kv_heads"]
    d = shape["hidden"] // heads
    state = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
             "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}  # fmt: skip
    if not shape["tied"]:
        state["output_layer.weight"] = hf_state["lm_head.weight"]
    for i in range(shape["layers"]):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf_state[hf + "self_attn.q_proj.weight"].view(groups, heads // groups * d, -1)
        k = hf_state[hf + "self_attn.k_proj.weight"].view(groups, d, -1)
        v = hf_state[hf + "self_attn.v_proj.weight"].view(groups, d, -1)
        state[mc + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).flatten(0, 1)
        state[mc + "self_attention.linear_proj.weight"] = hf_state[hf + "self_attn.o_proj.weight"]
        state[mc + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        state[mc + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        gate_up = [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]]
        state[mc + "mlp.linear_fc1.weight"] = torch.cat(gate_up, 0)
        state[mc + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"]
    return state


def start_megatron(device: torch.device, folder: Path) -> None:
    """A one-rank process group and Megatron's parallel state (plus, on a CPU, the shims
    ENVIRONMENT.md lists: Megatron asks CUDA for the current device and forks a CUDA RNG)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cpu":
        torch.cuda.current_device = lambda: torch.device("cpu")
        tensor_parallel.random.CudaRNGStatesTracker.fork = (
            lambda self, name=None: contextlib.nullcontext()  # dropout is 0: no draws
        )
    if not dist.is_initialized():
        store = dist.FileStore(str(folder / "megatron-store"), 1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def megatron_llama(shape: dict, hf_model, dtype: torch.dtype, device: torch.device, folder):
    """Megatron-Core's GPTModel, local layer spec (its non-Transformer-Engine modules), with
    the transformers weights; returns the model and the causal mask its forward takes."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    start_megatron(device, folder)
    config = TransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"], num_query_groups=shape["kv_heads"],
        ffn_hidden_size=shape["ffn"], normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu",
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.sharded_state_dict_keys_map = {}  # module names, not TE checkpoint names
    with torch.device(device):
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=shape["vocab"],
            max_sequence_length=shape["seq"], position_embedding_type="rope",
            rotary_base=int(rope_theta(hf_model.config)),
            share_embeddings_and_output_weights=shape["tied"],
        )  # fmt: skip
    hf_state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(
        megatron_state_from_hf(hf_state, shape), strict=False
    )
    if unexpected or any("_extra_state" not in k for k in missing):
        raise RuntimeError(
            f"Megatron state dict mismatch: missing {missing}, unexpected {unexpected}"
        )
    # True = masked out (Megatron's own default mask is made on "cuda").
    s = shape["seq"]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    return model.to(device).train(), mask


def shardwork_llama(folder: Path, variant: str, dtype: torch.dtype, device: torch.device):
    """shardwork's GPTModel at world 1 from the transformers folder. ``variant`` is a kernel
    backend, optionally ``:unfused-loss`` (materialised logits + cross entropy instead of the
    default fused linear cross-entropy)."""
    from shardwork.models.hf import from_pretrained

    backend, _, option = variant.partition(":")
    if option not in ("", "unfused-loss"):
        raise ValueError(f"--backends {variant!r}: the option after ':' must be 'unfused-loss'")
    model = from_pretrained(
        folder,
        device=device,
        params_dtype=dtype,
        kernel_backend=backend,
        fused_linear_cross_entropy=option != "unfused-loss",
    )
    return model.train()


def make_sides(args, shape, dtype, device, ids, labels, folder) -> tuple[list[Side], dict]:
    """Build every contender that imports; the rest are recorded with the reason."""
    sides, skipped = [], {}
    hf = hf_llama(shape, dtype, device)
    hf.save_pretrained(folder)

    def hf_loss():
        return hf(input_ids=ids, labels=ids).loss

    for backend in args.backends:
        try:
            sw = shardwork_llama(folder, backend, dtype, device)
        except Exception as err:  # a broken side is a result, not a crash
            skipped[f"shardwork[{backend}]"] = f"{type(err).__name__}: {err}"
            continue

        def sw_loss(model=sw):
            loss_sum, num_tokens = model(ids, labels=labels)
            return loss_sum / num_tokens

        sides.append(Side(f"shardwork[{backend}]", sw_loss, list(sw.parameters())))
    sides.append(Side("transformers", hf_loss, list(hf.parameters())))
    if "torchtitan" in args.peers:
        try:
            titan = titan_llama(shape, hf, dtype, device)

            def titan_loss(model=titan):
                logits = model(ids)
                return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

            sides.append(Side("torchtitan", titan_loss, list(titan.parameters())))
        except Exception as err:
            skipped["torchtitan"] = f"{type(err).__name__}: {err}"
    if "megatron" in args.peers:
        try:
            sides.append(megatron_side(shape, hf, dtype, device, ids, labels, folder))
        except Exception as err:
            skipped["megatron"] = f"{type(err).__name__}: {err}"
    return sides, skipped


def megatron_side(shape, hf, dtype, device, ids, labels, folder) -> Side:
    """Megatron's GPTModel returns per-token losses ``[b, s]`` (vocab-parallel cross entropy in
    fp32); it has no ignore index, so the last position gets label 0 and is left out."""
    model, mask = megatron_llama(shape, hf, dtype, device, folder)
    positions = torch.arange(shape["seq"], device=device).expand_as(ids)
    targets = labels.clamp(min=0)

    def loss():
        losses = model(ids, positions, attention_mask=mask, labels=targets)
        return losses[:, :-1].float().mean()

    return Side("megatron", loss, list(model.parameters()))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_step0(sides: list[Side], dtype: torch.dtype) -> dict[str, float]:
    """Each side's loss on the first batch, before any update; sides that disagree with the
    first (shardwork) beyond the dtype's tolerance are dropped from the timing."""
    losses = {}
    with torch.no_grad():
        for side in sides:
            losses[side.name] = float(side.loss())
    reference = losses[sides[0].name]
    for side in list(sides):
        if abs(losses[side.name] - reference) > LOSS_RTOL[dtype] * abs(reference):
            sides.remove(side)
    return losses


def peak_memory(side: Side, device: torch.device) -> float | None:
    """GiB allocated at the peak of one step beyond what was allocated before it (GPU only)."""
    if device.type != "cuda":
        side.step()
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    side.step()
    synchronize(device)
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def time_rounds(
    sides: list[Side],
    device: torch.device,
    rounds: int,
    steps: int,
    clock=time.perf_counter,
    each_round: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each side in every round, the sides interleaved round by round
    (``clock``: wall time, or ``time.process_time`` for the CPU time of this process);
    ``each_round`` runs after every round's sides (the floor's parts, so they drift with the
    machine as the sides do)."""
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    for r in range(rounds):
        order = sides if r % 2 == 0 else sides[::-1]  # no side always runs first
        for side in order:
            synchronize(device)
            start = clock()
            for _ in range(steps):
                side.step()
            synchronize(device)
            times[side.name].append((clock() - start) / steps)
        if each_round is not None:
            each_round()
    return times


def model_flops_per_step(folder: Path, shape: dict) -> float:
    """Training FLOPs of one step by shardwork's calculator (causal attention, no recompute)."""
    from shardwork.models.calculator import flops_per_token
    from shardwork.models.hf import gpt_config_from_hf, read_hf_config

    config = gpt_config_from_hf(read_hf_config(folder))
    return flops_per_token(config, shape["seq"]) * shape["seq"] * shape["batch"]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return machine_record()["cpu"]


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="model shape (default: cpu-small on a CPU, 1b on a GPU)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="parameter and activation dtype (default: float32 on a CPU, bfloat16 on a GPU)",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["auto"],
        help="shardwork variants to run: a kernel backend (auto, torch, triton), optionally "
        "with ':unfused-loss' (e.g. auto:unfused-loss)",
    )
    parser.add_argument("--peers", nargs="*", default=["transformers", "torchtitan", "megatron"])
    parser.add_argument(
        "--peer-path",
        default=os.environ.get("SHARDWORK_PEERS"),
        help="folder holding peers installed beside the project (TorchTitan)",
    )
    parser.add_argument(
        "--optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="torch AdamW implementation on every side (fused: each framework's own default)",
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this process's CPU time (CPU only; on a shared, loaded machine "
        "other processes stretch wall time but not what the sides cost; use with --threads 1)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="CPU: also time the step's products, attention and optimizer alone "
        "(dense_floor.py) and give each side's step over that floor",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--suffix", default="",
                        help="appended to the result files' name (another machine's record)")  # fmt: skip
    return parser.parse_args(argv)  # fmt: skip


def rows_for(times, losses, memory, skipped, flops, peak, shape) -> list[dict]:
    """One table row per side, with ratios against the first shardwork side.

    ``times``: seconds per step of each side in every round. ``ratio_vs_shardwork`` is the
    median over rounds of the side's time over shardwork's in the same round, so a drift of the
    machine's speed between rounds (a shared host's other tenants) cancels out of each ratio;
    ``ratio_range`` is its smallest and largest round."""
    tokens = shape["seq"] * shape["batch"]
    base = next((t for name, t in times.items() if name.startswith("shardwork")), None)
    rows = []
    for name, loss in losses.items():
        rounds = times.get(name)
        row = {"side": name, "step0_loss": loss, "timed": rounds is not None}
        if rounds is not None:
            seconds = statistics.median(rounds)
            row.update(step_ms=seconds * 1e3, tokens_per_s=tokens / seconds,
                       round_ms=[t * 1e3 for t in rounds], peak_gib=memory.get(name))  # fmt: skip
            if base:
                paired = [t / b for t, b in zip(rounds, base)]
                row.update(ratio_vs_shardwork=statistics.median(paired),
                           ratio_range=[min(paired), max(paired)])  # fmt: skip
            if peak:
                row["mfu_pct"] = 100 * flops / seconds / peak
        rows.append(row)
    rows += [{"side": name, "not_run": why} for name, why in skipped.items()]
    return rows


def markdown(result: dict) -> str:
    lines = [
        f"# Dense training step: {result['shape_name']} on {result['device']}",
        "",
        f"{result['dtype']}, tokens per step {result['tokens_per_step']}, "
        f"{result.get('optimizer', 'AdamW')} on every side; median of {result['rounds']} "
        f"interleaved rounds of "
        f"{result['steps']} steps, {result['clock']} time, {result['threads']} thread(s). ratio = "
        "median over rounds of the side's step time / shardwork's in the same round (> 1: "
        "shardwork faster); range: the smallest and largest round. MFU: model FLOPs (shardwork's "
        "calculator, causal) / datasheet dense bf16 peak.",
        "",
        "| side | step-0 loss | step ms | tokens/s | ratio | range | MFU % | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    def spread(low_high):
        return "" if low_high is None else f"{low_high[0]:.3f}–{low_high[1]:.3f}"

    for row in result["rows"]:
        if "not_run" in row:
            lines.append(f"| {row['side']} | not run: {row['not_run'][:160]} | | | | | | |")
            continue
        lines.append(
            f"| {row['side']} | {row['step0_loss']:.6f} | {fmt(row.get('step_ms'), '.1f')} "
            f"| {fmt(row.get('tokens_per_s'), '.0f')} | {fmt(row.get('ratio_vs_shardwork'), '.3f')} "
            f"| {spread(row.get('ratio_range'))} "
            f"| {fmt(row.get('mfu_pct'), '.1f')} | {fmt(row.get('peak_gib'), '.2f')} |"
        )
    if result.get("floor"):
        step_ms = {r["side"]: r["step_ms"] for r in result["rows"] if r.get("step_ms")}
        lines += dense_floor.markdown(result["floor"], step_ms)
    lines += [
        "",
        f"machine: {json.dumps(result['machine'])}",
        f"environment (every side): {json.dumps(result['env'])}",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.peer_path:
        sys.path.insert(0, args.peer_path)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False here")
    device = torch.device("cuda" if cuda else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    shape_name = args.shape or ("1b" if cuda else "cpu-small")
    shape = SHAPES[shape_name]
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if args.floor and (cuda or dtype != torch.float32):
        raise SystemExit("--floor times float32 CPU products: use it with --device cpu, float32")
    torch.manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sides, skipped = make_sides(args, shape, dtype, device, ids, labels, folder)
        flops = model_flops_per_step(folder, shape)
    for side in sides:
        fused = args.optimizer == "fused"
        side.optimizer = torch.optim.AdamW(side.params, lr=1e-5, fused=fused, foreach=not fused)
    losses = check_step0(sides, dtype)
    memory = {side.name: peak_memory(side, device) for side in sides}
    for side in sides:
        for _ in range(args.warmup):
            side.step()
    clock = time.process_time if args.clock == "cpu" and not cuda else time.perf_counter
    # The floor's parts run once per round, after the sides; the optimizer is the first side's.
    floor = dense_floor.StepFloor(shape, sides[0].optimizer.step) if args.floor else None
    each_round = floor.time_round if floor else None
    times = time_rounds(sides, device, args.rounds, args.steps, clock, each_round)
    name = device_name(device)
    result = {
        "benchmark": "dense_step", "shape_name": shape_name, "shape": shape,
        "device": name, "dtype": str(dtype).removeprefix("torch."),
        "tokens_per_step": shape["seq"] * shape["batch"], "model_flops_per_step": flops,
        "peak_flops": peak_flops(name) if cuda else None, "rounds": args.rounds,
        "steps": args.steps, "optimizer": f"torch.optim.AdamW({args.optimizer})",
        "torch": torch.__version__, "machine": machine_record(),
        "env": RUNTIME_ENV,
        "clock": "cpu" if clock is time.process_time else "wall",
        "threads": torch.get_num_threads(),
        "torchtitan_import": TITAN_IMPORT.get("how"),
        "rows": rows_for(times, losses, memory, skipped, flops,
                         peak_flops(name) if cuda else None, shape),
        "floor": floor.result() if floor else None,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"dense_step-{device.type}{args.suffix}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
