"""Choosing between a hybrid mixer's plain-torch scan and an optional installed kernel.

The Mamba-2 and Gated DeltaNet mixers each have a plain-torch chunked scan (the reference,
always available) and, on a GPU, can use a Triton kernel from an optional package
(``mamba-ssm``, ``flash-linear-attention``) that is never a dependency of this project.
``MambaConfig.kernel_backend`` / ``GatedDeltaNetConfig.kernel_backend`` pick one:

- ``"torch"``: always the reference.
- ``"triton"``: always the kernel. Building a ``GPTConfig`` that holds such a mixer config
  (so before any model, process group or step) raises a ``ValueError`` naming the field, its
  value and what to install when the kernel cannot be imported; a forward on a tensor the
  kernel cannot take (CPU without ``TRITON_INTERPRET=1``, float64) raises before any work.
- ``"auto"`` (default): the kernel only for CUDA tensors of a kernel dtype, when it imports
  and ``GPTConfig.kernel_backend`` is not ``"torch"``; the reference everywhere else. CPU
  runs therefore never change numerics because a package happens to be installed.

The optional package is imported lazily, once, on the first question about it
(:meth:`OptionalKernel.unavailable_reason`), never at import time of this module.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwork.fused_kernels.backend import triton_interpreter_enabled

__all__ = ["SCAN_BACKENDS", "OptionalKernel", "check_scan_backend"]

logger = logging.getLogger("shardwork.models")

SCAN_BACKENDS = ("auto", "torch", "triton")
"""Values of ``MambaConfig.kernel_backend`` and ``GatedDeltaNetConfig.kernel_backend``."""


def check_scan_backend(owner: str, value: object) -> None:
    """Raise a ``ValueError`` naming ``owner.kernel_backend`` when ``value`` is not valid."""
    if value not in SCAN_BACKENDS:
        raise ValueError(f"{owner}.kernel_backend={value!r} is invalid: valid are {SCAN_BACKENDS}")


@functools.cache
def _load(module: str, function: str) -> tuple[Callable | None, str | None]:
    """``(function, None)`` when ``module.function`` imports, else ``(None, why not)``."""
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return None, f"package {top!r} is not installed"
    try:
        fn = getattr(importlib.import_module(module), function)
    except Exception as exc:  # any failure of a third-party import means "not available"
        return None, f"importing {module}.{function} failed ({type(exc).__name__}: {exc})"
    return fn, None


@dataclass(frozen=True)
class OptionalKernel:
    """One optional kernel function: where it lives, who asks for it, what to install."""

    owner: str
    """The config class whose ``kernel_backend`` selects it, for error messages."""
    distribution: str
    """The pip distribution that provides it."""
    module: str
    function: str
    device_refusal: Callable[[torch.device], str | None] | None = None
    """Why the kernel must not run on a device although it imports (a known-bad combination of
    GPU and compiler that the package itself refuses mid-run), or None."""

    def unavailable_reason(self) -> str | None:
        """None when the kernel imports here, else why not (imports it on first call)."""
        return _load(self.module, self.function)[1]

    def load(self) -> Callable:
        """The kernel function; :meth:`require` must have passed."""
        fn, reason = _load(self.module, self.function)
        if fn is None:
            raise RuntimeError(f"{self.module}.{self.function} is not available: {reason}")
        return fn

    def require(self) -> None:
        """Raise the build-time error of ``kernel_backend="triton"`` when the kernel is missing."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise ValueError(
                f"{self.owner}.kernel_backend='triton' needs {self.module}.{self.function} "
                f"from {self.distribution!r}, which cannot be used here: {reason}. Install it "
                f"(pip install {self.distribution}) on a CUDA machine, or use "
                "kernel_backend='auto' or 'torch'"
            )

    def use_kernel(self, requested: str, model_backend: str, x: torch.Tensor) -> bool:
        """Whether a forward on ``x`` runs the kernel (module docstring); raises for a
        ``"triton"`` request the tensor cannot satisfy."""
        if requested == "torch":
            return False
        if requested == "triton":
            self.require()
            on_cpu_interpreter = x.device.type == "cpu" and triton_interpreter_enabled()
            if x.device.type != "cuda" and not on_cpu_interpreter:
                raise ValueError(
                    f"{self.owner}.kernel_backend='triton' cannot run on a {x.device.type} "
                    "tensor: it needs CUDA (or a CPU tensor with TRITON_INTERPRET=1 set "
                    "before triton is imported); use kernel_backend='auto' or 'torch'"
                )
            if x.dtype == torch.float64:
                raise ValueError(
                    f"{self.owner}.kernel_backend='triton' does not take float64 inputs; use "
                    "kernel_backend='auto' or 'torch'"
                )
            refusal = self._refusal(x.device)
            if refusal is not None:
                raise ValueError(
                    f"{self.owner}.kernel_backend='triton' cannot run here: {refusal}; use "
                    "kernel_backend='auto' (falls back to the torch scan) or 'torch'"
                )
            return True
        if model_backend == "torch" or x.device.type != "cuda" or x.dtype == torch.float64:
            return False
        reason = self.unavailable_reason() or self._refusal(x.device)
        if reason is not None:
            _log_fallback(self.function, reason)
        return reason is None

    def _refusal(self, device: torch.device) -> str | None:
        return None if self.device_refusal is None else self.device_refusal(device)


@functools.cache
def _log_fallback(function: str, reason: str) -> None:
    logger.info("kernel_backend='auto': %s not used on CUDA (%s)", function, reason)
