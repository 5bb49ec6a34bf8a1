"""Grouped experts (SwiGLU or squared ReLU) with expert (EP) and expert-tensor (ETP) parallelism.

Legend: E experts, L = E/ep local experts, H hidden, F expert ffn width, f = F/etp, N rows.

- Activation ``"swiglu"`` (``fc2(silu(gate(x)) · up(x))``) or ``"relu2"`` (Nemotron-H's
  non-gated ``fc2(relu(up(x))²)``), from ``GPTConfig.mlp_activation``.
- Weights are stacked per layer: ``linear_fc1.weight [L, 2f, H]`` for SwiGLU (this rank's
  ``[gate | up]`` ffn slice of each local expert, the layout of transformers 5's
  ``gate_up_proj``) or ``[L, f, H]`` for squared ReLU (``up`` only), and
  ``linear_fc2.weight [L, H, f]``. Both carry ``ParamMeta(is_expert=True, tp_axis=1|2)``:
  the TP axis is split over the *etp* group, gradients reduce over *edp*.
- Checkpoint keys are per expert (``...experts.linear_fc1.weight.<e>.gate`` / ``.up`` for
  SwiGLU, ``...linear_fc1.weight.<e>`` for squared ReLU, global ``[F, H]``;
  ``...linear_fc2.weight.<e>``, ``[H, F]``), so a checkpoint loads at any ep/etp and maps one to
  one onto Hugging Face's per-expert tensors. :class:`ExpertShards` produces those
  ShardedTensors and the layout-independent init (per expert key, seeded per block of ffn
  lines, drawing only this rank's etp slice); it is attached to the parameter and used by
  ``shardwork.models.sharding``'s ``param_shards``/``init_from_shards``.
- GEMMs: torch's grouped matmul (``torch.nn.functional.grouped_mm``) over contiguous row
  blocks when the dtype and strides allow it, else a padded batched ``bmm``; never a loop
  over tokens. The SwiGLU is ``shardwork.fused_kernels.swiglu`` on the fused ``[gate | up]``
  (``inplace_backward``: its gradient overwrites fc1's output, which nothing else reads); the
  squared ReLU is elementwise on fc1's output. SwiGLU experts take the rows' routing
  probabilities and scale their activation (``token_weights``), not the ``[N, H]`` output.
- Where float32 CPU products take oneDNN (``onednn_preferred``), the SwiGLU MLP runs expert by
  expert in one function instead (``fused_kernels.grouped_swiglu_mlp``: each group's products
  and activation while its rows are in cache; same bits and saved tensors as the three steps),
  on one torch thread, or on more where the groups are large (:data:`FUSED_MLP_MIN_GROUP`).
- With ETP > 1 the output is a partial sum over this rank's ffn slice; the dispatcher's
  combine reduces it over the etp group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.fused_kernels import (
    grouped_swiglu_mlp,
    onednn_grouped_linear,
    onednn_preferred,
    swiglu,
)
from shardwork.models.module import ShardedModule
from shardwork.models.sharding import describe_param, fsdp_rows, normal_slice
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["EXPERT_ACTIVATIONS", "ExpertLinear", "ExpertShards", "GroupedExperts", "grouped_linear"]

EXPERT_ACTIVATIONS = ("swiglu", "relu2")

SHARDS_ATTRIBUTE = "_shardwork_custom_shards"
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FUSED_MLP_MIN_GROUP = 1 << 18
"""Mean rows × local ffn width per local expert from which, with more than one torch thread,
the SwiGLU MLP runs expert by expert (``grouped_swiglu_mlp``); one thread always does. Each
group's ~20 small ops open a parallel region each, and with OpenMP's passive wait every region
wakes the sleeping threads: on the 2-core AMD EPYC, 2 threads, 2,048 tokens at hidden 512
(``benchmarks/models_moe.py --threads 2``), the whole-tensor path is faster for groups of
33 K (DeepSeek-V3-style, 6 %), 49 K (Qwen3-MoE-style, 10 %) and 131 K (512 rows × ffn 256,
4 %), the expert-by-expert one for 393 K (512 × 768, 1 %) and 917 K (Mixtral-style, 1 %). At
one thread it is 2-3 % faster for all of them. Both paths compute the same bits."""


@dataclass(frozen=True)
class ExpertShards:
    """Where a stacked expert parameter ``[L, ...]`` sits in the per-expert global tensors."""

    first_expert: int
    """Global index of local expert 0 (``ep_rank · L``)."""
    ffn_axis: int
    """Axis of the ffn dimension in the stacked parameter (1 for fc1, 2 for fc2)."""
    ffn_size: int
    """Global F of one block."""
    etp_rank: int
    etp_size: int
    replica_rank: int
    """Rank in the expert-data-parallel group (0 holds the primary copy)."""
    blocks: tuple[str, ...] | None
    """Fused blocks along the ffn axis (``("gate", "up")`` for fc1)."""
    init: str
    """``normal`` or ``scaled_normal``."""

    def _pieces(self, tensor: torch.Tensor, key: str, first_row: int = 0):
        """(key, local view, global shape, global offset) per expert (and block); ``tensor``
        holds local experts ``[first_row, first_row + len(tensor))`` (all of them, or an FSDP
        shard's rows)."""
        f = self.ffn_size // self.etp_size
        axis = self.ffn_axis - 1  # axis within one expert's matrix
        for local in range(tensor.shape[0]):
            mat = tensor[local]
            e = self.first_expert + first_row + local
            names = self.blocks or (None,)
            for b, name in enumerate(names):
                view = mat.narrow(axis, b * f, f)
                gshape = list(view.shape)
                gshape[axis] = self.ffn_size
                off = [0, 0]
                off[axis] = self.etp_rank * f
                suffix = f".{e}" if name is None else f".{e}.{name}"
                yield key + suffix, view, tuple(gshape), tuple(off)

    def param_shards(
        self,
        param: torch.Tensor,
        key: str,
        *,
        replica_offset: int = 0,
        source: torch.Tensor | None = None,
    ) -> list[ShardedTensor]:
        """ShardedTensors (views) of ``param`` (or of ``source``, e.g. its gradient). Under FSDP
        the parameter's rows are whole local experts: each rank describes those it holds, none
        as a replica."""
        src, first, replica = (param if source is None else source), 0, self.replica_rank
        fsdp = fsdp_rows(param, source)
        if fsdp is not None:
            (src, first), replica = fsdp, 0
        rid = replica + replica_offset
        return [
            ShardedTensor(k, v.data, gshape, off, replica_id=rid)
            for k, v, gshape, off in self._pieces(src, key, first)
        ]

    @torch.no_grad()
    def init_param(
        self, param: torch.Tensor, key: str, *, init_seed: int, std: float, num_layers: int
    ) -> None:
        """Normal init of every expert key, drawing only this rank's (etp) slice of it."""
        # Output layers: std / sqrt(2·num_layers), Megatron's scaled_init_method_normal (GPT-2's
        # residual scaling, two residual branches per layer).
        scale = std / (2.0 * num_layers) ** 0.5 if self.init == "scaled_normal" else std
        for k, view, gshape, off in self._pieces(param, key):
            local = normal_slice(
                init_seed, k, gshape, off, tuple(view.shape), axis=self.ffn_axis - 1
            )
            view.copy_((local * scale).to(view.dtype))


def _use_grouped_mm(mode: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    fn = getattr(F, "grouped_mm", None)
    if mode == "batched" or fn is None:
        return False
    ok = (
        x.dtype in _GROUPED_DTYPES
        # grouped_mm needs 16-byte aligned row strides; otherwise fall back to the padded bmm.
        and (x.shape[-1] * x.element_size()) % 16 == 0
        and (w.shape[1] * w.element_size()) % 16 == 0
    )
    if mode == "grouped_mm" and not ok:
        raise ValueError(
            f"MoEConfig.grouped_gemm='grouped_mm' cannot run dtype {x.dtype} with widths "
            f"{x.shape[-1]}/{w.shape[1]}: it needs float32/bfloat16/float16 and rows of a "
            "multiple of 16 bytes; use 'auto' or 'batched'"
        )
    return ok


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_linear(
    x_NI: torch.Tensor,
    w_LOI: torch.Tensor,
    counts_L: torch.Tensor,
    *,
    mode: str = "auto",
    backend: str | None = None,
) -> torch.Tensor:
    """``y[rows of group l] = x[rows of group l] @ w[l]ᵀ``; rows grouped contiguously by ``counts``.

    ``mode="auto"`` with kernel ``backend`` "auto" runs float32 CPU products on oneDNN where
    ``shardwork.fused_kernels.onednn_preferred`` says it beats MKL (one product per group)."""
    n, L = x_NI.shape[0], w_LOI.shape[0]
    if n == 0:
        # Keep the (empty) input in the graph: the dispatcher's all-to-all backward must run on
        # this rank too, or its peers wait in a collective this rank never joins.
        return x_NI.new_zeros((0, w_LOI.shape[1])) + 0 * w_LOI.sum() + 0 * x_NI.sum()
    if mode == "auto" and onednn_preferred(backend, x_NI, w_LOI):
        return onednn_grouped_linear(x_NI, w_LOI, counts_L.tolist())
    if _use_grouped_mm(mode, x_NI, w_LOI):
        # grouped_mm takes the end offset of each group's rows (int32), not the counts.
        offs = torch.cumsum(counts_L.to(device=x_NI.device, dtype=torch.int64), 0).to(torch.int32)
        y = F.grouped_mm(x_NI.contiguous(), w_LOI.transpose(1, 2), offs=offs)
        return _ContiguousGrad.apply(y)
    counts = counts_L.to(device=x_NI.device, dtype=torch.int64)
    # Row i goes to (group_N[i], slot_N[i]) of a [L, max_count, in] zero-padded batch; padded rows
    # multiply to zeros and are never gathered back.
    group_N = torch.repeat_interleave(torch.arange(L, device=x_NI.device), counts, output_size=n)
    starts = torch.cumsum(counts, 0) - counts
    slot_N = torch.arange(n, device=x_NI.device) - starts[group_N]
    padded = x_NI.new_zeros((L, int(counts.max()), x_NI.shape[1]))
    padded = padded.index_put((group_N, slot_N), x_NI)
    return torch.bmm(padded, w_LOI.transpose(1, 2))[group_N, slot_N]


class ExpertLinear(ShardedModule):
    """One stacked expert weight ``[L, out, in]`` (a child so its checkpoint key reads
    ``linear_fcN.weight``, and a module so LoRA can target ``experts.linear_fcN``)."""

    def __init__(self, groups, shape, *, dtype, device, meta: ParamMeta, shards: ExpertShards):
        super().__init__(groups)
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        describe_param(param, meta, init=shards.init)
        setattr(param, SHARDS_ATTRIBUTE, shards)
        self.weight = param
        self.shards = shards

    def forward(
        self,
        x_NI: torch.Tensor | None,
        counts_L: torch.Tensor | None = None,
        mode: str = "auto",
        backend: str | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Rows grouped by local expert (``counts_L``) times each expert's weight.

        ``x_NI=None``: the weight itself in ``dtype``, no product, for a caller that runs the
        products (:meth:`GroupedExperts.forward`'s fused MLP). It is asked through the module
        call so that the module's forward hooks still run first (the distributed optimizer's
        wait for this weight's all-gather is one)."""
        if x_NI is None:
            return self.weight if dtype is None else self.weight.to(dtype)
        w = self.weight.to(x_NI.dtype)
        return grouped_linear(x_NI, w, counts_L, mode=mode, backend=backend)


class GroupedExperts(ShardedModule):
    """This rank's ``L`` experts (ffn slice ``etp_rank`` of ``etp``); see module docstring."""

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        groups: ProcessGroups,
        activation: str = "swiglu",
        grouped_gemm: str = "auto",
        kernel_backend: str = "auto",
        params_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"activation={activation!r} is invalid for experts: valid are {EXPERT_ACTIVATIONS}"
            )
        ep, etp = groups.size("ep"), groups.size("etp")
        if num_experts % ep or ffn_hidden_size % etp:
            raise ValueError(
                f"num_experts={num_experts} / ffn_hidden_size={ffn_hidden_size} cannot be split "
                f"over ep={ep} / etp={etp}"
            )
        L, f = num_experts // ep, ffn_hidden_size // etp
        self.num_local_experts = L
        self.first_expert = groups.rank("ep") * L
        self.mode, self.backend, self.activation = grouped_gemm, kernel_backend, activation
        self.scales_by_probs = activation == "swiglu"
        """Whether ``forward`` takes the rows' routing probabilities (SwiGLU folds them into its
        ``token_weights``; squared ReLU would need one more saved ``[N, f]`` tensor, so its
        probabilities stay with the combine)."""
        common = dict(
            first_expert=self.first_expert,
            ffn_size=ffn_hidden_size,
            etp_rank=groups.rank("etp"),
            etp_size=etp,
            replica_rank=groups.rank("edp"),
        )
        kw = dict(dtype=params_dtype, device=device)
        # SwiGLU fuses [gate | up] blocks along the ffn axis; squared ReLU has the up block only,
        # keyed per expert without a block name (like the dense squared-ReLU MLP's fc1).
        gated = activation == "swiglu"
        self.linear_fc1 = ExpertLinear(
            groups,
            (L, (2 if gated else 1) * f, hidden_size),
            meta=ParamMeta(
                tp_axis=1,
                tp_partition_sizes=(ffn_hidden_size, ffn_hidden_size) if gated else None,
                is_expert=True,
            ),
            shards=ExpertShards(
                ffn_axis=1, blocks=("gate", "up") if gated else None, init="normal", **common
            ),
            **kw,
        )
        self.linear_fc2 = ExpertLinear(
            groups,
            (L, hidden_size, f),
            meta=ParamMeta(tp_axis=2, is_expert=True),
            shards=ExpertShards(ffn_axis=2, blocks=None, init="scaled_normal", **common),
            **kw,
        )

    def forward(
        self,
        tokens_NH: torch.Tensor,
        tokens_per_expert_L: torch.Tensor,
        probs_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows grouped by local expert (counts ``tokens_per_expert_L``) -> ``[N, H]``, each
        row's output scaled by ``probs_N`` when given (``scales_by_probs`` experts only)."""
        if tokens_per_expert_L.numel() != self.num_local_experts:
            raise ValueError(
                f"tokens_per_expert has {tokens_per_expert_L.numel()} entries, expected "
                f"{self.num_local_experts} local experts"
            )
        if self._fuses_mlp(tokens_NH, probs_N):
            w1 = self.linear_fc1(None, dtype=tokens_NH.dtype)
            w2 = self.linear_fc2(None, dtype=tokens_NH.dtype)
            counts = tokens_per_expert_L.tolist()
            return grouped_swiglu_mlp(tokens_NH, w1, w2, counts, probs_N)
        # [N, H] -> fc1 [N, 2f] ([gate | up]) -> swiglu [N, f], or fc1 [N, f] -> relu² [N, f];
        # times probs (fc2 is linear per row, so scaling its input scales its output); then fc2
        # [N, H] (partial over etp).
        h = self.linear_fc1(tokens_NH, tokens_per_expert_L, self.mode, self.backend)
        if self.activation == "swiglu":
            # fc1's output feeds only the activation, so its backward may overwrite it.
            h = swiglu(h, token_weights=probs_N, inplace_backward=True, backend=self.backend)
        else:
            if probs_N is not None:
                raise ValueError(
                    "squared-ReLU experts do not scale by routing probabilities (scales_by_probs "
                    "is False): let the dispatcher's combine apply them"
                )
            h = torch.relu(h).square()
        return self.linear_fc2(h, tokens_per_expert_L, self.mode, self.backend)

    def _fuses_mlp(self, tokens_NH: torch.Tensor, probs_N: torch.Tensor | None) -> bool:
        """Whether the SwiGLU MLP runs expert by expert in one function
        (``shardwork.fused_kernels.grouped_swiglu_mlp``): float32 CPU rows where the products
        take oneDNN (``onednn_preferred``), grouped GEMM ``auto``, one torch thread or groups of
        :data:`FUSED_MLP_MIN_GROUP` rows × ffn on average, and both projections plain
        :class:`ExpertLinear` (a LoRA-wrapped one adds its own products). No rows keeps the
        unfused path, which links the weights into the graph for the all-to-all's backward."""
        local_ffn = self.linear_fc2.weight.shape[-1]
        return (
            self.activation == "swiglu"
            and self.mode == "auto"
            and tokens_NH.shape[0] > 0
            and (
                torch.get_num_threads() == 1
                or tokens_NH.shape[0] * local_ffn >= FUSED_MLP_MIN_GROUP * self.num_local_experts
            )
            and type(self.linear_fc1) is ExpertLinear
            and type(self.linear_fc2) is ExpertLinear
            and onednn_preferred(
                self.backend, tokens_NH, self.linear_fc1.weight, self.linear_fc2.weight, probs_N
            )
        )
