"""Aux-loss scaler and tracker: injected gradients equal scale · d(coeff·loss)/d(input).

The losses are recomputed here from their textbook formulas on plain tensors (no router
code); the router's contribution is isolated as (train-mode grad) − (eval-mode grad), since
eval mode routes identically and attaches no loss.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.moe_router import AuxLossScale, AuxLossTracker, RouterConfig, TopKRouter

E, H, K, S, B = 8, 12, 2, 6, 3


# Cross-implementation (fast path vs a plain formula, fp64): CI reruns these with other
# CPU kernels forced (.ci/run).
pytestmark = pytest.mark.golden


def _formula_losses(x_SBH, weight, score_function="softmax"):
    """Independent formulas: aux (Switch), seq aux (mean over sequences), z-loss."""
    logits = x_SBH.reshape(-1, H) @ weight.t()
    if score_function == "softmax":
        s = torch.softmax(logits, -1)
    else:
        s = torch.sigmoid(logits)
        s = s / s.sum(-1, keepdim=True)
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter(1, s.topk(K, dim=1).indices, True)
    T = s.shape[0]
    f = chosen.to(s.dtype).sum(0) / (T * K)
    aux = E * (f * s.mean(0)).sum()
    s_SBE, c_SBE = s.view(S, B, E), chosen.view(S, B, E)
    seq = torch.stack(
        [
            E * ((c_SBE[:, b].to(s.dtype).sum(0) / (S * K)) * s_SBE[:, b].mean(0)).sum()
            for b in range(B)
        ]
    ).mean()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return {"aux_loss": aux, "seq_aux_loss": seq, "global_aux_loss": aux, "z": z}


def _grad(router, x, g):
    x = x.clone().requires_grad_(True)
    probs, _ = router(x)
    (probs * g).sum().backward()
    return x.grad


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("loss_type", ["aux_loss", "seq_aux_loss", "global_aux_loss", "z"])
def test_injected_gradient_is_scaled_loss_gradient(loss_type, score_function):
    torch.manual_seed(0)
    coeff, scale_value = 0.37, 0.25
    if loss_type == "z":
        cfg = RouterConfig(
            num_experts=E,
            hidden_size=H,
            top_k=K,
            score_function=score_function,
            load_balancing_type="none",
            z_loss_coeff=coeff,
            init_std=0.3,
        )
    else:
        cfg = RouterConfig(
            num_experts=E,
            hidden_size=H,
            top_k=K,
            score_function=score_function,
            load_balancing_type=loss_type,
            aux_loss_coeff=coeff,
            init_std=0.3,
        )
    cfg_d = cfg
    tracker = AuxLossTracker(num_layers=2, num_experts=E)
    scale = AuxLossScale(1.0)
    router = TopKRouter(cfg_d, tracker=tracker, loss_scale=scale, layer_index=1).double()
    x = torch.randn(S, B, H, dtype=torch.float64)
    g = torch.randn(S * B, E, dtype=torch.float64)

    router.eval()
    main_only = _grad(router, x, g)
    router.train()
    x_req = x.clone().requires_grad_(True)
    probs, _ = router(x_req)
    scale.set(scale_value)  # set after forward, before backward: read at backward time
    (probs * g).sum().backward()
    injected = x_req.grad - main_only

    x_ref = x.clone().requires_grad_(True)
    loss = _formula_losses(x_ref, router.weight.detach(), score_function)[loss_type]
    (scale_value * coeff * loss).backward()
    torch.testing.assert_close(injected, x_ref.grad, rtol=1e-9, atol=1e-12)

    name = {
        "aux_loss": "load_balancing_loss",
        "seq_aux_loss": "seq_load_balancing_loss",
        "global_aux_loss": "global_load_balancing_loss",
        "z": "z_loss",
    }[loss_type]
    values = tracker.loss_values()
    torch.testing.assert_close(values[name][1], loss.detach(), rtol=1e-9, atol=0.0)
    assert values[name][0] == 0  # layer 0 untouched
    assert tracker.tokens_per_expert[1].sum() == S * B * K
    tracker.reset()
    assert tracker.losses.abs().sum() == 0 and tracker.tokens_per_expert.abs().sum() == 0


def test_loss_list_coefficients_add_up():
    torch.manual_seed(1)
    coeffs = (0.1, 0.2, 0.3)
    cfg = RouterConfig(
        num_experts=E,
        hidden_size=H,
        top_k=K,
        init_std=0.3,
        load_balancing_type=("aux_loss", "seq_aux_loss", "global_aux_loss"),
        aux_loss_coeff=coeffs,
        z_loss_coeff=0.05,
    )
    router = TopKRouter(cfg).double()
    x = torch.randn(S, B, H, dtype=torch.float64)
    g = torch.randn(S * B, E, dtype=torch.float64)
    router.eval()
    main_only = _grad(router, x, g)
    router.train()
    injected = _grad(router, x, g) - main_only
    x_ref = x.clone().requires_grad_(True)
    L = _formula_losses(x_ref, router.weight.detach())
    total = (
        coeffs[0] * L["aux_loss"] + coeffs[1] * L["seq_aux_loss"] + coeffs[2] * L["global_aux_loss"]
    )
    (total + 0.05 * L["z"]).backward()
    torch.testing.assert_close(injected, x_ref.grad, rtol=1e-9, atol=1e-12)


def test_no_loss_without_grad_or_in_eval():
    cfg = RouterConfig(
        num_experts=E,
        hidden_size=H,
        top_k=K,
        load_balancing_type="aux_loss",
        aux_loss_coeff=1.0,
        z_loss_coeff=1.0,
    )
    tracker = AuxLossTracker(num_layers=1, num_experts=E)
    router = TopKRouter(cfg, tracker=tracker, layer_index=0)
    with torch.no_grad():
        router(torch.randn(4, 2, H))
    router.eval()
    router(torch.randn(4, 2, H))
    assert tracker.losses.abs().sum() == 0


def test_scale_object_is_per_owner():
    a, b = AuxLossScale(2.0), AuxLossScale()
    assert float(a.value) == 2.0 and float(b.value) == 1.0
    a.set(torch.tensor(0.5))
    assert float(a.value) == 0.5 and float(b.value) == 1.0


def test_scale_refuses_non_numbers():
    for make in (AuxLossScale, AuxLossScale().set):
        with pytest.raises(TypeError, match=r"value='abc' is invalid: it must be a real number"):
            make("abc")
        with pytest.raises(TypeError, match="value=True is invalid"):
            make(True)
        with pytest.raises(ValueError, match="value=inf is invalid: it must be finite"):
            make(float("inf"))
        with pytest.raises(ValueError, match=r"shape \(2,\) .* is invalid"):
            make(torch.tensor([1.0, 2.0]))
    # ints, one-element tensors (the loss gradient the transformers integration passes)
    assert float(AuxLossScale(3).value) == 3.0
    scale = AuxLossScale()
    scale.set(torch.tensor([0.25], dtype=torch.float64))
    assert scale.value.shape == () and scale.value.dtype == torch.float32
    assert float(scale.value) == 0.25


def test_tracker_validates():
    with pytest.raises(ValueError, match="num_layers"):
        AuxLossTracker(num_layers=0, num_experts=4)
    t = AuxLossTracker(num_layers=2, num_experts=4)
    with pytest.raises(ValueError, match="layer_index"):
        t.record_loss("z_loss", 2, torch.tensor(1.0))
    with pytest.raises(ValueError, match="name"):
        t.record_loss("bogus", 0, torch.tensor(1.0))
    with pytest.raises(ValueError, match="layer_index"):
        TopKRouter(RouterConfig(num_experts=4, hidden_size=4), tracker=t)
