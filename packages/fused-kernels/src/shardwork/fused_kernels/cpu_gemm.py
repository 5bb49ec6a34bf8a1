"""Float32 CPU matrix products through oneDNN where torch's default (MKL) is the slower one.

torch multiplies float32 CPU matrices with MKL's sgemm; oneDNN, which every x86 build of
torch also carries, picks its kernels from the CPU's instruction sets alone. Measured on 2-core
AMD EPYC (AVX-512) machines, 1 and 2 threads, shapes of the issue-24 models:

- family 25 (Zen 4, ``benchmarks/results/cpu_gemm.md``): ``x·Wᵀ`` (a linear's forward) 6-19 %
  faster on oneDNN, ``dY·W`` (its input gradient) 5-20 %, ``dYᵀ·X`` (its weight gradient)
  0.88-1.09x, faster only where the weight is at least twice as wide as tall (fc2), so only
  there; other weight gradients stay on MKL there;
- family 26 (Zen 5, ``benchmarks/results/cpu_gemm-zen5.md``): oneDNN 1.6-2.3x on the forward
  and input gradient, 1.45-2.23x on every weight gradient, so every product takes it
  (:func:`weight_grad_on_onednn`).

MKL runs no faster on these CPUs when allowed AVX-512 than when limited to AVX2
(``MKL_ENABLE_INSTRUCTIONS=AVX2``), as expected of a library that tunes its fast paths for Intel
CPUs; Zen 5 runs oneDNN's AVX-512 kernels at full width, hence the doubling. On Intel CPUs MKL
is kept (not measured: no Intel machine here).

- :func:`onednn_preferred`: whether a call asked for with ``backend`` takes oneDNN: ``"auto"``
  (or the default ``"auto"``), a float32 CPU tensor, oneDNN in this torch build, a CPU whose
  vendor is not Intel, and no dispatch mode (``FlopCounterMode`` and fake tensors count and
  shape ``aten.mm``). Under ``torch.compile`` the products are one custom op each
  (:func:`_onednn_linear_2d_op`), since inductor lowers oneDNN's linear only for a constant
  weight; a traced linear used to fall back to MKL's ``aten.mm``, which on a Zen 5 host made
  compiled layers 0.75x eager's step instead of 1.03-1.13x. A
  named backend (``"torch"``, ``"triton"``, ``"te"``) keeps torch's own product: none of them
  has a GEMM of its own, and ``"torch"`` stays the MKL reference. The answer depends only on
  the call, the machine and :data:`CPU_GEMM_ENV`, never on a timing, so a rerun (or a resumed
  run) computes the same bits.
- :data:`CPU_GEMM_ENV` (``SHARDWORK_CPU_GEMM``) overrides the vendor rule for ``"auto"`` calls:
  ``mkl`` keeps torch's own product on every CPU (an Intel machine's path: to reproduce its
  bits, or to rule oneDNN out), ``onednn`` takes oneDNN on Intel CPUs too (not measured
  there); unset or ``auto``: the rule above.
- :func:`linear` is ``F.linear`` with that choice; :func:`onednn_linear` and
  :func:`onednn_grouped_linear` (the MoE experts' product over contiguous row groups) run
  oneDNN whatever the CPU. Both compute the weight gradient with :func:`weight_grad_mm`.
- A weight operand that is not dense in row- or column-major order is copied dense before
  oneDNN sees it (:func:`_dense_operand`: oneDNN runs such strides ~1,400x slower).
- The products equal MKL's up to summation order: relative error against float64 ~8e-7 of
  the largest entry at K = 512 (MKL's ~4e-7), both far below float32 training noise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from shardwork.fused_kernels.backend import BACKENDS, get_default_backend

__all__ = [
    "CPU_GEMM_CHOICES",
    "CPU_GEMM_ENV",
    "cpu_family",
    "cpu_gemm_env_problem",
    "cpu_vendor",
    "group_min",
    "group_mm_nt",
    "group_rows",
    "linear",
    "onednn_grouped_linear",
    "onednn_linear",
    "onednn_mm_nt",
    "onednn_preferred",
    "weight_grad_mm",
    "weight_grad_on_onednn",
]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _read_cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` ({} where unreadable)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", errors="replace") as lines:
            for line in lines:
                if not line.strip():  # the blank line that ends the first processor's block
                    break
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
    except OSError:
        return {}
    return fields


# Read once, at import: a file read inside a torch.compile trace would break every layer's graph.
_CPUINFO = _read_cpuinfo()


def cpu_vendor() -> str:
    """The CPU vendor string of ``/proc/cpuinfo`` (``"GenuineIntel"``, ``"AuthenticAMD"``), or
    ``""`` where it cannot be read (then oneDNN is not preferred)."""
    return _CPUINFO.get("vendor_id", "")


def cpu_family() -> int | None:
    """The CPU family number of ``/proc/cpuinfo`` (decimal: 25 for AMD's Zen 3 and 4, 26 for
    Zen 5), or None where it cannot be read."""
    value = _CPUINFO.get("cpu family", "")
    return int(value) if value.isdigit() else None


# Read once: dynamo refuses to trace torch.backends.mkldnn.is_available (a graph break per call).
_ONEDNN_IN_TORCH = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


def _onednn_built() -> bool:
    return _ONEDNN_IN_TORCH


CPU_GEMM_ENV = "SHARDWORK_CPU_GEMM"
"""The environment variable choosing the library of ``"auto"`` float32 CPU products: one of
:data:`CPU_GEMM_CHOICES` (unset: ``"auto"``); read at each call."""

CPU_GEMM_CHOICES = ("auto", "mkl", "onednn")


def cpu_gemm_env_problem() -> str | None:
    """What is wrong with :data:`CPU_GEMM_ENV`'s value here, or None when it is unset or valid."""
    value = os.environ.get(CPU_GEMM_ENV)
    if value in (None, "auto", "mkl"):
        return None
    if value != "onednn":
        return (
            f"{CPU_GEMM_ENV}={value!r} is not a choice; valid: {', '.join(CPU_GEMM_CHOICES)} "
            "(unset: auto)"
        )
    if not _onednn_built():
        return f"{CPU_GEMM_ENV}='onednn', but this torch build has no oneDNN; valid here: auto, mkl"
    return None


def _cpu_gemm_choice() -> str:
    # Read on every "auto" product: one lookup for the common values, the full check otherwise.
    value = os.environ.get(CPU_GEMM_ENV)
    if value in (None, "auto", "mkl"):
        return value or "auto"
    problem = cpu_gemm_env_problem()
    if problem is not None:
        raise ValueError(problem)
    return value


def onednn_preferred(backend: str | None, *tensors: torch.Tensor | None) -> bool:
    """Whether float32 CPU products of ``tensors`` asked for with ``backend`` run on oneDNN."""
    requested = get_default_backend() if backend is None else backend
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not a backend; valid: {', '.join(BACKENDS)}")
    # A dispatch mode (torch's FlopCounterMode, fake tensors) must see torch's own aten.mm.
    if requested != "auto" or is_in_torch_dispatch_mode():
        return False
    # The environment and the machine first (the same answer every call), then the operands.
    choice = _cpu_gemm_choice()
    if choice == "mkl" or not _onednn_built():
        return False
    if choice == "auto" and cpu_vendor() in ("", "GenuineIntel"):
        return False
    return all(t is None or _onednn_operand(t) for t in tensors)


def _onednn_operand(t: torch.Tensor) -> bool:
    # Tensor subclasses (DTensor, fake tensors) keep F.linear's own dispatch.
    return type(t) in _PLAIN and t.dtype == torch.float32 and t.device.type == "cpu"


def _check_operands(**tensors: torch.Tensor | None) -> None:
    if not _onednn_built():
        raise ValueError("this torch build has no oneDNN (torch.backends.mkldnn)")
    for name, t in tensors.items():
        if t is not None and not _onednn_operand(t):
            raise ValueError(
                f"{name} ({type(t).__name__}, {t.dtype}, {t.device}) cannot run on oneDNN: "
                "it takes plain float32 CPU tensors"
            )


def _dense_operand(t: torch.Tensor) -> torch.Tensor:
    """The matrix ``t`` itself where it is dense in row- or column-major order, else a copy that
    is (column-major where ``t``'s columns are its unit-stride dimension, row-major otherwise).

    oneDNN's linear reads its weight operand (``b`` of :func:`onednn_mm_nt`, the weight of
    :func:`linear`) fast in either dense order, but any other strides (a column slice
    ``W[:, :k]``, the transposed view of a column-sliced input, every other row) send it to a
    reference kernel. Measured on the 2-core AMD EPYC, one thread, ``[512, 512]·[512, 512]ᵀ``
    (``benchmarks/cpu_gemm_strides.py``): 3.45-3.47 s with such a ``b`` as it is, 2.5 ms copied
    (2.4 ms for a dense ``b``); the weight gradient ``dyᵀ·x`` of a column-sliced ``x [512,
    1536]`` 10.6 s against 7.8 ms. The copy costs one pass over the operand; its values are the
    operand's."""
    if t.is_contiguous() or t.t().is_contiguous():
        return t
    if t.stride(0) == 1:
        return t.t().contiguous().t()
    return t.contiguous()


def _onednn_linear_2d(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, _dense_operand(b), bias, "none", [], "")


@torch.library.custom_op("shardwork_fused_kernels::onednn_linear_2d", mutates_args=())
def _onednn_linear_2d_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """:func:`_onednn_linear_2d` as one opaque op inside a ``torch.compile`` graph: inductor's
    own lowering of oneDNN's linear takes only a constant weight (inference with frozen
    parameters), so a training graph calls this op as an external kernel instead, and compiled
    layers compute their products on oneDNN as eager ones do (same library, same bits)."""
    return _onednn_linear_2d(a, b, bias)


@_onednn_linear_2d_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]))


def _onednn_linear(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a [M, K] · b [N, K]ᵀ (+ bias [N])`` on oneDNN: directly in eager mode, through the
    custom op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return _onednn_linear_2d_op(a, b, bias)
    return _onednn_linear_2d(a, b, bias)


def onednn_mm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] · b [N, K]ᵀ`` on oneDNN (``b`` may be a transposed view; other strides are
    made dense first, :func:`_dense_operand`); float32 CPU tensors, checked by the caller
    (:func:`onednn_preferred`). Under ``torch.compile`` one opaque op of the graph."""
    return _onednn_linear(a, b, None)


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        y = _onednn_linear(x2, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = onednn_mm_nt(g2, weight.t()).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = weight_grad_mm(g2, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return dx, dw, db


def _check_linear_shapes(x, weight, bias) -> None:
    """``x [..., in]``, ``weight [out, in]``, ``bias [out]`` or None: a ``ValueError`` naming the
    shapes before oneDNN's own error ("could not create a primitive descriptor") can occur."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() == 0:
        raise ValueError(f"x.shape={tuple(x.shape)} must be [..., in] with at least one dim")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight.shape={tuple(weight.shape)} must be [out, in] with in = x.shape[-1] = "
            f"{x.shape[-1]} (x.shape={tuple(x.shape)})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias.shape={tuple(bias.shape)} must be ({weight.shape[0]},) = [out] of "
            f"weight.shape={tuple(weight.shape)}"
        )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``x [..., in] · weight [out, in]ᵀ + bias [out]``, as ``F.linear``; on oneDNN
    (:func:`onednn_linear`) where :func:`onednn_preferred`. Shapes are checked first, on every
    path (:func:`_check_linear_shapes`)."""
    _check_linear_shapes(x, weight, bias)
    if onednn_preferred(backend, x, weight, bias):
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`linear` on oneDNN whatever the CPU (no double backward); float32 CPU tensors."""
    _check_linear_shapes(x, weight, bias)
    _check_operands(x=x, weight=weight, bias=bias)
    return _OneDnnLinear.apply(x, weight, bias)


_FULL_WIDTH_FAMILY = 26
"""AMD CPU family (Zen 5) from which oneDNN takes every weight gradient and smaller groups
(:func:`weight_grad_on_onednn`, :func:`group_min`). Measured on a 2-core AMD EPYC of family 26,
model 2 (``benchmarks/results/cpu_gemm-zen5.md``, the issue-24 shapes): oneDNN 1.45-2.23x MKL
on every weight gradient, 1.6-2.3x on the forward and input-gradient products. Zen 5's server
cores execute 512-bit instructions at full width, Zen 4's in two 256-bit halves; MKL takes the
same AVX2 path on both (it tunes its AVX-512 kernels for Intel CPUs), oneDNN its AVX-512
kernels. Zen 5 client parts that halve the datapath share the family number and were not
measured."""


def _full_width_amd() -> bool:
    return cpu_vendor() == "AuthenticAMD" and (cpu_family() or 0) >= _FULL_WIDTH_FAMILY


_GROUP_MIN = 256
"""Rows and inner width from which a group's product runs on oneDNN before
:data:`_FULL_WIDTH_FAMILY` (rows and output width, for a weight gradient). oneDNN has no
``out=``, so its result is copied into the group's rows; measured on Zen 4 (1 thread, widths of
the issue-24 MoE layers), that copy costs more than oneDNN gains below 256 rows or an inner
width of 256, where MKL writes the rows in place."""

_GROUP_MIN_FULL_WIDTH = 128
""":data:`_GROUP_MIN` from :data:`_FULL_WIDTH_FAMILY`. Measured on Zen 5 with the copy included
(rows 64-512, widths 64-512, one and two threads): from 128 rows and widths oneDNN is
1.06-2.1x MKL; at 64 rows or a width of 64 weight gradients ran down to 0.60-0.81x on two
threads (0.37x for a 64 x 64 weight). The Qwen3-MoE-style layer (groups of ~256 rows, ffn 192)
went 256 -> 188 ms on one thread."""


def group_min() -> int:
    """Rows and inner (for a weight gradient, output) width from which an expert group's
    product runs on oneDNN: 128 on AMD CPUs from family 26, 256 before."""
    return _GROUP_MIN_FULL_WIDTH if _full_width_amd() else _GROUP_MIN


_WIDE_WEIGHT = 2
"""Input width over output width from which a weight gradient ``dYᵀ·x`` runs on oneDNN (with
rows and output width from :func:`group_min`) on CPUs before :data:`_FULL_WIDTH_FAMILY`.
Measured on the 2-core AMD EPYC of family 25 (Zen 4; ``benchmarks/results/cpu_gemm.md``, the
issue-24 shapes, 1 and 2 threads): where the weight is at least twice as wide as tall (an MLP's
or expert's fc2, ``[H, F]``) oneDNN is 1.04-1.09x faster; square or tall weights (qkv, fc1, the
attention output, the output layer) run 0.88-1.03x there."""


def weight_grad_on_onednn(rows: int, out_features: int, in_features: int) -> bool:
    """Whether :func:`weight_grad_mm` of ``dy [rows, out_features]`` and ``x [rows,
    in_features]`` runs on oneDNN: rows and both widths from :func:`group_min`, and either an
    AMD CPU from family 26 (:data:`_FULL_WIDTH_FAMILY`) or ``in_features >= 2·out_features``.
    Depends on the shapes and the machine only, never on a timing."""
    least = group_min()
    if min(rows, out_features, in_features) < least:
        return False
    return _full_width_amd() or in_features >= _WIDE_WEIGHT * out_features


def weight_grad_mm(
    dy: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A linear's weight gradient ``dy [n, out]ᵀ · x [n, in]`` -> ``[out, in]``, float32 CPU
    tensors: on oneDNN where :func:`weight_grad_on_onednn` (``xᵀ`` goes in as a transposed
    view; the op copies ``dyᵀ`` contiguous itself, a cost inside the timings behind the rule),
    on MKL otherwise. Written into ``out`` when given (MKL in place, oneDNN's result copied),
    else returned fresh. The choice depends on the shapes and the CPU alone, so a rerun on the
    machine computes the same bits."""
    if weight_grad_on_onednn(dy.shape[0], dy.shape[1], x.shape[1]):
        dw = onednn_mm_nt(dy.t(), x.t())
        return dw if out is None else out.copy_(dw)
    return torch.mm(dy.t(), x) if out is None else torch.mm(dy.t(), x, out=out)


def group_rows(counts: list[int]) -> Iterator[tuple[int, slice]]:
    """``(group, row slice)`` of each group, for rows grouped contiguously by ``counts``."""
    start = 0
    for group, count in enumerate(counts):
        yield group, slice(start, start + count)
        start += count


def group_mm_nt(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] · b [N, K]ᵀ`` of one expert group, float32 CPU tensors: on oneDNN from
    :func:`group_min` rows and inner width, on MKL below; written into ``out`` (a row block of a
    stacked result, where MKL writes in place and oneDNN's result is copied) or returned fresh."""
    least = group_min()
    big = a.shape[0] >= least and a.shape[1] >= least
    if out is None:
        return onednn_mm_nt(a, b) if big else torch.mm(a, b.t())
    if big:
        out.copy_(onednn_mm_nt(a, b))
    elif a.shape[0]:
        torch.mm(a, b.t(), out=out)
    return out


class _OneDnnGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, w_LOI, counts):
        y = x_NI.new_empty((x_NI.shape[0], w_LOI.shape[1]))
        for group, rows in group_rows(counts):
            group_mm_nt(x_NI[rows], w_LOI[group], y[rows])
        ctx.save_for_backward(x_NI, w_LOI)
        ctx.counts = counts
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x_NI, w_LOI = ctx.saved_tensors
        dx = x_NI.new_empty(x_NI.shape) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w_LOI) if ctx.needs_input_grad[1] else None
        for group, rows in group_rows(ctx.counts):
            if rows.start == rows.stop:  # a group without rows: zero weight gradient
                if dw is not None:
                    dw[group].zero_()
                continue
            if dx is not None:
                group_mm_nt(grad[rows], w_LOI[group].t(), dx[rows])
            if dw is not None:
                weight_grad_mm(grad[rows], x_NI[rows], dw[group])
        return dx, dw, None


def onednn_grouped_linear(
    x_NI: torch.Tensor, w_LOI: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """``y[rows of group l] = x[rows of group l] · w[l]ᵀ``, rows grouped contiguously by
    ``counts`` (Python ints summing to ``N``): a group's forward and input-gradient products on
    oneDNN from :func:`group_min` rows and inner width (256; 128 on Zen 5), on MKL in place below;
    ``dW [L, out, in]`` is written in one buffer (empty groups get zeros). Callers ask
    :func:`onednn_preferred` first."""
    _check_operands(x_NI=x_NI, w_LOI=w_LOI)
    if sum(counts) != x_NI.shape[0] or len(counts) != w_LOI.shape[0]:
        raise ValueError(
            f"counts={counts} must have {w_LOI.shape[0]} entries (one per group of w_LOI) "
            f"summing to x_NI's {x_NI.shape[0]} rows"
        )
    return _OneDnnGroupedLinear.apply(x_NI.contiguous(), w_LOI, list(counts))
