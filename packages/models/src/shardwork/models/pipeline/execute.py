"""Run one rank's pipeline plan: forward and backward steps, and the tick exchanges.

- Forward of chunk ``c``: the received activation (or None on virtual stage 0) is given to
  the chunk with ``set_input_tensor`` (Megatron's convention; looked up through wrappers'
  ``.module``), then ``forward_step_func(data_iterators[c], chunk)`` returns
  ``(output, loss_fn)``. On the last virtual stage ``loss_fn(output)`` gives
  ``(loss_sum, num_tokens, logs)`` and ``loss_sum * grad_scale`` is what backward starts
  from; elsewhere ``output`` is sent to the next virtual stage.
- Backward: ``torch.autograd.backward(output, received_grad)``; the received activation's
  ``.grad`` goes back to the previous virtual stage.
- Gradient synchronisation: the backward of every microbatch except a chunk's last runs
  inside ``chunk.no_sync()`` when the chunk has it, so a DDP wrapper reduces once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwork.models.pipeline.losses import MicrobatchLoss
from shardwork.models.pipeline.p2p import P2PExchange
from shardwork.models.pipeline.plan import Action, plan_ticks, schedule_orders

ForwardStepFunc = Callable[[Any, nn.Module], tuple[Any, Callable[[Any], tuple[Any, Any, dict]]]]


def set_input_tensor(chunk: nn.Module, tensor: torch.Tensor | None) -> None:
    """Give ``chunk`` its input activation (None on the first virtual stage)."""
    target = chunk
    while not hasattr(target, "set_input_tensor") and isinstance(
        getattr(target, "module", None), nn.Module
    ):
        target = target.module
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor(tensor)
    elif tensor is not None:
        raise ValueError(
            f"model chunk {type(chunk).__name__} receives an activation from the previous pipeline "
            "stage but has no set_input_tensor(tensor) method (nor a .module that has one)"
        )


def no_sync(chunk: nn.Module):
    """``chunk.no_sync()`` if the chunk (a DDP wrapper) has it, else a null context."""
    method = getattr(chunk, "no_sync", None)
    return method() if callable(method) else contextlib.nullcontext()


def evaluate_loss(loss_fn: Callable, output: Any, *, microbatch: int):
    """Call ``loss_fn(output)`` and check it returns ``(loss_sum, num_tokens, logs)``."""
    result = loss_fn(output)
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ValueError(
            f"loss_fn for microbatch {microbatch} returned {type(result).__name__}; it must return "
            "(loss_sum, num_tokens, logs): the loss summed over tokens, the token count, a dict"
        )
    loss_sum, num_tokens, logs = result
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
        raise ValueError(
            f"loss_fn for microbatch {microbatch} returned loss_sum={loss_sum!r}: it must be a "
            "0-dim tensor (the loss summed over the microbatch's tokens)"
        )
    record = MicrobatchLoss(
        loss_sum.detach(), torch.as_tensor(num_tokens).detach(), dict(logs or {})
    )
    return loss_sum, record


def run_pipeline(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterators: Sequence[Any],
    chunks: Sequence[nn.Module],
    num_microbatches: int,
    pp_group,
    tensor_shape: Sequence[int] | None,
    dtype: torch.dtype,
    device: torch.device,
    forward_only: bool,
    grad_scale: float,
) -> list[MicrobatchLoss]:
    """Execute this rank's plan; return the last virtual stage's losses by microbatch."""
    p = dist.get_world_size(pp_group)
    r = dist.get_rank(pp_group)
    vpp = len(chunks)
    orders = schedule_orders(p, num_microbatches, vpp=vpp, forward_only=forward_only)
    plan = plan_ticks(orders, vpp=vpp)[r]
    comm = P2PExchange(pp_group, tensor_shape=tensor_shape, dtype=dtype, device=device)
    last_virtual = p * vpp - 1
    last_backward: dict[int, Action] = {a.chunk: a for a in orders[r] if a.kind == "B"}

    inbox: dict[tuple[str, int, int], torch.Tensor] = {}
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    sent_specs: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
    losses: dict[int, MicrobatchLoss] = {}
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()

    for tick in plan:
        produced: torch.Tensor | None = None
        action = tick.action
        if action is not None:
            c, m = action.chunk, action.microbatch
            chunk = chunks[c]
            virtual_stage = c * p + r
            if action.kind == "F":
                inp = inbox.pop(("act", c, m), None)
                if inp is not None and not forward_only:
                    # The received activation is a leaf here; its .grad after backward is what goes
                    # back upstream.
                    inp.requires_grad_(True)
                set_input_tensor(chunk, inp)
                with grad_mode:
                    output, loss_fn = forward_step_func(data_iterators[c], chunk)
                    if virtual_stage == last_virtual:
                        loss_sum, losses[m] = evaluate_loss(loss_fn, output, microbatch=m)
                        target = loss_sum if grad_scale == 1.0 else loss_sum * grad_scale
                    else:
                        comm.check_activation(output, chunk=c, microbatch=m)
                        # Send a detached copy: the graph stays local, backward re-enters it through
                        # autograd.backward(target, grad) with the gradient the next stage returns.
                        produced = output.detach()
                        if not forward_only:
                            sent_specs[(c, m)] = (output.shape, output.dtype)
                        target = output
                if not forward_only:
                    saved[(c, m)] = (inp, target)
            else:
                inp, target = saved.pop((c, m))
                grad = None if virtual_stage == last_virtual else inbox.pop(("grad", c, m))
                # Only a chunk's last backward lets a DDP wrapper reduce: gradients of all
                # microbatches are summed locally first, so they are reduced once per step.
                sync = contextlib.nullcontext() if action == last_backward[c] else no_sync(chunk)
                with sync:
                    # The first stage's output needs no gradient when none of its parameters
                    # trains (LoRA adapters only on later stages): nothing to backpropagate.
                    if target.requires_grad:
                        torch.autograd.backward(target, grad_tensors=grad)
                if virtual_stage > 0:
                    assert inp is not None
                    # A stage whose output does not depend on its input (e.g. detached) still owes
                    # the previous stage a gradient message, or that rank would wait for it forever.
                    produced = inp.grad if inp.grad is not None else torch.zeros_like(inp)
        # The plan and the executed actions must agree, or the ranks' exchanges would mismatch.
        assert len(tick.sends) == (0 if produced is None else 1), (tick, produced is None)
        # Every rank runs the exchange of each tick its plan lists, in tick order: the peers
        # computed the same plan, so each exchange pairs with theirs (see plan.py).
        if tick.sends or tick.recvs:
            grad_specs = {
                msg: sent_specs.pop((msg.chunk, msg.microbatch))
                for msg in tick.recvs
                if msg.kind == "grad"
            }
            sends = {tick.sends[0]: produced} if produced is not None else {}
            received = comm.exchange(sends, tick.recvs, grad_specs=grad_specs)
            for msg, tensor in received.items():
                inbox[(msg.kind, msg.chunk, msg.microbatch)] = tensor
    assert not saved and not inbox, (saved.keys(), inbox.keys())
    return [losses[m] for m in sorted(losses)]
