"""The ``[model]`` table as read from a file: a preset and nested settings, before any check.

- Every key of ``[model]`` but ``preset`` is a :class:`shardwork.models.GPTConfig` field and a
  nested config is a nested table (``[model.moe]``, ``[model.moe.router]``, ``[model.mla]``,
  ``[model.mtp]``, ``[model.rope_scaling]``); :mod:`.model_settings` checks them against the
  dataclasses when the config is validated.
- The shape before composed configs, ``overrides = {rope_theta = ..., "moe.aux_loss_coeff" =
  ...}``, is converted with a notice naming the new keys (:func:`convert_overrides`), so old
  files and the configs stored in old checkpoints still load.
- Torch-free: ``shardwork-train --help`` and flag errors read configs without loading torch.
"""

from __future__ import annotations

from typing import Any

#: The fields of the old format's MoEConfig that stayed in MoEConfig; every other
#: ``"moe.field"`` of an old ``overrides`` table was a routing option, now in ``moe.router``.
#: (A fact about the frozen old format, so it is written out, not derived from today's class.)
OLD_MOE_OWN_FIELDS = frozenset(
    {
        "ffn_hidden_size",
        "shared_expert_ffn_hidden_size",
        "shared_expert_gate",
        "first_k_dense_replace",
        "layer_freq",
        "dispatcher",
        "grouped_gemm",
    }
)


def convert_overrides(table: dict[str, Any], notices: list[str], problems: list[str]) -> dict:
    """``[model]`` in the old shape (``overrides`` of ``"field"`` / ``"section.field"`` keys)
    as the new nested table; ``notices`` gets one line naming the new keys."""
    overrides = table.get("overrides")
    if overrides is None:
        return table
    if not isinstance(overrides, dict):
        problems.append(f"model.overrides={overrides!r}: must be a table (the old format)")
        return {k: v for k, v in table.items() if k != "overrides"}
    new = {k: v for k, v in table.items() if k != "overrides"}
    written = []
    for key, value in overrides.items():
        path = str(key).split(".")
        # Routing options moved from MoEConfig into MoEConfig.router.
        if len(path) == 2 and path[0] == "moe" and path[1] not in OLD_MOE_OWN_FIELDS:
            path = ["moe", "router", path[1]]
        node = new
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"model.overrides[{key!r}]: model.{part} is not a table")
                break
        else:
            if path[-1] in node:
                problems.append(f"model.overrides[{key!r}]: also set as model.{'.'.join(path)}")
            node[path[-1]] = value
            written.append(f"model.{'.'.join(path)} = {value!r}")
    notices.append(
        "model.overrides is the format before composed configs; read as "
        + ", ".join(written)
        + " (write them so: a GPTConfig field in [model], a nested one in [model.moe], "
        "[model.moe.router], ...)"
    )
    return new


def flatten_settings(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"moe": {"router": {"top_k": 4}}}`` → ``{"moe.router.top_k": 4}``."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_settings(value, name + "."))
        else:
            flat[name] = value
    return flat
