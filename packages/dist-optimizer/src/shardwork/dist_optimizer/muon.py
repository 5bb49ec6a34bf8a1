"""Muon: momentum + Newton–Schulz orthogonalisation of whole weight matrices.

- Update of a matrix parameter: ``buf = μ·buf + (1-μ)·g``; ``u = (1-μ)·g + μ·buf`` (Nesterov)
  or ``u = buf``; ``o = NS5(u)`` — five quintic Newton–Schulz iterations with coefficients
  (3.4445, -4.7750, 2.0315) on ``u/‖u‖_F`` (transposed so rows <= cols), which push every
  singular value towards 1; ``o *= sqrt(max(1, rows/cols))``;
  ``p *= 1 - lr·wd``; ``p -= lr·o``. Computed in fp32.
- Orthogonalisation is per *logical* matrix: a parameter whose ``ParamMeta`` has
  ``tp_partition_sizes`` (fused [gate | up], fused [Q | K | V]) is split along ``tp_axis``
  into those blocks and each block is orthogonalised on its own, so a fused weight gets the
  update the unfused model's separate matrices would get. For attention this means one
  Newton–Schulz per Q, K and V projection (all heads of each together) — what Muon does on
  models with separate q/k/v projections (Moonlight, Kimi) and what Megatron-Core's
  ``split_qkv`` does to its fused QKV. ``ParamMeta`` has no head count, so per-head
  orthogonalisation (each head's rows on their own) is an opt-in param-group option
  (``head_dim``). The group option ``fused_blocks`` asserts the split: every parameter of
  the group must be a fused weight of that many blocks (3 for [Q | K | V]), checked when
  the group is added, so a model whose layout metadata went missing fails loudly instead
  of having its fused weight orthogonalised as one matrix.
- A TP-sharded parameter (``tp_axis`` set, ``tp_group`` of size > 1) is all-gathered over
  ``tp_group`` before orthogonalising — never shard by shard — and every TP rank keeps its
  own slice of the result (each rank of the TP group computes the same NS on the same full
  matrix). All TP ranks must therefore step the same parameters in the same order.
- Parameters in a group with ``use_muon=False`` (or, by default, parameters that are not
  2-D: biases, norms) get an AdamW update with ``adam_betas``/``adam_eps``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_optimizer.validation import (
    check_betas,
    check_bool,
    check_int,
    check_real,
    option_label,
)
from shardwork.parallel_state import ParamMeta, get_param_meta, group_rank, group_size

__all__ = ["Muon", "newton_schulz", "orthogonalize"]

_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, *, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise a 2-D matrix (fp32 result of the same shape)."""
    if g.dim() != 2:
        raise ValueError(f"newton_schulz: g.dim()={g.dim()}; valid: a 2-D matrix")
    a, b, c = _NS_COEFFS
    x = g.to(torch.float32)
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * (s @ s)) @ x
    return x.T if transposed else x


def _blocks(meta: ParamMeta, full_size: int) -> list[int]:
    if meta.tp_partition_sizes is None:
        return [full_size]
    if sum(meta.tp_partition_sizes) != full_size:
        raise ValueError(
            f"ParamMeta.tp_partition_sizes={meta.tp_partition_sizes} sum to "
            f"{sum(meta.tp_partition_sizes)} but the full tp_axis has {full_size}"
        )
    return list(meta.tp_partition_sizes)


def orthogonalize(
    update: torch.Tensor, meta: ParamMeta, *, steps: int = 5, head_dim: int | None = None
) -> torch.Tensor:
    """NS5 of a full (unsharded) matrix, block by block along ``meta.tp_axis`` when fused;
    with ``head_dim`` each block is further cut into ``head_dim``-sized heads along that axis."""
    if update.dim() != 2:
        raise ValueError(f"orthogonalize: update.dim()={update.dim()}; valid: 2")
    axis = meta.tp_axis if meta.tp_axis is not None else 0
    out = []
    for block in update.split(_blocks(meta, update.size(axis)), dim=axis):
        if head_dim is not None and block.size(axis) % head_dim:
            raise ValueError(
                f"Muon head_dim={head_dim} does not divide a block of {block.size(axis)} rows"
            )
        for piece in block.split(head_dim, dim=axis) if head_dim else (block,):
            o = newton_schulz(piece, steps=steps)
            out.append(o * math.sqrt(max(1.0, piece.size(0) / piece.size(1))))
    return torch.cat(out, dim=axis)


def _gather_tp(local: torch.Tensor, meta: ParamMeta, group: Any) -> torch.Tensor:
    """Full matrix from every TP rank's slice (per block when fused)."""
    axis, size = meta.tp_axis, group_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    local_blocks = [s // size for s in _blocks(meta, local.size(axis) * size)]
    per_rank = [p.split(local_blocks, dim=axis) for p in parts]
    return torch.cat(
        [torch.cat([r[i] for r in per_rank], dim=axis) for i in range(len(local_blocks))], dim=axis
    )


def _local_tp(full: torch.Tensor, meta: ParamMeta, group: Any) -> torch.Tensor:
    axis, size, rank = meta.tp_axis, group_size(group), group_rank(group)
    blocks = full.split(_blocks(meta, full.size(axis)), dim=axis)
    return torch.cat([b.chunk(size, dim=axis)[rank] for b in blocks], dim=axis)


def check_options(options: Mapping[str, Any], group_index: int | None = None) -> None:
    """TypeError/ValueError for a bad Muon option among ``options`` (the constructor's, or
    param group ``group_index``'s). A negative weight decay would grow the weights."""

    def label(name: str) -> str:
        return option_label("Muon", name, group_index)

    for name, below in (("lr", None), ("momentum", 1), ("weight_decay", None), ("adam_eps", None)):
        if name in options:
            check_real(label(name), options[name], at_least=0, below=below)
    for name, minimum in (("ns_steps", 1), ("head_dim", 1), ("fused_blocks", 2)):
        if name in options:
            check_int(label(name), options[name], minimum=minimum, allow_none=name != "ns_steps")
    if "nesterov" in options:
        check_bool(label("nesterov"), options["nesterov"])
    if options.get("use_muon") is not None:
        check_bool(label("use_muon"), options["use_muon"])
    if "adam_betas" in options:
        check_betas(label("adam_betas"), options["adam_betas"])


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest (see the module docstring).

    Group options: ``lr``, ``momentum``, ``nesterov``, ``ns_steps``, ``weight_decay``,
    ``adam_betas``, ``adam_eps``, ``use_muon`` (None: 2-D parameters only), ``head_dim``
    (orthogonalise each ``head_dim`` rows of every block separately: per-head QKV; put the
    QKV weights in their own param group) and ``fused_blocks`` (every parameter of the group
    must carry ``ParamMeta.tp_partition_sizes`` with this many blocks; ValueError otherwise).
    ``tp_group`` is the group TP-sharded parameters are split over (None: not split).

    Options are checked for the constructor and for each group's own values, and a group's
    parameters when it is added (``use_muon=True`` only on 2-D ones, ``head_dim`` dividing
    every block): a mistake raises there, not at the first step.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        *,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        use_muon: bool | None = None,
        head_dim: int | None = None,
        fused_blocks: int | None = None,
        tp_group: Any = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "weight_decay": weight_decay,
            "adam_betas": adam_betas,
            "adam_eps": adam_eps,
            "use_muon": use_muon,
            "head_dim": head_dim,
            "fused_blocks": fused_blocks,
        }
        check_options(defaults)
        # Before torch adds the groups: add_param_group checks head_dim against TP-split blocks.
        self.tp_group = tp_group
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Check the group's options (with the defaults it inherits), add it (torch's rules),
        then check its parameters against ``use_muon``, ``head_dim`` and ``fused_blocks``: a
        mistake raises here, not at the first step, and the group is not added."""
        index = len(self.param_groups)
        if isinstance(param_group, dict):
            check_options({**self.defaults, **param_group}, index)
        super().add_param_group(param_group)
        try:
            self._check_group_params(self.param_groups[-1], index)
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group_params(self, group: dict[str, Any], index: int) -> None:
        """ValueError for a parameter the group's options cannot apply to (see
        :meth:`add_param_group`)."""
        for i, p in enumerate(group["params"]):
            use_muon = group["use_muon"] if group["use_muon"] is not None else p.dim() == 2
            if use_muon and p.dim() != 2:
                raise ValueError(
                    f"Muon.param_groups[{index}]['use_muon']=True but parameter {i} of the group "
                    f"has shape {tuple(p.shape)}; valid: only 2-D parameters (matrices) with "
                    "use_muon=True; use_muon=None (2-D ones only) or False for the rest (AdamW)"
                )
            if use_muon and group["head_dim"] is not None:
                self._check_head_dim(p, group["head_dim"], index, i)
        blocks = group["fused_blocks"]
        if blocks is None:
            return
        for i, p in enumerate(group["params"]):
            sizes = get_param_meta(p).tp_partition_sizes
            if sizes is None or len(sizes) != blocks:
                raise ValueError(
                    f"Muon fused_blocks={blocks}: parameter {i} of the group (shape "
                    f"{tuple(p.shape)}) has ParamMeta.tp_partition_sizes={sizes}; valid: a "
                    f"fused weight of {blocks} blocks along tp_axis (e.g. 3 for [Q | K | V])"
                )

    def _check_head_dim(self, p: torch.Tensor, head_dim: int, index: int, i: int) -> None:
        """ValueError unless ``head_dim`` divides every block :func:`orthogonalize` will cut
        parameter ``i`` of group ``index`` into (blocks of the full matrix when TP-split)."""
        meta = get_param_meta(p)
        axis = meta.tp_axis if meta.tp_axis is not None else 0
        size = p.size(axis)
        if meta.tp_axis is not None:
            size *= group_size(self.tp_group)  # the step orthogonalises the gathered matrix
        for block in _blocks(meta, size):
            if block % head_dim:
                raise ValueError(
                    f"Muon.param_groups[{index}]['head_dim']={head_dim} does not divide a block "
                    f"of {block} rows of parameter {i} of the group (shape {tuple(p.shape)}); "
                    "valid: the head size of that weight's Q/K/V blocks, or None"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                use_muon = group["use_muon"] if group["use_muon"] is not None else p.dim() == 2
                if use_muon:
                    self._muon_update(p, group)
                else:
                    self._adam_update(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if p.dim() != 2:
            raise ValueError(f"Muon: use_muon=True on a {p.dim()}-D parameter; valid: 2-D")
        mu = group["momentum"]
        state = self.state[p]
        g = p.grad.to(torch.float32)
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf = state["momentum_buffer"]
        buf.lerp_(g, 1 - mu)
        update = g.lerp(buf, mu) if group["nesterov"] else buf.clone()
        meta = get_param_meta(p)
        sharded = meta.tp_axis is not None and group_size(self.tp_group) > 1
        full = _gather_tp(update, meta, self.tp_group) if sharded else update
        o = orthogonalize(full, meta, steps=group["ns_steps"], head_dim=group["head_dim"])
        if sharded:
            o = _local_tp(o, meta, self.tp_group)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(o.to(p.dtype), alpha=-group["lr"])

    def _adam_update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        b1, b2 = group["adam_betas"]
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        t = float(state["step"])
        g = p.grad.to(torch.float32)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(group["adam_eps"])
        p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1**t))
