"""Layout-equivalence check for MoE / MLA / MTP models (used by this package's tests; public).

:func:`compare_moe_layout` runs, inside a ``run_on_ranks`` worker, one training step of a
preset at a layout (tp, pp, ep, etp, sequence parallelism) through the real pipeline schedule
and ``finalize_model_grads`` (with :func:`~shardwork.models.moe.moe_finalize_kwargs`), and the
same step at world size 1 (built on every rank; the layout-independent init gives both the
same weights). It asserts the global mean loss, every parameter's full gradient and the
reduced per-layer expert token counts agree.

Statistics that are per rank by definition (aux losses, capacity dropping) are matched by
construction: the reference runs one forward per (data-parallel rank, micro-batch) — exactly
the token groups each rank's router sees — and gives each the same aux-loss scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwork.models.full_state import full_state_dict
from shardwork.models.gpt_model import GPTModel
from shardwork.models.moe.state import expert_load, moe_finalize_kwargs, moe_routers
from shardwork.models.mtp import reduce_mtp_losses
from shardwork.models.pipeline import build_stage, finalize_model_grads, get_schedule
from shardwork.models.presets import preset
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups

__all__ = ["compare_moe_layout", "global_batches"]


def global_batches(
    vocab_size: int, *, dp: int, microbatches: int, batch: int, seq: int, seed: int = 0
):
    """``[dp][microbatch] -> (ids, labels)`` random batches; a few labels ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(dp):
        row = []
        for _ in range(microbatches):
            ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
            labels = torch.randint(0, vocab_size, (batch, seq), generator=gen)
            labels[0, :2] = -100
            row.append((ids, labels))
        out.append(row)
    return out


def _reference(cfg, batches, cu_seqlens, prepare=None):
    """World-1 step: one forward per (dp rank, micro-batch); grads of the global mean."""
    model = GPTModel(cfg, ProcessGroups.single())
    if prepare is not None:
        prepare(model)
    model.train()
    flat = [b for row in batches for b in row]
    total_tokens = sum(int((lab != -100).sum()) for _, lab in flat)
    if model.aux_loss_scale is not None:
        model.aux_loss_scale.set(1.0 / total_tokens)
    if model.mtp is not None:
        model.mtp_loss_scale.set(1.0 / total_tokens)
    loss = 0.0
    for ids, labels in flat:
        loss_sum, _ = model(ids, labels=labels, cu_seqlens=cu_seqlens)
        (loss_sum / total_tokens).backward()
        loss += float(loss_sum.detach())
    kwargs = moe_finalize_kwargs(model, ProcessGroups.single())
    if "moe_tracker" in kwargs:
        kwargs["moe_tracker"].reduce()
    for hook in kwargs.get("moe_hooks", ()):
        hook()
    grads = full_state_dict(model, grads=True, group=dist.new_group([dist.get_rank()]))
    load = expert_load(model) if model.aux_loss_tracker is not None else None
    return loss / total_tokens, grads, load, model


def compare_moe_layout(
    name: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    microbatches: int = 2,
    batch: int = 2,
    seq: int = 16,
    rtol: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    **overrides: Any,
) -> float:
    """Assert loss, gradients and expert loads at the layout equal world size 1; returns loss.

    ``prepare(model)`` runs on the reference model and on this rank's stage right after they
    are built (e.g. adding LoRA adapters); it must not communicate outside the stage's groups.
    """
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=tp if etp is None else etp)
    groups = init_process_groups(parallel)
    cfg = preset(name, params_dtype=torch.float64, **overrides)
    dp = groups.size("dp")
    batches = global_batches(cfg.vocab_size, dp=dp, microbatches=microbatches, batch=batch, seq=seq)
    ref_loss, ref_grads, ref_load, ref_model = _reference(
        cfg.replace(sequence_parallel=False), batches, cu_seqlens, prepare
    )

    stage = build_stage(cfg, groups)
    if prepare is not None:
        prepare(stage)
    stage.train()
    mine = iter(batches[groups.rank("dp")])
    tokens = []

    def forward_step(_it, chunk):
        ids, labels = next(mine)
        out = chunk(ids, labels=labels, cu_seqlens=cu_seqlens)

        def loss_fn(output):
            loss_sum, n = output
            tokens.append(n)
            return loss_sum, n, {}

        return out, loss_fn

    schedule = get_schedule(pp)
    s_local = seq // (tp if cfg.sequence_parallel else 1)
    losses = schedule(
        forward_step_func=forward_step,
        data_iterator=None,
        model=stage,
        num_microbatches=microbatches,
        pp_group=groups.group("pp"),
        tensor_shape=(s_local, batch, cfg.hidden_size),
        dtype=torch.float64,
    )
    num_tokens = sum(int(n) for n in tokens)
    total = finalize_model_grads(
        stage, groups, num_tokens=num_tokens, **moe_finalize_kwargs(stage, groups)
    )
    loss_sum = torch.tensor(sum(float(item.loss_sum) for item in losses), dtype=torch.float64)
    for g in (groups.group("pp"), groups.group("dp_cp")):
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(loss_sum, group=g)
    loss = float(loss_sum / total)
    grads = full_state_dict(stage, grads=True)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    for key, ref_grad in ref_grads.items():
        torch.testing.assert_close(
            grads[key], ref_grad, rtol=rtol, atol=rtol * 1e-2, msg=lambda m, k=key: f"{k}: {m}"
        )
    if cfg.mtp is not None:
        mine = reduce_mtp_losses(stage, groups)
        torch.testing.assert_close(mine, ref_model.mtp.tracker.mean_losses(), rtol=1e-9, atol=0)
    if ref_load is not None:
        torch.testing.assert_close(expert_load(stage), ref_load, rtol=0, atol=0)
        # logged aux losses: the tracker averages per-rank values over dp; the reference
        # summed the same dp × micro-batch token groups
        ref_vals = ref_model.aux_loss_tracker.loss_values()
        vals = stage.aux_loss_tracker.loss_values()
        for name in ("load_balancing_loss", "z_loss"):
            torch.testing.assert_close(vals[name] * dp, ref_vals[name], rtol=1e-9, atol=1e-12)
        ref_bias = _biases(ref_model)
        for layer, bias in _biases(stage).items():
            torch.testing.assert_close(bias, ref_bias[layer], rtol=0, atol=0)
    return loss


def _biases(model):
    return {r.layer_index: r.expert_bias for r in moe_routers(model) if r.expert_bias is not None}
