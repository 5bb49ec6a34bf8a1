"""Transformer Engine gating: the one place that imports TE and checks its version per op.

- TE is optional (extra ``[te]``). Importing this package never imports TE; the first
  question about TE imports ``transformer_engine.pytorch`` once, and any failure
  (missing, broken build, no CUDA) is kept as a reason string instead of raised.
- ``MIN_TE_VERSION`` maps each op to the first TE release that offers what the
  ``te`` backend calls; an older TE makes that op unavailable (with the reason),
  never a different code path.
"""

from __future__ import annotations

import functools
import importlib
import re
from types import ModuleType

__all__ = [
    "MIN_TE_FEATURE_VERSION",
    "MIN_TE_VERSION",
    "feature_unavailable_reason",
    "te_module",
    "te_version",
    "unavailable_reason",
]

MIN_TE_VERSION: dict[str, tuple[int, int]] = {
    "rms_norm": (2, 0),  # transformer_engine_torch.rmsnorm_fwd/bwd, 2.x argument order
    "layer_norm": (2, 0),  # transformer_engine_torch.layernorm_fwd/bwd, 2.x argument order
    "swiglu": (2, 0),  # transformer_engine.pytorch.ops.SwiGLU
    "geglu": (2, 0),  # transformer_engine.pytorch.ops.GEGLU
    "cross_entropy": (2, 7),  # cross_entropy.parallel_cross_entropy(..., ignore_idx)
    "router_topk": (
        2,
        7,
    ),  # router.fused_topk_with_score_function + fused_compute_score_for_moe_aux_loss
}
"""First Transformer Engine version whose API the ``te`` backend uses, per op.

Not offered through TE: ``rotary`` (TE's RoPE takes angles, not the cos/sin tables of
this API, and YaRN's cos/sin scale has no TE equivalent) and ``permute``/``unpermute``
(TE's ``row_id_map`` is not interchangeable with ``sorted_indices``, so mixing backends
between the two halves would break)."""


MIN_TE_FEATURE_VERSION: dict[str, tuple[int, int]] = {
    "router_topk.sqrtsoftplus": (2, 13),  # score_function="sqrtsoftplus" in the fused router
}
"""First Transformer Engine version offering an option of an op (``"<op>.<option>"``)."""


def _parse_version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        return (0, 0)
    return (int(match.group(1)), int(match.group(2)))


@functools.cache
def _load() -> tuple[ModuleType | None, tuple[int, int] | None, str | None]:
    try:
        te = importlib.import_module("transformer_engine.pytorch")
        base = importlib.import_module("transformer_engine")
    except Exception as exc:  # any failure means "TE is not usable here"
        return (
            None,
            None,
            f"transformer_engine.pytorch cannot be imported ({type(exc).__name__}: {exc})",
        )
    version = _parse_version(str(getattr(base, "__version__", "0.0")))
    return te, version, None


def te_module() -> ModuleType:
    """``transformer_engine.pytorch``; raises ``RuntimeError`` with the reason when unusable."""
    te, _, reason = _load()
    if te is None:
        raise RuntimeError(reason)
    return te


def te_version() -> tuple[int, int] | None:
    """(major, minor) of the importable Transformer Engine, or None."""
    return _load()[1]


def unavailable_reason(op: str) -> str | None:
    """Why the ``te`` backend cannot run ``op`` here, or None when it can."""
    if op not in MIN_TE_VERSION:
        return f"the te backend does not implement {op} (see te_support.MIN_TE_VERSION)"
    te, version, reason = _load()
    if te is None:
        return reason
    need = MIN_TE_VERSION[op]
    if version < need:
        return (
            f"{op} needs Transformer Engine >= {need[0]}.{need[1]}, found {version[0]}.{version[1]}"
        )
    return None


def feature_unavailable_reason(feature: str) -> str | None:
    """Why TE cannot run ``feature`` (a key of ``MIN_TE_FEATURE_VERSION``), or None when it can."""
    op = feature.split(".", 1)[0]
    reason = unavailable_reason(op)
    if reason is not None:
        return reason
    need = MIN_TE_FEATURE_VERSION[feature]
    version = _load()[1]
    if version < need:
        return f"{feature} needs Transformer Engine >= {need[0]}.{need[1]}, found {version[0]}.{version[1]}"
    return None
