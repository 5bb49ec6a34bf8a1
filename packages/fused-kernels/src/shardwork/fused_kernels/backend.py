"""Backend selection: which implementation of an op runs, decided by capability, never silently.

- Backends: ``"torch"`` (plain PyTorch reference, always available), ``"triton"``
  (this package's Triton kernels), ``"te"`` (Transformer Engine, where it offers the op).
  ``"auto"`` picks Triton on CUDA when Triton is importable, Transformer Engine
  instead when the default was set with ``prefer_te=True`` and TE offers the op,
  and torch everywhere else (CPU included, even under the Triton interpreter, and
  for float64 inputs, which the kernels do not compute in).
- A per-call ``backend=`` wins over the process-wide default
  (:func:`set_default_backend`). The default is a setting read at each call, not
  parallel state; changing it is logged.
- :func:`resolve_backend` is pure given (op, request, device, default, installed
  packages): the same call always gets the same answer. The first time each
  answer is given it is logged (logger ``shardwork.fused_kernels``).
- A backend that was asked for by name and cannot run raises
  :class:`BackendUnavailableError` saying why; there is no fallback. Triton on a
  CPU tensor needs ``TRITON_INTERPRET=1`` set before Triton is imported.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass

import torch

from shardwork.fused_kernels import te_support

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "OPS",
    "BackendUnavailableError",
    "backend_env_problem",
    "get_default_backend",
    "resolve_backend",
    "set_default_backend",
    "triton_available",
    "triton_interpreter_enabled",
]

logger = logging.getLogger("shardwork.fused_kernels")

BACKENDS = ("auto", "torch", "triton", "te")
"""Values accepted by ``backend=`` and :func:`set_default_backend`."""

OPS = (
    "rms_norm",
    "layer_norm",
    "swiglu",
    "geglu",
    "rotary",
    "cross_entropy",
    "linear_cross_entropy",
    "router_topk",
    "permute",
    "unpermute",
)
"""Op names understood by :func:`resolve_backend`."""


class BackendUnavailableError(RuntimeError):
    """A backend was requested by name but cannot run this op here (the message says why)."""


@dataclass(frozen=True)
class _Default:
    backend: str = "auto"
    prefer_te: bool = False


BACKEND_ENV = "SHARDWORK_KERNEL_BACKEND"
"""The environment variable that sets the process-wide default backend until
:func:`set_default_backend` is called (unset: ``"auto"``)."""


def backend_env_problem() -> str | None:
    """What is wrong with :data:`BACKEND_ENV`'s value, or None when it is unset or valid."""
    value = os.environ.get(BACKEND_ENV)
    if value is None or value in BACKENDS:
        return None
    return f"{BACKEND_ENV}={value!r} is not a backend; valid: {', '.join(BACKENDS)} (unset: auto)"


class _DefaultSetting:
    """Holder of the process-wide default (a user setting, like ``torch.set_default_dtype``).

    The environment is read when the default is first needed, not at import: a bad value then
    fails the first op that asks (ValueError naming it), not every import of the package, and a
    program can check it first (:func:`~shardwork.fused_kernels.environment_problems`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: _Default | None = None

    def get(self) -> _Default:
        value = self._value  # set once read: no lock on the path every op takes
        if value is not None:
            return value
        with self._lock:
            if self._value is None:
                problem = backend_env_problem()
                if problem is not None:
                    raise ValueError(problem)
                self._value = _Default(os.environ.get(BACKEND_ENV, "auto"), False)
            return self._value

    def prefers_te(self) -> bool:
        """``prefer_te`` of the default; only :func:`set_default_backend` sets it, so this needs
        no environment (an explicit ``backend="auto"`` runs whatever the variable says)."""
        value = self._value
        return value is not None and value.prefer_te

    def set(self, value: _Default) -> None:
        with self._lock:
            old, self._value = self._value, value
        if old != value:
            logger.info("fused_kernels default backend: %s -> %s", old or "environment", value)


_DEFAULT = _DefaultSetting()


def set_default_backend(backend: str, *, prefer_te: bool = False) -> None:
    """Set the backend used when a call passes ``backend=None``.

    ``prefer_te=True`` (only meaningful with ``"auto"``) makes ``auto`` choose
    Transformer Engine on CUDA for the ops TE offers. The environment variable
    ``SHARDWORK_KERNEL_BACKEND`` sets the initial value (:data:`BACKEND_ENV`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a backend; valid: {', '.join(BACKENDS)}")
    _DEFAULT.set(_Default(backend, bool(prefer_te)))


def get_default_backend() -> str:
    """The backend used when a call passes ``backend=None`` (``"auto"`` unless set)."""
    return _DEFAULT.get().backend


def triton_interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` (Triton kernels then run on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be found (it is imported only when a kernel runs)."""
    return importlib.util.find_spec("triton") is not None


def _check_triton(op: str, device: torch.device) -> None:
    if not triton_available():
        raise BackendUnavailableError(
            f"backend='triton' for {op}: triton is not installed "
            "(pip install 'shardwork-fused-kernels[triton]')"
        )
    if device.type == "cuda":
        return
    if device.type == "cpu":
        if triton_interpreter_enabled():
            return
        raise BackendUnavailableError(
            f"backend='triton' for {op} on a CPU tensor needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before triton is imported, or use backend='torch'"
        )
    raise BackendUnavailableError(
        f"backend='triton' for {op}: device type {device.type!r} is not supported (cuda, or cpu "
        "with TRITON_INTERPRET=1)"
    )


def _check_te(op: str, device: torch.device) -> None:
    reason = te_support.unavailable_reason(op)
    if reason is not None:
        raise BackendUnavailableError(f"backend='te' for {op}: {reason}")
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"backend='te' for {op} needs a CUDA tensor, got device {device}"
        )


def resolve_backend(
    op_name: str,
    backend: str | None,
    device: torch.device | str,
    *,
    dtype: torch.dtype | None = None,
) -> str:
    """Return the backend (``"torch"``, ``"triton"`` or ``"te"``) that runs ``op_name`` on ``device``.

    ``backend=None`` reads the process-wide default. ``dtype`` is the op's input
    dtype when known: float64 runs on torch under ``auto`` (the kernels compute in
    float32) and is refused by a named ``triton``/``te``. Raises ``ValueError`` for
    an unknown op or backend and :class:`BackendUnavailableError` when a named
    backend cannot run here.
    """
    if op_name not in OPS:
        raise ValueError(f"op_name={op_name!r} is not an op; valid: {', '.join(OPS)}")
    requested = _DEFAULT.get().backend if backend is None else backend
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not a backend; valid: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if dtype == torch.float64 and requested in ("triton", "te"):
        raise BackendUnavailableError(
            f"backend={requested!r} for {op_name}: float64 input is not supported (the kernels "
            "compute in float32); use backend='torch' or 'auto'"
        )
    if requested == "torch" or dtype == torch.float64:
        chosen = "torch"
    elif requested == "triton":
        _check_triton(op_name, device)
        chosen = "triton"
    elif requested == "te":
        _check_te(op_name, device)
        chosen = "te"
    elif device.type != "cuda":
        chosen = "torch"
    elif _DEFAULT.prefers_te() and te_support.unavailable_reason(op_name) is None:
        chosen = "te"
    elif triton_available():
        chosen = "triton"
    else:
        chosen = "torch"
    # Logging inside a torch.compile trace is a graph break (dynamo cannot trace Logger calls);
    # the eager call of the same op logs the choice.
    if not torch.compiler.is_compiling():
        _log_choice(op_name, requested, device.type, chosen)
    return chosen


@functools.cache
def _log_choice(op: str, requested: str, device_type: str, chosen: str) -> None:
    logger.info("fused_kernels: %s on %s: backend %r -> %s", op, device_type, requested, chosen)
