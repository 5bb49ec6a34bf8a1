"""Build the GPT model chunk(s) a pipeline rank holds.

- :class:`GPTStage` is :class:`~shardwork.models.GPTModel` plus Megatron's
  ``set_input_tensor(tensor)``: the schedules hand a stage its input activation that way,
  and ``forward`` uses it as ``hidden_states`` on stages that are not ``pre_process``.
  Parameter names, ``sharded_state_dict`` keys and initialisation are GPTModel's.
- :func:`build_stage` builds chunk ``vp_chunk`` of rank ``pp_rank`` with the layers of
  :func:`~shardwork.models.pipeline.split.stage_layers`: virtual stage 0 owns the
  embedding, the last virtual stage the final norm and LM head (with a tied embedding
  that is a copy marked ``shared_embedding``, synchronised by ``finalize_model_grads``).
- Uneven first/last stages: ``first_stage_layers`` / ``last_stage_layers`` arguments, or
  config fields ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``
  when a config has them; or uneven first/last *virtual* stages,
  ``first_virtual_stage_layers`` / ``last_virtual_stage_layers`` (Llama 3's interleaved
  split, :mod:`~shardwork.models.pipeline.split`).
- ``mtp_standalone=True``: the MTP depths on a pipeline rank of their own
  (:mod:`~shardwork.models.pipeline.mtp_stage`).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.gpt_model import GPTModel
from shardwork.models.pipeline.mtp_stage import standalone_last_stage_layers
from shardwork.models.pipeline.split import stage_layers
from shardwork.models.spec import DecoderSpec, spec_for
from shardwork.parallel_state import ProcessGroups


class GPTStage(GPTModel):
    """A :class:`GPTModel` stage that takes its input activation by ``set_input_tensor``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The activation ``[s(/tp under SP), b, h]`` from the previous stage (None on the first)."""
        self.input_tensor = tensor

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any):
        """As :meth:`GPTModel.forward`; ``hidden_states`` defaults to the set input tensor."""
        if not self.pre_process and kwargs.get("hidden_states") is None:
            kwargs["hidden_states"] = self.input_tensor
        return super().forward(input_ids, **kwargs)


def build_stage(
    config: GPTConfig,
    groups: ProcessGroups,
    pp_rank: int | None = None,
    vp_chunk: int | None = None,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
    mtp_standalone: bool = False,
    device: str | torch.device | None = None,
    spec: DecoderSpec | None = None,
) -> GPTStage:
    """The model chunk ``vp_chunk`` (default 0) of pipeline rank ``pp_rank`` (default: this
    rank's), for ``groups``' pp size and vpp (``groups.config.vpp``).

    ``mtp_standalone``: the last rank holds only the MTP depths, head and losses, and the rank
    before it the final norm (:mod:`~shardwork.models.pipeline.mtp_stage`)."""
    pp = groups.size("pp")
    vpp = groups.config.vpp or 1
    pp_rank = groups.rank("pp") if pp_rank is None else pp_rank
    chunk = 0 if vp_chunk is None else vp_chunk
    if first_stage_layers is None:
        first_stage_layers = getattr(config, "num_layers_in_first_pipeline_stage", None)
    if last_stage_layers is None:
        last_stage_layers = getattr(config, "num_layers_in_last_pipeline_stage", None)
    spec = spec_for(config) if spec is None else spec
    last_stage_layers = standalone_last_stage_layers(
        mtp_standalone,
        has_mtp=bool(spec.mtp),
        pp=pp,
        vpp=groups.config.vpp,
        last_stage_layers=last_stage_layers,
    )
    layers = stage_layers(
        config.num_layers,
        pp,
        pp_rank,
        vpp=vpp,
        vp_chunk=chunk,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        first_virtual_stage_layers=first_virtual_stage_layers,
        last_virtual_stage_layers=last_virtual_stage_layers,
    )
    return GPTStage(
        config,
        groups,
        layer_range=(layers.start, layers.stop),
        # Virtual stage 0 (chunk 0 of rank 0) embeds; the last virtual stage (last chunk of the last
        # rank) holds the final norm and head.
        pre_process=(pp_rank == 0 and chunk == 0),
        post_process=(pp_rank == pp - 1 and chunk == vpp - 1),
        # None: with the head (post_process); standalone MTP: on the rank before the MTP stage.
        final_norm=(pp_rank == pp - 2) if mtp_standalone else None,
        device=device,
        spec=spec,
    )


def build_model_chunks(config: GPTConfig, groups: ProcessGroups, **kwargs: Any) -> list[GPTStage]:
    """Every chunk of this rank (``vpp`` of them, one without virtual pipelining), in
    chunk order, as the schedules take them; ``kwargs`` as for :func:`build_stage`."""
    vpp = groups.config.vpp or 1
    return [build_stage(config, groups, vp_chunk=c, **kwargs) for c in range(vpp)]
