"""Write the Megatron-Core checkpoint fixtures of packages/models/tests/data/megatron/.

A development aid, never a dependency, not run by CI. Run it with any interpreter: it
re-executes itself in the scratch Megatron-Core environment that ``tools/megatron_env.py``
builds from nothing (first run ~1 min; the same environment as ``tools/moe_router_golden.py``)::

    uv run python tools/megatron_checkpoint_fixture.py [CASE ...]
    uv run python tools/megatron_checkpoint_fixture.py check-export CASE DIR

The second form loads DIR (a folder ``shardwork.models.megatron.export_megatron`` wrote from the
import of case CASE) into Megatron's model of that case at its layout and prints how far its
logits are from the stored ones (the export check; a development aid, like the fixtures).

Every checkpoint is written by megatron-core 0.19.2's own ``GPTModel.sharded_state_dict()`` and
``megatron.core.dist_checkpointing.save`` (the ``torch_dist`` format) from a tiny Llama-style
model built with Megatron's *local* layer spec (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied
output, fp32, dropout 0), on 1, 4 (TP=2 x PP=2) or 2 (EP=2) gloo ranks spawned here:

- ``llama_w1_te``: world 1. Megatron's local spec carries ``sharded_state_dict_keys_map``
  (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` ->
  ``mlp.linear_fc1.layer_norm_``) so that a local-spec checkpoint has the key names of the
  Transformer-Engine spec, whose fused ``TELayerNormColumnParallelLinear`` holds the pre-norm
  weight. That is exactly how this TE-named variant was produced: the default local spec, with
  Megatron's own map. (transformer_engine cannot be installed on this CPU machine, so no TE
  module ran; TE checkpoints additionally hold ``_extra_state`` objects, which the importer
  ignores.)
- ``llama_w1_local``: world 1, the local spec with that map emptied, so the norms keep the
  local module names ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` (what
  checkpoints of specs without the map, e.g. older or custom ones, hold).
- ``llama_tp2pp2``: 4 ranks, TP=2 x PP=2, 4 layers, default (TE-named) spec.
- ``moe_ep2``: 2 ranks, EP=2, 4 experts, top-2 softmax router (allgather dispatcher,
  SequentialMLP ``local_experts``), no aux loss, default spec.
- ``moe_qb_w1``: world 1, the same MoE with quantile-balancing routing: the router's saved
  per-expert offset ``qb_beta`` is drawn at random (a trained offset; Megatron starts it at
  zero), so its forward picks experts by ``logits - qb_beta``.

Norm weights are drawn at random (Megatron initialises them to ones) so a wrong norm mapping
cannot go unnoticed. ``logits.pt`` holds, per checkpoint, the fixed token inputs, the logits
Megatron's model computes on them (``[b, s, vocab]``, gathered over TP and run through the
pipeline stages), the model hyper-parameters and the megatron-core version.

CPU shims (Megatron assumes CUDA): ``torch.cuda.current_device`` returns the CPU device,
``torch.cuda.synchronize`` does nothing, and
the CUDA RNG tracker's ``fork()`` is a no-op context (dropout is 0, so it draws nothing).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import sys
import tempfile

import megatron_env
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

OUT = pathlib.Path(__file__).resolve().parents[1] / "packages/models/tests/data/megatron"

BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=128,
    rotary_base=10000,
    layernorm_epsilon=1e-5,
)
CASES = {
    # vocab 260: the trainer's test feeds it the byte tokenizer's 257 ids
    "llama_w1_te": dict(
        world=1, tp=1, pp=1, ep=1, num_layers=2, te_names=True, seed=11, vocab_size=260
    ),
    "llama_w1_local": dict(world=1, tp=1, pp=1, ep=1, num_layers=2, te_names=False, seed=12),
    "llama_tp2pp2": dict(world=4, tp=2, pp=2, ep=1, num_layers=4, te_names=True, seed=13),
    "moe_ep2": dict(
        world=2, tp=1, pp=1, ep=2, num_layers=2, te_names=True, seed=14, experts=4, topk=2
    ),
    "moe_qb_w1": dict(
        world=1, tp=1, pp=1, ep=1, num_layers=2, te_names=True, seed=15, experts=4, topk=2,
        quantile_balancing=True,
    ),
}  # fmt: skip
BATCH, SEQ = 2, 12


def _shim_cpu() -> None:
    """Let Megatron's CUDA-minded code run on CPU (see the module docstring)."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None  # the torch_dist writer syncs before copying
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _transformer_config(case: dict):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if case.get("experts"):
        moe = dict(
            num_moe_experts=case["experts"],
            moe_router_topk=case["topk"],
            moe_ffn_hidden_size=32,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type=(
                "quantile_balancing" if case.get("quantile_balancing") else "none"
            ),
            expert_model_parallel_size=case["ep"],
        )
    return TransformerConfig(
        num_layers=case["num_layers"],
        hidden_size=BASE["hidden_size"],
        num_attention_heads=BASE["num_attention_heads"],
        num_query_groups=BASE["num_query_groups"],
        ffn_hidden_size=BASE["ffn_hidden_size"],
        layernorm_epsilon=BASE["layernorm_epsilon"],
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        init_method_std=0.05,
        tensor_model_parallel_size=case["tp"],
        pipeline_model_parallel_size=case["pp"],
        pipeline_dtype=torch.float32,
        **moe,
    )


def _build(case: dict):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=case.get("experts"), normalization="RMSNorm")
    if not case["te_names"]:
        spec.submodules.sharded_state_dict_keys_map = {}
    pp_rank = ps.get_pipeline_model_parallel_rank()
    # Every TP rank of a stage builds the same master weights (CPU init splits them), so the
    # seed depends on the stage only; expert ranks share it too (experts are seeded by index).
    torch.manual_seed(case["seed"] * 10 + pp_rank)
    model = GPTModel(
        config=_transformer_config(case),
        transformer_layer_spec=spec,
        vocab_size=case.get("vocab_size", BASE["vocab_size"]),
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=False,
        position_embedding_type="rope",
        rotary_base=BASE["rotary_base"],
    )
    gen = torch.Generator().manual_seed(case["seed"] * 100 + pp_rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("router.qb_beta"):
                # A trained offset (Megatron starts it at zero): it moves the expert choice.
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.5)
    return model.eval()


def _forward(model, case: dict, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits ``[b, s, V]`` on the last stage (None elsewhere); hidden states go by send/recv."""
    from megatron.core import parallel_state as ps

    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(SEQ, BATCH, BASE["hidden_size"])
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        # Megatron's default causal mask is made on "cuda": pass it (True = masked out).
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        out = model(tokens, positions, attention_mask=mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    return out


def _worker(
    rank: int, name: str, case: dict, store_dir: str, ckpt_dir: str, q, check: bool = False
) -> None:
    _shim_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    store = dist.FileStore(os.path.join(store_dir, "store"), case["world"])
    dist.init_process_group("gloo", rank=rank, world_size=case["world"], store=store)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=case["tp"],
        pipeline_model_parallel_size=case["pp"],
        expert_model_parallel_size=case["ep"],
    )
    model = _build(case)
    if check:  # load a folder (shardwork's export) into Megatron's model instead of saving
        state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir, strict="log_all")
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not [k for k in missing if "_extra_state" not in k], missing
        assert not unexpected, unexpected
    tokens = torch.randint(
        0, BASE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(7)
    )
    logits = _forward(model, case, tokens)
    if not check:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and q is not None:
        q.put((tokens, logits.detach().clone()))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _run(name: str, case: dict) -> dict:
    ckpt_dir = OUT / name
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    ckpt_dir.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, name, case, tmp, str(ckpt_dir), q))
            for r in range(case["world"])
        ]
        for p in procs:
            p.start()
        tokens, logits = q.get(timeout=600)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"{name}: rank exited with {p.exitcode}")
    hyper = {k: v for k, v in case.items() if k != "seed"}
    return {"tokens": tokens, "logits": logits, "config": BASE | hyper}


def check_export(name: str, folder: str) -> None:
    """Load ``folder`` (written by shardwork.models.megatron.export_megatron) into Megatron's
    model of case ``name`` at that case's layout and compare its logits with the stored ones."""
    case = CASES[name]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, name, case, tmp, folder, q, True))
            for r in range(case["world"])
        ]
        for p in procs:
            p.start()
        _, logits = q.get(timeout=600)
        for p in procs:
            p.join()
    want = torch.load(OUT / "logits.pt")["cases"][name]["logits"]
    print(f"{name}: Megatron's logits from {folder} differ by {(logits - want).abs().max():.3e}")


def main() -> None:
    megatron_env.reexec_under_megatron()  # nothing when megatron.core is importable here
    import megatron.core

    if sys.argv[1:2] == ["check-export"]:
        check_export(sys.argv[2], sys.argv[3])
        return
    names = sys.argv[1:] or list(CASES)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "logits.pt"
    stored = torch.load(path) if path.exists() else {"cases": {}}
    for name in names:
        stored["cases"][name] = _run(name, CASES[name])
        print(f"{name}: logits {tuple(stored['cases'][name]['logits'].shape)}")
    # The release only: megatron-core appends the git hash of the working directory's repository.
    stored["megatron_core_version"] = megatron.core.__version__.split("+")[0]
    torch.save(stored, path)
    print(f"wrote {path} (megatron-core {megatron.core.__version__})")


if __name__ == "__main__":
    main()
