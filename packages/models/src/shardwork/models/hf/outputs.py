"""Outputs shaped like a transformers causal LM's, for parity checks against Hugging Face.

:func:`hf_outputs` runs ``input_ids [b, s]`` through this rank's model and returns
:class:`HFOutputs`: logits ``[b, s, vocab_size]`` (gathered over TP, vocabulary padding
removed), and optionally what transformers returns for ``output_hidden_states=True`` and
``output_router_logits=True``, in transformers' shapes and token order, so a user can put
the two side by side without knowing shardwork's ``[s(/tp), b, V_pad/tp]`` layout.

- Logits at any layout but context parallelism: at pp > 1 through the layout's own
  schedule (:func:`~shardwork.models.pipeline.pipeline_logits`), returned on the last
  pipeline stage (the only one that has them) and None on the others.
- Hidden states and router outputs need every layer on this rank (pp=1): a pipeline stage
  holds only its own layers, so asking for them at pp > 1 raises ``ValueError``.
- The model runs in eval mode (dropout and router jitter off, as transformers' parity
  outputs are); its mode is restored afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwork.models.gpt_model import GPTModel
from shardwork.models.logits import gather_logits
from shardwork.models.moe.router import MoERouter
from shardwork.models.pipeline.logits import pipeline_logits
from shardwork.parallel_state import ProcessGroups, gather_from_sequence_region

__all__ = ["HFOutputs", "hf_outputs"]


@dataclass(frozen=True)
class HFOutputs:
    """transformers-shaped outputs of one forward pass.

    - ``logits``: ``[b, s, vocab_size]``.
    - ``hidden_states`` (as transformers' ``output_hidden_states``): ``num_layers + 1``
      tensors ``[b, s, h]``: the embedding output, the output of every layer but the last,
      and the last layer's output after the final norm (transformers records the final norm's
      output in place of the last layer's).
    - ``router_logits`` (as transformers' ``output_router_logits``): one ``[b·s, E]`` tensor
      per MoE layer, the gating logits before scoring, tokens batch-major (row ``i·s + j`` is
      batch ``i``, position ``j``), in the router dtype.
    - ``router_choices``: per MoE layer ``[b·s, k]``, the experts each token was sent to,
      ascending (transformers' ``router_indices`` sorted along the last dim).
    """

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    router_choices: tuple[torch.Tensor, ...] | None = None


@torch.no_grad()
def hf_outputs(
    model: GPTModel,
    input_ids: torch.Tensor,
    groups: ProcessGroups | None = None,
    *,
    output_hidden_states: bool = False,
    output_router_logits: bool = False,
) -> HFOutputs | None:
    """The :class:`HFOutputs` of ``input_ids [b, s]`` (the same ids on every rank).

    ``model`` is this rank's model or pipeline stage and ``groups`` its layout (default: the
    model's own). Every rank of the layout must call this. Returns None on pipeline stages
    other than the last.
    """
    groups = model.groups if groups is None else groups
    pp, cp = groups.size("pp"), groups.size("cp")
    if cp > 1:
        raise ValueError(f"hf_outputs takes whole sequences: cp={cp}, use cp=1")
    if pp > 1 and (output_hidden_states or output_router_logits):
        asked = "output_hidden_states" if output_hidden_states else "output_router_logits"
        raise ValueError(
            f"hf_outputs({asked}=True) needs every layer on this rank, but pp={pp} gives each "
            "stage only its own layers: use pp=1 (any tp/ep), or ask for logits only"
        )
    if pp == 1 and not (model.pre_process and model.post_process):
        raise ValueError(
            f"hf_outputs at pp=1 needs the whole model, but this one has pre_process="
            f"{model.pre_process}, post_process={model.post_process} (an explicit layer_range "
            "stage): build it without layer_range, or pass the pipeline layout's groups"
        )
    was_training = model.training
    model.eval()
    try:
        if pp > 1:
            logits = pipeline_logits(model, groups, input_ids)
            return None if logits is None else HFOutputs(logits=logits)
        return _run_with_hooks(model, groups, input_ids, output_hidden_states, output_router_logits)
    finally:
        model.train(was_training)


def _run_with_hooks(model, groups, input_ids, want_hidden: bool, want_router: bool) -> HFOutputs:
    """One forward of a whole model (pp=1), recording what was asked for with hooks."""
    hidden: list[torch.Tensor] = []
    routers: list[tuple[torch.Tensor, torch.Tensor]] = []
    decoder = model.decoder
    hooks = []
    if want_hidden:
        # the decoder's input is the embedding output after dropout and the activation cast
        hooks.append(decoder.register_forward_pre_hook(lambda _m, args: hidden.append(args[0])))
        hooks += [
            layer.register_forward_hook(lambda _m, _args, out: hidden.append(out))
            for layer in decoder.layers[:-1]
        ]
        hooks.append(decoder.register_forward_hook(lambda _m, _args, out: hidden.append(out)))
    if want_router:
        hooks += [
            m.register_forward_hook(
                lambda m, args, out: routers.append((m.gating_logits(args[0]), out[1]))
            )
            for m in model.modules()
            if isinstance(m, MoERouter)
        ]
    try:
        raw = model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    logits = gather_logits(raw, tp_group=groups.tp, vocab_size=cfg.vocab_size)
    batch = input_ids.shape[0]
    sp_group = groups.tp if cfg.sequence_parallel else None
    return HFOutputs(
        logits=logits,
        hidden_states=tuple(_whole(h, sp_group).transpose(0, 1) for h in hidden)
        if want_hidden
        else None,
        router_logits=tuple(_batch_major(lg, batch, sp_group) for lg, _ in routers)
        if want_router
        else None,
        router_choices=tuple(_choices(rmap, batch, sp_group) for _, rmap in routers)
        if want_router
        else None,
    )


def _whole(x: torch.Tensor, sp_group) -> torch.Tensor:
    """``[s/tp, ...]`` under sequence parallelism -> ``[s, ...]`` (unchanged without it)."""
    if sp_group is None:
        return x
    return gather_from_sequence_region(x.contiguous(), sp_group, grad_is_partial=False)


def _batch_major(per_token: torch.Tensor, batch: int, sp_group) -> torch.Tensor:
    """``[s(/tp)·b, E]`` in shardwork's token order (t = i·b + j) -> ``[b·s, E]`` batch-major."""
    local = per_token.reshape(-1, batch, per_token.shape[-1])  # [s(/tp), b, E]
    return _whole(local, sp_group).transpose(0, 1).reshape(-1, per_token.shape[-1])


def _choices(routing_map: torch.Tensor, batch: int, sp_group) -> torch.Tensor:
    """A ``[T, E]`` bool routing map -> the chosen experts ``[b·s, k]``, ascending."""
    rows = _batch_major(routing_map.to(torch.int8), batch, sp_group).bool()
    counts = rows.sum(-1)
    if not bool((counts == counts[0]).all()):
        raise ValueError(
            "router_choices: tokens went to different numbers of experts "
            f"({sorted(set(counts.tolist()))}), so some were dropped by the expert capacity; "
            "set the router's capacity_factor to None for parity checks"
        )
    k = int(counts[0])
    # nonzero() walks each row left to right, so every row's k expert ids come out ascending
    return rows.nonzero()[:, 1].view(-1, k)
