"""Column- and row-parallel linear layers over the TP group, with optional sequence parallelism.

Activations are ``[s, b, h]`` (sequence first). With sequence parallelism the sequence dim
is split over TP outside the TP regions:

- ColumnParallelLinear: ``W [out/tp, in]`` (TP axis 0). Input is copied into the TP region
  (gradient all-reduced) or, under SP, all-gathered along the sequence (gradient
  reduce-scattered). Output stays split along its last dim unless ``gather_output``.
  ``partition_sizes`` describes fused outputs ([Q|K|V], [gate|up]): each rank holds its slice
  of every block, concatenated in block order.
- RowParallelLinear: ``W [out, in/tp]`` (TP axis 1) on a split input; the partial outputs are
  all-reduced or, under SP, reduce-scattered along the sequence. The bias (replicated) is
  added after the reduction; under SP its gradient comes from sequence shards, so it is
  marked ``sequence_parallel`` in its ParamMeta.
- Weights are cast to the activation dtype on the fly (``params_dtype`` vs ``compute_dtype``).
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import linear
from shardwork.models.module import ShardedModule
from shardwork.models.sharding import describe_param
from shardwork.parallel_state import (
    ParamMeta,
    ProcessGroups,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _param(shape, *, dtype, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class ColumnParallelLinear(ShardedModule):
    """``y = x Wᵀ + b`` with the output features split over TP (see module docstring)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        groups: ProcessGroups,
        bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        partition_sizes: tuple[int, ...] | None = None,
        block_names: tuple[str, ...] | None = None,
        init: str = "normal",
        params_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        kernel_backend: str | None = None,
    ) -> None:
        super().__init__(groups)
        self.kernel_backend = kernel_backend
        tp = groups.size("tp")
        sizes = partition_sizes or (output_size,)
        if sum(sizes) != output_size:
            raise ValueError(f"partition_sizes={sizes} must sum to output_size={output_size}")
        for s in sizes:
            if s % tp != 0:
                raise ValueError(
                    f"output block of size {s} is not divisible by tp={tp}; "
                    "each tensor-parallel rank needs an equal slice"
                )
        self.input_size, self.output_size = input_size, output_size
        self.local_output_size = output_size // tp
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        meta = ParamMeta(tp_axis=0, tp_partition_sizes=partition_sizes)
        self.weight = describe_param(
            _param((self.local_output_size, input_size), dtype=params_dtype, device=device),
            meta,
            init=init,
            blocks=block_names,
        )
        if bias:
            self.bias = describe_param(
                _param((self.local_output_size,), dtype=params_dtype, device=device),
                meta,
                init="zeros",
                blocks=block_names,
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x [s(/tp under SP), b, in]`` -> ``[s, b, out/tp]`` (or ``out`` if gathered).

        ``weight`` overrides the own weight (a tied LM head passes the embedding's).
        """
        w = self.weight if weight is None else weight
        x = self.enter_tp_region(x)
        b = None if self.bias is None else self.bias.to(x.dtype)
        # Cast on the fly: params may be fp32 (params_dtype) while activations run in bf16.
        return self._leave_tp_region(linear(x, w.to(x.dtype), b, backend=self.kernel_backend))

    def enter_tp_region(self, x: torch.Tensor) -> torch.Tensor:
        """The input every TP rank multiplies: gathered along the sequence under SP."""
        tp = self.groups.tp
        if self.sequence_parallel:
            # g of the SP paper (Korthikanti et al. 2022): all-gather the sequence forward; backward
            # reduce-scatters because each rank's output slice contributes a partial gradient for
            # every token.
            return gather_from_sequence_region(x, tp, dim=0, grad_is_partial=True)
        # f of the Megatron-LM paper (Shoeybi et al. 2019, sec. 3): identity forward, all-reduce
        # of the input gradient backward.
        return copy_to_tp_region(x, tp)

    def _leave_tp_region(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's output slice, or every rank's slices gathered with ``gather_output``."""
        if self.gather_output:
            # Concatenates the local slices rank by rank: with several partition blocks the
            # result is in per-rank block order, not the global [A | B] layout.
            y = gather_from_tp_region(y, self.groups.tp)
        return y


class RowParallelLinear(ShardedModule):
    """``y = x Wᵀ + b`` with the input features split over TP (see module docstring)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        groups: ProcessGroups,
        bias: bool = False,
        sequence_parallel: bool = False,
        init: str = "scaled_normal",
        params_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        kernel_backend: str | None = None,
    ) -> None:
        super().__init__(groups)
        self.kernel_backend = kernel_backend
        tp = groups.size("tp")
        if input_size % tp != 0:
            raise ValueError(f"input_size={input_size} is not divisible by tp={tp}")
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel = sequence_parallel
        self.weight = describe_param(
            _param((output_size, input_size // tp), dtype=params_dtype, device=device),
            ParamMeta(tp_axis=1),
            init=init,
        )
        if bias:
            self.bias = describe_param(
                _param((output_size,), dtype=params_dtype, device=device),
                # Under SP the bias sees only this rank's tokens, so its gradient must be
                # all-reduced over TP.
                ParamMeta(sequence_parallel=sequence_parallel),
                init="zeros",
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [s, b, in/tp]`` -> ``[s(/tp under SP), b, out]``, summed over TP."""
        # No bias yet: each rank's product is a partial sum, and a bias added here would be counted
        # tp times by the reduction.
        y = linear(x, self.weight.to(x.dtype), backend=self.kernel_backend)
        return self._add_bias(self._reduce_partial(y))

    def _reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """Sum this rank's partial product over TP (reduce-scattered along the sequence under SP)."""
        if self.sequence_parallel:
            # g-bar of the SP paper: sum partial outputs and keep this rank's sequence chunk.
            return reduce_scatter_to_sequence_region(y, self.groups.tp, dim=0)
        # g of the Megatron-LM paper: all-reduce forward, identity backward.
        return reduce_from_tp_region(y, self.groups.tp)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)
