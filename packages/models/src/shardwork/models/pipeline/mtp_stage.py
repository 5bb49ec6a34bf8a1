"""Standalone MTP stage: the pipeline plan that gives the MTP depths a rank of their own.

Megatron-Core places MTP with a pipeline layout string (``m`` for an MTP layer, ``L`` for the
loss, e.g. ``"E|t*3|(t|)*3tt|m|L"``); with the MTP layers on a rank before the last it sets
``mtp_standalone``, and the decoder's final layernorm runs on the stage of the last decoder
layer. shardwork's equivalent is one switch, ``mtp_standalone``, and keeps MTP with the head:

- the last pipeline rank holds no decoder layer; it holds the MTP depths, the LM head and both
  losses (main and MTP, each computed once, combined as on any last stage);
- the decoder's final norm moves to rank ``pp - 2`` (the rank before the MTP stage), so what
  crosses the last p2p hop is the normed hidden state ``[s(/tp), b, h]`` that both the head and
  MTP depth 1 consume;
- the embedding and head the MTP stage uses are the existing copies of the last stage (the tied
  head's copy, or an MTP-owned embedding copy when untied), kept equal to the first stage's by
  summing their gradients over the embedding group (``finalize_model_grads``).

Validation happens here, before any layer is built: the switch needs pp > 1, vpp = 1 (the last
rank's chunks would otherwise share the decoder layers) and a model with MTP, and leaves no
room for a non-zero ``last_stage_layers``.
"""

from __future__ import annotations

__all__ = ["standalone_last_stage_layers"]


def standalone_last_stage_layers(
    mtp_standalone: bool,
    *,
    has_mtp: bool,
    pp: int,
    vpp: int | None,
    last_stage_layers: int | None,
) -> int | None:
    """The ``last_stage_layers`` the split must use: 0 with ``mtp_standalone``, else unchanged.

    Raises ValueError naming ``mtp_standalone``, the conflicting value and what is valid.
    """
    if not isinstance(mtp_standalone, bool):
        raise ValueError(f"mtp_standalone={mtp_standalone!r} is invalid: it must be True or False")
    if not mtp_standalone:
        return last_stage_layers
    if not has_mtp:
        raise ValueError(
            "mtp_standalone=True needs a model with multi-token prediction (GPTConfig.mtp, "
            "[model.mtp]); this model has none: set mtp or mtp_standalone=False"
        )
    if pp < 2:
        raise ValueError(
            f"mtp_standalone=True needs pp >= 2 (the MTP depths get the last pipeline rank), "
            f"got pp={pp}: use pp >= 2 or mtp_standalone=False"
        )
    if vpp is not None and vpp > 1:
        raise ValueError(
            f"mtp_standalone=True needs vpp=1 or None, got vpp={vpp}: the MTP stage is a whole "
            "pipeline rank with no decoder layers, which interleaved chunks cannot give"
        )
    if last_stage_layers not in (None, 0):
        raise ValueError(
            f"last_stage_layers={last_stage_layers!r} conflicts with mtp_standalone=True, whose "
            "last pipeline rank holds no decoder layer: leave last_stage_layers unset (or 0)"
        )
    return 0
