"""``integrations.transformers.swap_routers`` on tiny random transformers models of every
supported family, against the stock model and formulas written here.

- Outputs: logits, router logits and gradients of a swapped model equal the original's.
- Losses: each load-balancing option over training steps with two micro-batches (gradient
  accumulation, loss / 2) against the stock model trained on its cross-entropy plus the loss
  formulas below (Switch aux, per-sequence aux, global aux with running counts, z-loss), and
  DeepSeek-V3's expert bias moved by ``rate · sign(mean(c) − c)`` after each step.
- Capacity dropping against a per-expert top-C written here, padding against the formulas on
  the valid tokens, save/reload in stock transformers, errors, planted bugs.

Tolerances: fp32 rounding at each tensor's scale (``assert_close_at_scale``), from the
measurements noted at each constant; routing maps, token counts and expert biases exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
testing = pytest.importorskip("shardwork.parallel_state.testing")

from shardwork.moe_router import TopKRouter  # noqa: E402
from shardwork.moe_router.integrations.transformers import (  # noqa: E402
    BALANCING_OPTIONS,
    HFRouterGate,
    router_config_for,
    swap_routers,
)
from shardwork.moe_router.integrations.transformers import gate as gate_module  # noqa: E402
from shardwork.moe_router.integrations.transformers import swap as swap_module  # noqa: E402

transformers.logging.set_verbosity_error()

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
FAMILIES = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        head_dim=8,
        norm_topk_prob=True,
    ),
    # top_k // topk_group = 3: transformers' top-2 group score differs from Megatron's default.
    "deepseek_v3": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=6,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        moe_intermediate_size=16,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    ),
}
SIGMOID_FAMILIES = {"deepseek_v3"}
BATCH, SEQ = 3, 7  # B != S: a layout mix-up changes the per-sequence loss
BIAS_RATE = 0.01

LOSS_CASES = {
    "aux": dict(load_balancing_type="aux_loss", aux_loss_coeff=0.1),
    "seq_aux": dict(load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1),
    "global_aux": dict(load_balancing_type="global_aux_loss", aux_loss_coeff=0.1),
    "z": dict(load_balancing_type="none", z_loss_coeff=0.01),
    "all": dict(
        load_balancing_type=("aux_loss", "seq_aux_loss", "global_aux_loss"),
        aux_loss_coeff=(0.1, 0.2, 0.3),
        z_loss_coeff=0.01,
    ),
}

# Measured (this file's cases, one thread, ulp of the tensor's max): a swapped model vs the
# original: logits <= 1.44, router logits <= 1.36, gradients <= 3.58 (Qwen2-MoE, OLMoE and
# gpt-oss bit-identical); training: aux-loss values <= 1.9, losses <= 0.9.
# Parameters after three SGD steps: <= 9.1 ulp of max|param| (gpt-oss attention biases; the
# pre-softmax families train bit-identically): each step's last-bit gradient differences are
# amplified by the next steps (a 1-ulp change of the stock model's router weights alone
# grows to 5.9 ulp over the same three steps).
ULPS = 8
PARAM_ULPS = 32
# Gradients with capacity dropping (gpt-oss, 40 seeds of model and tokens, one thread): <= 10.8
# ulp of the tensor's max, above 8 for 4 of the 40 (attention sinks, k_proj and router biases:
# small sums of larger terms of both signs) and 11.5 for seed 0 where torch draws the init
# without AVX2 (ATEN_CPU_CAPABILITY=default); the test's seed happened to measure 7.6. 24 is ~2x
# the worst; router weights off by a relative 1e-5 (a swapped model's planted mismatch) give
# 85-121 ulp there.
CAPACITY_GRAD_ULPS = 24


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: with several threads per process on shared cores each call waits for
    the others (measured 17.9 s vs 0.66 s for one training test under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(family: str, seed: int = 0, **changes) -> torch.nn.Module:
    """A tiny random ``...ForCausalLM`` of ``family`` in fp32, router weights at std 0.5 (so
    routing is decisive) and, for DeepSeek-V3, a random expert bias."""
    config = transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **changes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    return model


def token_batches(num: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (BATCH, SEQ), generator=g) for _ in range(num)]


def capture_routing(model: torch.nn.Module) -> list:
    """Hooks on the stock routers: each call appends (router_logits, weights, index)."""
    records: list = []
    for module in model.modules():
        if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
            module.register_forward_hook(lambda m, args, out: records.append(out))
    return records


def assert_close(actual, expected, name, ulps=ULPS):
    testing.assert_close_at_scale(actual, expected, rtol=0.0, ulps=ulps, name=name)


# --------------------------------------------------------------------------- formulas
def normalised_scores(logits_TE: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """The scores the losses use: softmax, or sigmoid divided by its row sum."""
    if sigmoid:
        s = torch.sigmoid(logits_TE)
        return s / s.sum(dim=-1, keepdim=True)
    return torch.softmax(logits_TE, dim=-1)


def top_k_onehot(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """1.0 at each token's plain top-k (no groups, no bias): what the losses count."""
    idx = scores_TE.detach().topk(k, dim=-1).indices
    return torch.zeros_like(scores_TE).scatter(1, idx, 1.0).detach()


def switch(scores_TE, counts_E, num_tokens, num_experts, k):
    """Switch/GShard: E / (K·T²) · Σ_i c_i · Σ_t s(t, i)."""
    return num_experts / (k * num_tokens**2) * (counts_E * scores_TE.sum(dim=0)).sum()


def layer_losses(logits_TE, *, sigmoid, k, valid_T, running):
    """Unweighted losses of one layer and call: {"aux_loss", "seq_aux_loss",
    "global_aux_loss", "z_loss"}. Rows are transformers' [B, S] order; ``valid_T`` marks
    non-padding tokens; ``running`` holds the step's global counts and calls (updated)."""
    E = logits_TE.shape[-1]
    v = valid_T.to(logits_TE.dtype).unsqueeze(-1)
    scores = normalised_scores(logits_TE, sigmoid) * v
    onehot = top_k_onehot(normalised_scores(logits_TE, sigmoid), k) * v
    n_valid = valid_T.sum()
    running["counts"] = running.get("counts", 0) + onehot.sum(0)
    running["calls"] = running.get("calls", 0) + 1
    seq = [
        switch(
            scores[b * SEQ : (b + 1) * SEQ],
            onehot[b * SEQ : (b + 1) * SEQ].sum(0),
            n_valid / BATCH,
            E,
            k,
        )  # with padding: mean valid tokens per sequence
        for b in range(BATCH)
    ]
    return {
        "aux_loss": switch(scores, onehot.sum(0), n_valid, E, k),
        "seq_aux_loss": torch.stack(seq).mean(),
        "global_aux_loss": switch(scores, running["counts"] / running["calls"], n_valid, E, k),
        "z_loss": (torch.logsumexp(logits_TE, -1) ** 2 * valid_T).sum() / n_valid,
    }


def weighted(options: dict, losses: dict) -> torch.Tensor:
    lb = options.get("load_balancing_type", "aux_loss")
    types = (lb,) if isinstance(lb, str) else lb
    coeffs = options.get("aux_loss_coeff", 0.0)
    coeffs = (coeffs,) if isinstance(coeffs, float) else coeffs
    total = sum(c * losses[t] for t, c in zip(types, coeffs) if t != "none")
    return total + (options.get("z_loss_coeff") or 0.0) * losses["z_loss"]


def reference_aux(options, router_logits, *, family, valid_T, running):
    """Σ over layers of coeff · loss for one forward of the stock model."""
    k = FAMILIES[family]["num_experts_per_tok"]
    total = torch.zeros(())
    for layer, logits in enumerate(router_logits):
        losses = layer_losses(
            logits,
            sigmoid=family in SIGMOID_FAMILIES,
            k=k,
            valid_T=valid_T,
            running=running.setdefault(layer, {}),
        )
        total = total + weighted(options, losses)
    return total


# --------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_swapped_model_matches_the_original(family):
    original = build(family)
    model = copy.deepcopy(original)
    moe = swap_routers(model)
    assert len(moe.routers) == 2 and all(isinstance(r, HFRouterGate) for r in moe.routers)
    assert list(model.state_dict()) == list(original.state_dict())
    ids = token_batches(1)[0]
    for mode in ("eval", "train"):
        getattr(original, mode)()
        getattr(model, mode)()
        expected = original(input_ids=ids, labels=ids, output_router_logits=True)
        actual = model(input_ids=ids, labels=ids, output_router_logits=True)
        assert_close(actual.logits, expected.logits, f"{family} {mode} logits")
        assert len(actual.router_logits) == len(expected.router_logits) == 2
        for a, e in zip(actual.router_logits, expected.router_logits):
            assert_close(a, e, f"{family} router logits")
        # No shardwork loss configured: transformers' own aux loss is left as it was.
        if expected.aux_loss is not None:
            assert_close(actual.aux_loss, expected.aux_loss, f"{family} aux_loss")
    expected.loss.backward()
    actual.loss.backward()
    grads = dict(original.named_parameters())
    for name, param in model.named_parameters():
        assert_close(param.grad, grads[name].grad, f"{family} grad {name}")


def test_deepseek_group_score_follows_transformers():
    """top_k // topk_group = 3: the swap scores groups by their top 2 as transformers does,
    and Megatron's default rule (top 3) would route this model's tokens elsewhere."""
    model = build("deepseek_v3")
    config = router_config_for(model)
    assert (config.num_groups, config.group_top_k, config.top_k) == (4, 2, 6)
    assert config.group_score_top_n == 2
    records = capture_routing(model)
    model(input_ids=token_batches(1)[0])
    logits_TE, _, index_TK = records[0]
    expected = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, index_TK, True)
    maps = {}
    for rule in (2, None):
        router = TopKRouter(dataclasses.replace(config, group_score_top_n=rule))
        router.expert_bias.copy_(model.model.layers[1].mlp.gate.e_score_correction_bias)
        maps[rule] = router.route(logits_TE.detach(), seq_len=BATCH * SEQ, batch=1)[1]
    assert torch.equal(maps[2], expected)
    assert not torch.equal(maps[None], expected)


# --------------------------------------------------------------------------- training
LR = 0.05
STOCK_ROUTER_SUFFIXES = ("TopKRouter", "TopkRouter")


def stock_routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith(STOCK_ROUTER_SUFFIXES)]


def train_swapped(model, options, steps, *, attention_mask=None):
    """SGD over ``steps`` (each a list of micro-batches, loss / micro-batches per backward)
    with the routers swapped; returns (losses, aux losses, the RouterSwap)."""
    moe = swap_routers(model, expert_bias_update_rate=BIAS_RATE, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    moe.attach(optimizer)
    losses, aux = [], []
    for micro_batches in steps:
        for ids in micro_batches:
            out = model(
                input_ids=ids,
                attention_mask=attention_mask,
                labels=labels_for(ids, attention_mask),
                output_router_logits=True,
            )
            (out.loss / len(micro_batches)).backward()
            losses.append(out.loss.detach())
            aux.append(out.aux_loss)
        optimizer.step()
        optimizer.zero_grad()
    return losses, aux, moe


def train_reference(model, options, steps, family, *, attention_mask=None):
    """The same steps on the stock model: its cross-entropy plus :func:`reference_aux`, and
    DeepSeek's bias moved by rate · sign(mean(c) − c) from its own routers' choices."""
    records = capture_routing(model)
    routers = stock_routers(model)
    valid_T = torch.ones(BATCH * SEQ, dtype=torch.bool)
    if attention_mask is not None:
        valid_T = attention_mask.reshape(-1).bool()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, aux = [], []
    for micro_batches in steps:
        running: dict = {}
        counts = [torch.zeros(r.weight.shape[0]) for r in routers]
        for ids in micro_batches:
            records.clear()
            labels = labels_for(ids, attention_mask)
            out = model(input_ids=ids, attention_mask=attention_mask, labels=labels)
            logits = [r[0] for r in records]
            extra = reference_aux(options, logits, family=family, valid_T=valid_T, running=running)
            loss = out.loss + extra
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach())
            aux.append(extra.detach())
            for layer, (_, _, index_TK) in enumerate(records):
                picked = index_TK[valid_T].flatten()
                counts[layer] += torch.bincount(picked, minlength=counts[layer].numel())
        optimizer.step()
        optimizer.zero_grad()
        if family in SIGMOID_FAMILIES:
            with torch.no_grad():
                for router, c in zip(routers, counts):
                    router.e_score_correction_bias += BIAS_RATE * torch.sign(c.mean() - c)
    return losses, aux


def labels_for(ids, attention_mask):
    if attention_mask is None:
        return ids
    return ids.masked_fill(attention_mask == 0, -100)


def check_training(family, options, *, attention_mask=None, num_steps=3):
    original = build(family)
    model = copy.deepcopy(original)
    steps = [token_batches(2, seed=10 + s) for s in range(num_steps)]
    losses, aux, moe = train_swapped(model, options, steps, attention_mask=attention_mask)
    ref_losses, ref_aux = train_reference(
        original, options, steps, family, attention_mask=attention_mask
    )
    for i, (a, e) in enumerate(zip(aux, ref_aux)):
        assert_close(a, e, f"{family} aux_loss of micro-batch {i}")
    assert_close(torch.stack(losses), torch.stack(ref_losses), f"{family} losses")
    expected = original.state_dict()
    for name, value in model.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(value, expected[name]), name
        else:
            assert_close(value, expected[name], f"{family} {name} after training", PARAM_ULPS)
    return moe


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_steps_with_each_loss(family, case):
    moe = check_training(family, LOSS_CASES[case])
    summary = moe.last_step_summary
    assert summary["load_imbalance"] >= 1.0
    expected_names = {
        "aux_loss": "load_balancing_loss",
        "seq_aux_loss": "seq_load_balancing_loss",
        "global_aux_loss": "global_load_balancing_loss",
    }
    types = LOSS_CASES[case]["load_balancing_type"]
    for name in (types,) if isinstance(types, str) else types:
        if name in expected_names:
            assert summary[expected_names[name]] > 0
    if family in SIGMOID_FAMILIES:
        # the bias moved: the stock model saw the same updates (checked exactly above)
        initial = build(family).state_dict()
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert not torch.equal(moe.routers[0].expert_bias, initial[bias])


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral", "gpt_oss"])
def test_padding_is_left_out_of_the_losses(family):
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[0, 5:] = 0
    attention_mask[2, 3:] = 0
    check_training(family, LOSS_CASES["all"], attention_mask=attention_mask, num_steps=1)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_gradient_checkpointing_trains_as_without(family):
    """transformers' gradient checkpointing recomputes each MoE layer in backward: the
    recomputed routers repeat their first call (global aux loss's running counts included)
    and count nothing twice, so two steps of two micro-batches give the same losses,
    weights, expert biases and step summaries as without checkpointing. (Measured with the
    recomputation treated as a new call: second micro-batch's aux loss off by 5e-3 to 4e-2.)"""
    plain = build(family)
    checkpointed = copy.deepcopy(plain)
    # transformers 5.x renamed it; the old name warns that it goes away in v6
    enable = getattr(checkpointed, "activation_checkpointing_enable", None)
    (enable or checkpointed.gradient_checkpointing_enable)()
    steps = [token_batches(2, seed=30 + s) for s in range(2)]
    losses, aux, moe = train_swapped(plain, LOSS_CASES["all"], steps)
    losses_c, aux_c, moe_c = train_swapped(checkpointed, LOSS_CASES["all"], steps)
    assert_close(torch.stack(aux_c), torch.stack(aux), f"{family} aux with checkpointing")
    assert_close(torch.stack(losses_c), torch.stack(losses), f"{family} loss with checkpointing")
    expected = plain.state_dict()
    for name, value in checkpointed.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(value, expected[name]), name
        else:
            assert_close(value, expected[name], f"{family} {name} with checkpointing")
    assert moe_c.last_step_summary.keys() == moe.last_step_summary.keys()
    for name, value in moe.last_step_summary.items():
        assert math.isclose(moe_c.last_step_summary[name], value, rel_tol=1e-6), name


# --------------------------------------------------------------------------- capacity
def drop_to_capacity_reference(weights_TK, index_TK, *, num_experts, capacity_factor, policy):
    """Each expert keeps C = ceil(T·K/E · factor) of its routed (token, slot)s: the highest
    weights (``probs``) or the earliest positions (``position``: position s before batch
    row b, i.e. the router's [S, B] order; rows here are [B, S])."""
    T, K = index_TK.shape
    capacity = math.ceil(T * K / num_experts * capacity_factor)
    keep = torch.zeros(T, K, dtype=torch.bool)
    for expert in range(num_experts):
        rows, slots = (index_TK == expert).nonzero(as_tuple=True)
        if policy == "probs":
            order = weights_TK[rows, slots].detach().argsort(descending=True)
        else:
            order = ((rows % SEQ) * BATCH + rows // SEQ).argsort()
        kept = order[:capacity]
        keep[rows[kept], slots[kept]] = True
    return weights_TK * keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capacity_drops_as_the_formula(family, policy):
    original = build(family)
    model = copy.deepcopy(original)
    swap_routers(model, capacity_factor=0.5, token_drop_policy=policy)
    dropped = []
    for router in stock_routers(original):

        def dropping(hidden, _forward=router.forward, _num=router.weight.shape[0]):
            logits, weights, index = _forward(hidden)
            kept = drop_to_capacity_reference(
                weights, index, num_experts=_num, capacity_factor=0.5, policy=policy
            )
            dropped.append(int((kept == 0).sum()))
            return logits, kept, index

        router.forward = dropping
    ids = token_batches(1)[0]
    expected = original(input_ids=ids, labels=ids)
    actual = model(input_ids=ids, labels=ids)
    assert min(dropped) > 0  # the capacity bites in every layer
    assert_close(actual.logits, expected.logits, f"{family} logits with capacity")
    expected.loss.backward()
    actual.loss.backward()
    grads = dict(original.named_parameters())
    for name, param in model.named_parameters():
        assert_close(
            param.grad, grads[name].grad, f"{family} grad {name} with capacity", CAPACITY_GRAD_ULPS
        )


# --------------------------------------------------------------------------- save / reload
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_saved_model_loads_in_stock_transformers(family, tmp_path):
    model = build(family)
    keys = list(model.state_dict())
    train_swapped(model, LOSS_CASES["all"], [token_batches(2)])
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert not any(info.values()), info
    assert not any(isinstance(m, HFRouterGate) for m in reloaded.modules())
    saved = model.state_dict()
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, saved[name]), name
    model.eval()
    ids = token_batches(1, seed=5)[0]
    assert_close(model(input_ids=ids).logits, reloaded(input_ids=ids).logits, f"{family} reloaded")


# --------------------------------------------------------------------------- errors
def test_bad_input_is_refused_before_the_model_changes():
    model = build("mixtral")
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"top_k=4 is invalid.*load_balancing_type"):
        swap_routers(model, top_k=4)
    with pytest.raises(ValueError, match=r"aux_loss_coeff=-1.0 is invalid"):
        swap_routers(model, aux_loss_coeff=-1.0)
    assert [type(m) for m in model.modules()] == classes
    assert set(BALANCING_OPTIONS) >= {"load_balancing_type", "capacity_factor", "z_loss_coeff"}
    moe = swap_routers(model)
    with pytest.raises(ValueError, match="already has shardwork routers"):
        swap_routers(model)
    moe.routers[0].token_layout = None
    with pytest.raises(ValueError, match=r"hidden shape \(5, 32\) is invalid"):
        moe.routers[0](torch.randn(5, 32))
    dense = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **COMMON)
    )
    with pytest.raises(ValueError, match="has no transformers MoE router"):
        swap_routers(dense)
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        swap_routers(build("deepseek_v3", norm_topk_prob=False))


@pytest.mark.parametrize("version", ["5.18.2", "4.57.1", "unknown"])
def test_a_transformers_older_than_the_extra_allows_is_refused(monkeypatch, version):
    """5.0-5.18 routers lack settings the swap reads (DeepSeek-V3's had no top_k): refused
    with the bound, before the model changes, not an AttributeError inside it."""
    model = build("mixtral")
    classes = [type(m) for m in model.modules()]
    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(ValueError, match=rf"transformers {version} is not supported.*>= 5\.19"):
        swap_routers(model)
    assert [type(m) for m in model.modules()] == classes


# --------------------------------------------------------------------------- planted bugs
def test_planted_layout_bug_is_caught(monkeypatch):
    """Reading transformers' [B, S] rows as [S, B] leaves the logits alone but mixes tokens
    of different sequences in the per-sequence loss: the value check catches it (measured:
    0.2930 vs 0.3171, 6.4e5 ulp)."""
    monkeypatch.setattr(gate_module, "sequence_major", lambda x: x.reshape(-1, x.shape[-1]))
    monkeypatch.setattr(gate_module, "batch_major", lambda x, batch, seq_len: x)
    with pytest.raises(AssertionError, match="aux_loss of micro-batch 0"):
        check_training("qwen3_moe", LOSS_CASES["seq_aux"], num_steps=1)


class _GradientNotCopied(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, scale):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        return grad_loss, None


def test_planted_loss_scale_bug_is_caught(monkeypatch):
    """Without the loss's gradient copied into the aux-loss scale, ``(loss / 2).backward()``
    gives the aux losses twice their weight: the parameters after one step differ (measured:
    embedding off by 6.5e-2, 6e6 ulp; the values alone would not show it)."""
    monkeypatch.setattr(swap_module, "LossGradientToScale", _GradientNotCopied)
    with pytest.raises(AssertionError, match="after training"):
        check_training("mixtral", LOSS_CASES["all"], num_steps=1)


# --------------------------------------------------------------------------- data parallel
DP_OPTIONS = dict(load_balancing_type="global_aux_loss", aux_loss_coeff=0.3)


def dp_tokens() -> list[torch.Tensor]:
    """Two micro-batches of four sequences; data-parallel rank r takes rows 2r, 2r + 1."""
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, 64, (4, SEQ), generator=g) for _ in range(2)]


def dp_step(rows: slice, dp_group) -> dict:
    """One step (two micro-batches) of the swapped DeepSeek-V3 on ``rows`` of each batch."""
    model = build("deepseek_v3")
    moe = swap_routers(model, dp_group=dp_group, expert_bias_update_rate=BIAS_RATE, **DP_OPTIONS)
    aux = []
    for ids in dp_tokens():
        out = model(input_ids=ids[rows], labels=ids[rows])
        out.loss.backward()
        aux.append(out.aux_loss)
    summary = moe.step()
    return {"aux": aux, "biases": [r.expert_bias.clone() for r in moe.routers], "summary": summary}


def _dp_rank():
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    return dp_step(slice(2 * rank, 2 * rank + 2), torch.distributed.group.WORLD)


@pytest.mark.slow  # ~30 s: two rank processes import transformers
@pytest.mark.multirank
def test_data_parallel_counts_are_summed_over_dp_group():
    """DP = 2, each rank half of every batch: the per-rank global aux losses add up to the
    one-process loss of the whole batch, and the expert bias moves by the summed counts
    (every rank the same bias, equal to one process seeing everything)."""
    results = testing.run_on_ranks(_dp_rank, 2)
    single = dp_step(slice(0, 4), None)
    for micro in range(2):
        total = results[0]["aux"][micro] + results[1]["aux"][micro]
        assert_close(total, single["aux"][micro], f"global aux loss of micro-batch {micro}")
    for res in results:
        for layer, bias in enumerate(res["biases"]):
            assert torch.equal(bias, single["biases"][layer])
        name = "global_load_balancing_loss"
        assert_close(
            torch.tensor(res["summary"][name]), torch.tensor(single["summary"][name]), name
        )
