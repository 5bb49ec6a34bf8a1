"""The MoE layers compared by ``models_moe.py --peers``: shardwork's and its peers', one weight set.

Each case (Mixtral-, Qwen3-MoE- and DeepSeek-V3-style routing at hidden 512) is a one-layer
transformers model whose random weights every side shares:

- transformers: the model's sparse MoE block with ``experts_implementation="grouped_mm"``
  (torch's grouped matmul over expert-sorted rows; router and shared experts included);
- shardwork: ``GPTModel`` built from the same config through the Hugging Face bridge
  (``gpt_config_from_hf``, weights by ``load_hf_moe_state_dict``) with the load-balancing loss
  off, as transformers' block computes none; its ``MoELayer`` is timed;
- Megatron-Core 0.19.2: ``MoELayer`` from ``get_moe_module_spec(use_te=False)`` (router,
  all-gather dispatcher, ``SequentialMLP`` experts, shared expert) with the weights copied from
  shardwork's layer. It runs on CPU from a folder of its own (``--peer-path``: the wheel
  installed with ``--no-deps`` beside einops) with three shims: ``torch.cuda.current_device``
  answers ``cpu``, the JIT fuser is off, and a one-rank gloo group holds its parallel state.

Every side gets ``x [T, H]`` (as ``[T, 1, H]`` or ``[1, T, H]``) and the same output gradient;
``check`` compares outputs and input gradients before anything is timed.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

HIDDEN = 512
# transformers config fields per case (one layer; DeepSeek's attention fields only make the
# config valid, attention is not timed).
CASES = {
    "mixtral": dict(
        model_type="mixtral",
        intermediate_size=1792,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        intermediate_size=1024,
        moe_intermediate_size=192,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        intermediate_size=1024,
        moe_intermediate_size=128,
        n_routed_experts=64,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=0,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
    ),
}


@dataclass
class MoESide:
    """One implementation's layer: ``run(x [T, H], dy [T, H]) -> (y, dx)`` both ``[T, H]``."""

    name: str
    run: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    params: list[torch.nn.Parameter]


def describe(case: str) -> str:
    """One line of the case's routing and sizes."""
    c = CASES[case]
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    ffn = c.get("moe_intermediate_size", c["intermediate_size"])
    shared = ", 1 shared expert" if c.get("n_shared_experts") else ""
    return f"{experts} experts, top-{c['num_experts_per_tok']}, expert ffn {ffn}{shared}"


def hf_model(case: str):
    """The one-layer transformers model of ``case`` with seeded random weights (router weights
    and DeepSeek's score-correction bias scaled so routing is not a tie)."""
    import transformers

    fields = dict(CASES[case])
    model_type = fields.pop("model_type")
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        tie_word_embeddings=False,
        **fields,
    )
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or "norm" in name:
                continue
            scale = 0.3 if ".gate.weight" in name else 0.05
            t.copy_(scale * torch.randn(t.shape, generator=gen))
    return model.train()


def hf_side(model) -> MoESide:
    block = model.model.layers[0].mlp
    h = HIDDEN

    def run(x, dy):
        xs = x.view(1, -1, h).clone().requires_grad_(True)
        y = block(xs)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(dy.view(1, -1, h))
        return y.detach().view(-1, h), xs.grad.view(-1, h)

    return MoESide("transformers", run, list(block.parameters()))


def shardwork_layer(model):
    """shardwork's ``MoELayer`` with ``model``'s weights (load-balancing loss off)."""
    from shardwork.models import GPTModel
    from shardwork.models.hf import gpt_config_from_hf
    from shardwork.models.hf.moe_weights import load_hf_moe_state_dict
    from shardwork.models.moe import MoELayer

    config = gpt_config_from_hf(model.config.to_dict())
    router = dataclasses.replace(config.moe.router, load_balancing_type="none", aux_loss_coeff=0.0)
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, router=router))
    gpt = GPTModel(config)
    load_hf_moe_state_dict(gpt, model.state_dict())
    layer = next(m for m in gpt.modules() if isinstance(m, MoELayer))
    return layer.train(), config


def shardwork_side(layer) -> MoESide:
    h = HIDDEN

    def run(x, dy):
        xs = x.view(-1, 1, h).clone().requires_grad_(True)
        y = layer(xs)
        y.backward(dy.view(-1, 1, h))
        return y.detach().view(-1, h), xs.grad.view(-1, h)

    return MoESide("shardwork", run, list(layer.parameters()))


def load_megatron() -> str | None:
    """Import Megatron-Core for CPU use (see module docstring); None, or why it failed."""
    try:
        warnings.filterwarnings("ignore", module="megatron")
        torch.cuda.current_device = lambda: torch.device("cpu")
        import megatron.core.jit as mjit

        mjit.disable_jit_fuser()
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not dist.is_initialized():
            store = tempfile.mkdtemp()
            dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
    except Exception as err:  # a peer that cannot run is a result, recorded by the caller
        return f"{type(err).__name__}: {err}"
    return None


def _megatron_config(sw_config):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe, router = sw_config.moe, sw_config.moe.router
    routing = dict(
        num_moe_experts=router.num_experts,
        moe_router_topk=router.top_k,
        moe_router_score_function=router.score_function,
        moe_router_pre_softmax=router.pre_softmax,
        moe_router_num_groups=router.num_groups,
        moe_router_group_topk=router.group_top_k,
        moe_router_topk_scaling_factor=router.top_k_scaling_factor,
        moe_router_enable_expert_bias=router.enable_expert_bias,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
    )
    return TransformerConfig(
        num_layers=1,
        hidden_size=sw_config.hidden_size,
        num_attention_heads=4,
        ffn_hidden_size=moe.ffn_hidden_size,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        **routing,
    )


@torch.no_grad()
def _copy_weights(mlayer, layer) -> None:
    """shardwork's weights into Megatron's layer (both keep fc1 as [gate | up])."""
    mlayer.router.weight.copy_(layer.router.weight)
    if layer.router.expert_bias is not None:
        mlayer.router.expert_bias.copy_(layer.router.expert_bias)
    fc1, fc2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    for e, expert in enumerate(mlayer.experts.local_experts):
        expert.linear_fc1.weight.copy_(fc1[e])
        expert.linear_fc2.weight.copy_(fc2[e])
    if layer.shared_experts is not None:
        mlayer.shared_experts.linear_fc1.weight.copy_(layer.shared_experts.fc1.weight)
        mlayer.shared_experts.linear_fc2.weight.copy_(layer.shared_experts.fc2.weight)


def megatron_side(layer, sw_config) -> MoESide:
    """Megatron-Core's ``MoELayer`` with ``layer``'s weights (call ``load_megatron`` first)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import moe_utils

    config = _megatron_config(sw_config)
    builder = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    mlayer = builder(config, layer_number=1, pg_collection=moe_utils.get_default_pg_collection())
    _copy_weights(mlayer, layer)
    mlayer.train()
    h = HIDDEN

    def run(x, dy):
        xs = x.view(-1, 1, h).clone().requires_grad_(True)
        y, _ = mlayer(xs)
        y.backward(dy.view(-1, 1, h))
        return y.detach().view(-1, h), xs.grad.view(-1, h)

    return MoESide("megatron-core", run, list(mlayer.parameters()))


def max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())
