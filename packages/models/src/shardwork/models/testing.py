"""Helpers for layout-equivalence tests (used by this package's tests; public for others).

:func:`compare_with_single_rank` runs, inside a ``run_on_ranks`` worker, a tiny preset at a
given tp/cp layout and the same config at world size 1 (built on every rank; the
layout-independent init gives both the same weights), and asserts that the parameters are
bit-identical (layout-independent init) and that the global mean loss and every parameter's
full gradient agree to ``rtol``.

- Gradients are finalised as ``finalize_model_grads`` would for a plain module: parameters
  marked ``sequence_parallel`` summed over TP, everything summed over dp×cp, and backward
  started from ``loss_sum / global token count``.
- The loss goes through the model's own (fused, vocab-parallel) path, or with
  ``oracle_loss=True`` through plain ``F.cross_entropy`` on TP-gathered logits;
  ``oracle_reference=True`` uses that oracle for the world-1 reference only, so the layout
  model's own loss (e.g. the fused linear cross-entropy) is checked against materialised
  logits.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwork.models.context_parallel import slice_for_context_parallel
from shardwork.models.full_state import full_state_dict
from shardwork.models.gpt_model import GPTModel
from shardwork.models.loss import loss_for_backward, reduce_loss
from shardwork.models.presets import preset
from shardwork.parallel_state import (
    ParallelConfig,
    ProcessGroups,
    gather_from_tp_region,
    get_param_meta,
    init_process_groups,
)

__all__ = ["compare_with_single_rank", "random_batch", "randomize_lora_b"]


def random_batch(vocab_size: int, *, batch: int = 2, seq: int = 16, seed: int = 0):
    """Random ids and labels ``[batch, seq]``; three labels of sample 0 are ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    labels[0, :3] = -100
    return ids, labels


def randomize_lora_b(model, seed: int = 1, scale: float = 0.1) -> None:
    """Give every LoRA ``B`` factor random global values, each rank copying its own slice.

    PEFT starts ``B`` at zero, which would hide any bug in the adapter path; the values depend
    only on the key and ``seed``, so every layout gets the same global tensors."""
    for key, st in model.sharded_state_dict().items():
        if ".lora_B." not in key:
            continue
        gen = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
        full = torch.randn(st.global_shape, generator=gen, dtype=torch.float64) * scale
        index = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.data.shape))
        with torch.no_grad():
            st.data.copy_(full[index].to(st.data.dtype))


def _oracle_loss(logits, labels, groups):
    full = gather_from_tp_region(logits, groups.tp)
    flat = full.transpose(0, 1).reshape(-1, full.shape[-1])
    lab = labels.reshape(-1)
    return F.cross_entropy(flat, lab, ignore_index=-100, reduction="sum"), (lab != -100).sum()


def _finalize(model, groups):
    for p in model.parameters():
        if p.grad is None:
            continue
        if get_param_meta(p).sequence_parallel and groups.size("tp") > 1:
            dist.all_reduce(p.grad, group=groups.tp)
        if groups.size("dp_cp") > 1:
            dist.all_reduce(p.grad, group=groups.dp_cp)


def _step(model, groups, ids, labels, cu_seqlens=None, oracle_loss=False):
    cp, cp_rank = groups.size("cp"), groups.rank("cp")
    ids = slice_for_context_parallel(ids, cp_rank=cp_rank, cp_size=cp, dim=1)
    labels = slice_for_context_parallel(labels, cp_rank=cp_rank, cp_size=cp, dim=1)
    if oracle_loss:
        loss_sum, n = _oracle_loss(model(ids, cu_seqlens=cu_seqlens), labels, groups)
    else:
        loss_sum, n = model(ids, labels=labels, cu_seqlens=cu_seqlens)
    loss_for_backward(loss_sum, n, groups.dp_cp).backward()
    _finalize(model, groups)
    return reduce_loss(loss_sum, n, groups.dp_cp)


def compare_with_single_rank(
    name: str,
    *,
    tp: int = 1,
    cp: int = 1,
    dtype: torch.dtype = torch.float64,
    rtol: float = 1e-9,
    seq: int = 16,
    batch: int = 2,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    oracle_loss: bool = False,
    oracle_reference: bool = False,
    prepare: Callable[[GPTModel], None] | None = None,
    **overrides: Any,
) -> float:
    """Assert loss and gradients at (tp, cp) equal world size 1; returns the loss.

    ``prepare(model)`` runs on both models right after they are built (e.g. to add LoRA
    adapters); it must give both the same global values, collectively on the model's own
    groups only (the reference model lives on one rank)."""
    groups = init_process_groups(ParallelConfig(tp=tp, cp=cp))
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens)
    cfg = preset(name, params_dtype=dtype, **overrides)
    ids, labels = random_batch(cfg.vocab_size, batch=batch, seq=seq)
    single = ProcessGroups.single()
    ref = GPTModel(cfg.replace(sequence_parallel=False), single)
    if prepare is not None:
        prepare(ref)
    ref_loss = _step(ref, single, ids, labels, cu_seqlens, oracle_loss or oracle_reference)
    ref_grads = full_state_dict(ref, grads=True, group=dist.new_group([dist.get_rank()]))
    ref_params = full_state_dict(ref, group=dist.new_group([dist.get_rank()]))
    model = GPTModel(cfg, groups)
    if prepare is not None:
        prepare(model)
    params = full_state_dict(model)
    for key, value in ref_params.items():  # initialisation does not depend on the layout
        assert torch.equal(params[key], value), key
    loss = _step(model, groups, ids, labels, cu_seqlens, oracle_loss)
    grads = full_state_dict(model, grads=True)
    assert set(grads) == set(ref_grads) == set(params), sorted(set(grads) ^ set(ref_grads))
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    for key, ref_grad in ref_grads.items():
        torch.testing.assert_close(
            grads[key], ref_grad, rtol=rtol, atol=rtol * 1e-3, msg=lambda m, k=key: f"{k}: {m}"
        )
    return float(loss)
