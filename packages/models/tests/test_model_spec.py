"""Model composition from specs: a tiny family declared only here, and the presets' layouts.

The toy family below is the walk-through of docs/architecture.md ("How to add a model family")
made real: a new mixer kind and a new MLP kind registered from this file, a spec with
per-layer heterogeneity, built through the normal ``GPTModel`` path and compared with the
same network written out in plain torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwork.models import (
    PRESETS,
    DecoderSpec,
    GPTModel,
    LayerSpec,
    RotarySpec,
    ShardedModule,
    layout_groups,
    preset,
    register_mixer,
    register_mlp,
    register_norm,
    spec_for,
)
from shardwork.models.families import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES
from shardwork.models.families.twins import tiny_moe
from shardwork.models.hf import SUPPORTED_MODEL_TYPES, hf_config_from_gpt
from shardwork.models.hf.moe_adapters import MOE_MODEL_TYPES
from shardwork.models.pipeline import build_stage
from shardwork.models.sharding import describe_param
from shardwork.models.testing import random_batch
from shardwork.parallel_state import ParallelConfig, ParamMeta

# ---- the toy family: its parts, their registration, its spec and preset --------------------


def _weight(shape, dtype, device) -> torch.nn.Parameter:
    """A replicated weight, initialised from its key by GPTModel.init_parameters."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    return describe_param(param, ParamMeta(), init="normal")


class CausalMeanMixer(ShardedModule):
    """``y_t = W · mean(x_1..x_t)``: a token mixer with no attention (whole sequences only)."""

    def __init__(self, config, groups, device) -> None:
        super().__init__(groups)
        h = config.hidden_size
        self.weight = _weight((h, h), config.params_dtype, device)

    def forward(self, hidden, inputs):
        steps = torch.arange(1, hidden.shape[0] + 1, dtype=hidden.dtype, device=hidden.device)
        return (hidden.cumsum(0) / steps[:, None, None]) @ self.weight.t()


class SquaredReLUMLP(ShardedModule):
    """``W_out · relu(W_in · x)²`` (Primer's MLP)."""

    def __init__(self, config, groups, device) -> None:
        super().__init__(groups)
        h, f = config.hidden_size, config.ffn_hidden_size
        self.w_in = _weight((f, h), config.params_dtype, device)
        self.w_out = _weight((h, f), config.params_dtype, device)

    def forward(self, hidden):
        return F.relu(hidden @ self.w_in.t()).square() @ self.w_out.t()


def _whole_sequences_only(ctx) -> None:
    if ctx.groups.size("tp") > 1 or ctx.groups.size("cp") > 1:
        raise ValueError("the toy family runs with tp=1 and cp=1 only")


def _build_mixer(ctx, layer_number):
    _whole_sequences_only(ctx)
    return CausalMeanMixer(ctx.config, ctx.groups, ctx.device)


def _build_mlp(ctx, layer_number):
    _whole_sequences_only(ctx)
    return SquaredReLUMLP(ctx.config, ctx.groups, ctx.device)


class CenteredNorm(ShardedModule):
    """LayerNorm without a bias, ``(x - mean) / sqrt(var + eps) * w``: a norm kind."""

    def __init__(self, size, config, groups, device) -> None:
        super().__init__(groups)
        self.eps = config.norm_epsilon
        param = torch.nn.Parameter(torch.empty(size, dtype=config.params_dtype, device=device))
        self.weight = describe_param(param, ParamMeta(), init="ones")

    def forward(self, hidden):
        centred = hidden - hidden.mean(-1, keepdim=True)
        return (
            centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + self.eps) * self.weight
        )


register_mixer("causal_mean", _build_mixer)
register_mlp("toy_relu2", _build_mlp)
register_norm("centered", lambda ctx, size: CenteredNorm(size, ctx.config, ctx.groups, ctx.device))


def toy_config():
    return preset("tiny-llama2-7b", num_layers=3, params_dtype=torch.float64, init_method_std=0.2)


def toy_spec(config, norms=("rmsnorm",) * 4) -> DecoderSpec:
    """Mean-mixer layers; the middle layer's MLP is the squared-ReLU one. ``norms``: the kinds
    of the three layers' norms and of the final norm."""
    mlps = ["dense", "toy_relu2", "dense"]
    return DecoderSpec(
        layers=tuple(LayerSpec(mixer="causal_mean", mlp=m, norm=n) for m, n in zip(mlps, norms)),
        rotary=RotarySpec(config.kv_channels),
        final_norm=norms[3],
    )


# ---- the same network in plain torch -------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _centered(x, w, eps):
    return F.layer_norm(x, x.shape[-1:], eps=eps) * w


def _reference_logits(p: dict[str, torch.Tensor], ids, cfg, norms=(_rms,) * 4) -> torch.Tensor:
    eps, f = cfg.norm_epsilon, cfg.ffn_hidden_size
    x = F.embedding(ids.t(), p["embedding.weight"])  # [s, b, h]
    steps = torch.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None, None]
    for i, kind in enumerate(["dense", "toy_relu2", "dense"]):
        pre, norm = f"decoder.layers.{i}.", norms[i]
        n = norm(x, p[pre + "input_layernorm.weight"], eps)
        x = x + (n.cumsum(0) / steps) @ p[pre + "self_attention.weight"].t()
        n = norm(x, p[pre + "pre_mlp_layernorm.weight"], eps)
        if kind == "dense":
            gate_up = n @ p[pre + "mlp.fc1.weight"].t()
            mid = F.silu(gate_up[..., :f]) * gate_up[..., f:]
            x = x + mid @ p[pre + "mlp.fc2.weight"].t()
        else:
            mid = F.relu(n @ p[pre + "mlp.w_in"].t()).square()
            x = x + mid @ p[pre + "mlp.w_out"].t()
    x = norms[3](x, p["decoder.final_norm.weight"], eps)
    return x @ p["output_layer.linear.weight"].t()  # [s, b, V_pad]


def test_toy_family_trains_through_gpt_model_like_plain_torch():
    cfg = toy_config()
    model = GPTModel(cfg, spec=toy_spec(cfg))
    ids, labels = random_batch(cfg.vocab_size, seq=12, seed=3)
    ref_params = {n: q.detach().clone().requires_grad_() for n, q in model.named_parameters()}
    assert {n for n in ref_params if "self_attention" in n or ".mlp." in n} == {
        "decoder.layers.0.self_attention.weight",
        "decoder.layers.0.mlp.fc1.weight",
        "decoder.layers.0.mlp.fc2.weight",
        "decoder.layers.1.self_attention.weight",
        "decoder.layers.1.mlp.w_in",
        "decoder.layers.1.mlp.w_out",
        "decoder.layers.2.self_attention.weight",
        "decoder.layers.2.mlp.fc1.weight",
        "decoder.layers.2.mlp.fc2.weight",
    }
    ref_logits = _reference_logits(ref_params, ids, cfg)
    v = cfg.vocab_size
    # float64 end to end; measured: logits bit-equal, loss_sum off by 3e-14 of 149, gradients
    # by 1e-14 where they reach 15 (summation order), so the bounds leave ~10x headroom.
    torch.testing.assert_close(model(ids)[..., :v], ref_logits[..., :v], rtol=1e-12, atol=1e-12)
    loss_sum, num_tokens = model(ids, labels=labels)
    ref_flat = ref_logits[..., :v].transpose(0, 1).reshape(-1, v)
    ref_loss = F.cross_entropy(ref_flat, labels.reshape(-1), ignore_index=-100, reduction="sum")
    assert int(num_tokens) == int((labels != -100).sum())
    torch.testing.assert_close(loss_sum, ref_loss, rtol=1e-14, atol=0.0)
    loss_sum.backward()
    ref_loss.backward()
    for name, param in model.named_parameters():
        # padded embedding/head rows get no gradient in either; compare the real rows.
        torch.testing.assert_close(
            param.grad[:v] if param.shape[0] > v else param.grad,
            ref_params[name].grad[:v] if param.shape[0] > v else ref_params[name].grad,
            rtol=1e-12,
            atol=1e-13,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_a_registered_norm_kind_builds_the_chosen_layers_and_final_norm():
    """Layer 1 and the final norm of the toy family take the ``centered`` kind; the forward
    equals plain torch with F.layer_norm there and RMSNorm elsewhere."""
    cfg = toy_config()
    model = GPTModel(cfg, spec=toy_spec(cfg, ("rmsnorm", "centered", "rmsnorm", "centered")))
    assert isinstance(model.decoder.layers[1].input_layernorm, CenteredNorm)
    assert isinstance(model.decoder.final_norm, CenteredNorm)
    assert not isinstance(model.decoder.layers[0].pre_mlp_layernorm, CenteredNorm)
    params = {n: q.detach() for n, q in model.named_parameters()}
    # the norms' weights start at ones: give them random values so a swapped norm shows
    gen = torch.Generator().manual_seed(5)
    for name, value in params.items():
        if "norm" in name:
            value.copy_(1 + 0.3 * torch.randn(value.shape, generator=gen, dtype=value.dtype))
    ids, _ = random_batch(cfg.vocab_size, seq=12, seed=4)
    ref = _reference_logits(params, ids, cfg, (_rms, _centered, _rms, _centered))
    v = cfg.vocab_size
    # float64; the same bound as the toy family's test above
    torch.testing.assert_close(model(ids)[..., :v], ref[..., :v], rtol=1e-12, atol=1e-12)
    # a planted swap (RMSNorm where the spec says centered) is far outside that bound
    swapped = _reference_logits(params, ids, cfg, (_rms, _rms, _rms, _centered))
    assert (swapped[..., :v] - ref[..., :v]).abs().max() > 1e-3


def test_toy_family_state_dict_uses_the_usual_layer_keys():
    cfg = toy_config()
    keys = set(GPTModel(cfg, spec=toy_spec(cfg)).sharded_state_dict())
    assert "decoder.layers.1.mlp.w_in" in keys
    assert "decoder.layers.2.self_attention.weight" in keys
    assert not any("linear_qkv" in k for k in keys)


def test_toy_family_pipeline_stages_hold_the_world_one_weights():
    """``build_stage(spec=)``: two pp stages (meta-built, then materialised) split the toy
    model's parameters between them with the world-1 model's keys and initial values."""
    cfg = toy_config()
    whole = {key: p for key, p, _ in GPTModel(cfg, spec=toy_spec(cfg)).named_param_keys()}
    seen: dict[str, torch.Tensor] = {}
    for rank in range(2):
        groups = layout_groups(ParallelConfig(pp=2), 2, rank)
        stage = build_stage(
            cfg, groups, first_stage_layers=1, device="meta", spec=toy_spec(cfg)
        ).materialize("cpu")
        assert stage.decoder.layer_range == [(0, 1), (1, 3)][rank]
        for key, param, _ in stage.named_param_keys():
            assert key not in seen, key
            seen[key] = param
    assert set(seen) == set(whole)
    for key, param in seen.items():
        assert torch.equal(param, whole[key]), key


def test_unknown_kind_and_wrong_layer_count_are_named():
    cfg = toy_config()
    bad_kind = DecoderSpec(
        layers=(LayerSpec(mixer="mamba9"),) * 3, rotary=RotarySpec(cfg.kv_channels)
    )
    with pytest.raises(ValueError, match=r"LayerSpec.mixer='mamba9'.*known are \["):
        GPTModel(cfg, spec=bad_kind)
    too_short = DecoderSpec(layers=(LayerSpec(),) * 2, rotary=RotarySpec(cfg.kv_channels))
    with pytest.raises(ValueError, match=r"DecoderSpec.layers has 2 entries.*num_layers=3"):
        GPTModel(cfg, spec=too_short)
    with pytest.raises(ValueError, match="mixer kind 'causal_mean' is already registered"):
        register_mixer("causal_mean", _build_mlp)


# ---- the presets' layouts, as each family documents them -----------------------------------

A, M = LayerSpec("attention", "dense"), LayerSpec("attention", "moe")
MLA_DENSE, MLA_MOE = LayerSpec("mla", "dense"), LayerSpec("mla", "moe")

LAYOUTS = {
    "llama2-7b": ([A] * 32, [], (128, False)),
    "llama3-8b": ([A] * 32, [], (128, False)),
    "llama3.1-70b": ([A] * 80, [], (128, False)),
    "llama3.2-1b": ([A] * 16, [], (64, False)),
    "qwen2.5-7b": ([A] * 28, [], (128, False)),
    "qwen3-8b": ([A] * 36, [], (128, False)),
    "tiny-qwen3-8b": ([A] * 2, [], (16, False)),
    "mixtral-8x7b": ([M] * 32, [], (128, False)),
    "qwen3-30b-a3b": ([M] * 48, [], (128, False)),
    "qwen2-57b-a14b": ([M] * 28, [], (128, False)),
    "tiny-qwen2-57b-a14b": ([M] * 2, [], (16, False)),
    "deepseek-v3": ([MLA_DENSE] * 3 + [MLA_MOE] * 58, [MLA_MOE], (64, True)),
    "deepseek-v2-lite": ([MLA_DENSE] + [MLA_MOE] * 26, [], (64, True)),
    "tiny-deepseek-v3": ([MLA_DENSE, MLA_MOE, MLA_MOE], [MLA_MOE], (8, True)),
    "tiny-deepseek-v2-lite": ([MLA_DENSE, MLA_MOE, MLA_MOE], [], (8, True)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_spec_for_gives_the_family_layout(name):
    layers, mtp, (rope_dim, interleaved) = LAYOUTS[name]
    spec = spec_for(preset(name))
    assert list(spec.layers) == layers
    assert list(spec.mtp) == mtp
    assert (spec.rotary.dim, spec.rotary.interleaved) == (rope_dim, interleaved)


def test_spec_for_follows_the_moe_layer_frequency_and_pattern():
    every_other = preset("tiny-mixtral-8x7b", num_layers=5, moe=tiny_moe(layer_freq=2))
    assert list(spec_for(every_other).layers) == [M, A, M, A, M]
    pattern = preset(
        "tiny-mixtral-8x7b", num_layers=5, moe=tiny_moe(first_k_dense_replace=1, layer_freq=3)
    )
    assert list(spec_for(pattern).layers) == [A, M, A, A, M]
    explicit = preset("tiny-mixtral-8x7b", num_layers=4, moe=tiny_moe(layer_freq=(0, 1, 1, 0)))
    assert list(spec_for(explicit).layers) == [A, M, M, A]


def test_every_preset_belongs_to_one_family_and_maps_to_its_hf_model_type():
    owners: dict[str, str] = {}
    for family in FAMILIES:
        for name, make in family.PRESETS.items() | family.TINY_PRESETS.items():
            assert name not in owners, f"{name} in {owners.get(name)} and {family.__name__}"
            owners[name] = family.__name__
            assert hf_config_from_gpt(make())["model_type"] in family.HF_MODEL_TYPES, name
    assert set(owners) == set(PRESETS)
    dense_types = {t for f in DENSE_FAMILIES for t in f.HF_MODEL_TYPES}
    moe_types = {t for f in MOE_FAMILIES for t in f.HF_MODEL_TYPES}
    assert dense_types | moe_types == set(SUPPORTED_MODEL_TYPES)
    # the experts-layout adapters serve MoE families; so does qwen3_next's converted layout
    assert set(MOE_MODEL_TYPES) <= moe_types
    for family in MOE_FAMILIES:
        assert all(make().moe is not None for make in family.PRESETS.values()), family.__name__


def test_moe_state_follows_the_config_even_without_moe_layers():
    all_dense = preset("tiny-mixtral-8x7b", moe=tiny_moe(first_k_dense_replace=2))
    assert list(spec_for(all_dense).layers) == [A, A]
    model = GPTModel(all_dense)
    assert tuple(model.aux_loss_tracker.tokens_per_expert.shape) == (2, 8)
    assert model.aux_loss_scale is not None
    dense = GPTModel(preset("tiny-llama3-8b"))
    assert (dense.aux_loss_tracker, dense.aux_loss_scale) == (None, None)
