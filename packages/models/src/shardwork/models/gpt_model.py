"""``GPTModel``: embedding, a range of transformer layers, final norm and LM head, at any layout.

- ``GPTModel(config, groups, layer_range=, pre_process=, post_process=)`` builds one pipeline
  stage (or virtual chunk): the layers ``[start, stop)`` of the global stack; the embedding
  when ``pre_process`` (default: ``start == 0``); final norm and head when ``post_process``
  (default: ``stop == num_layers``); ``final_norm=`` moves the final norm off the head's stage
  (a standalone MTP stage, :mod:`~shardwork.models.pipeline.mtp_stage`). A stage that is not
  ``pre_process`` takes ``hidden_states [s(/tp under SP), b, h]`` from the previous stage
  instead of token ids.
- Parameters are created on ``device``; on ``"meta"`` nothing is allocated (a 70B preset for a
  64-GPU layout builds in milliseconds) and :meth:`materialize` allocates and initialises the
  local shards later. Initialisation is layout-independent (see ``sharding.init_from_shards``).
- Forward inputs are this rank's tokens ``[b, s_local]``: with cp > 1 the two load-balanced
  chunks from :func:`~shardwork.models.context_parallel.slice_for_context_parallel`.
  RoPE positions and the attention mask come from global positions. Packed sequences
  (``cu_seqlens``: the whole sequence's document boundaries, batch 1) get a document-causal
  :class:`~shardwork.models.block_mask.BlockMask` and positions restarting per document, at
  any cp (documents may cross cp chunks).
- ``position_embedding_type="learned_absolute"``: the first stage adds the rows of a learned
  position table (:mod:`~shardwork.models.position_embedding`, key
  ``embedding.position_embeddings.weight``) to the word embedding, at the same global
  positions RoPE would use.
- Outputs: hidden states (not ``post_process``), vocab-split logits ``[s, b, V_pad/tp]`` (no
  labels), or ``(loss_sum, num_tokens)`` over this rank's tokens (labels given); see
  :mod:`shardwork.models.loss` for the dp×cp reduction. With labels and
  ``config.fused_linear_cross_entropy`` (the default) the loss comes from
  ``LMHead.token_loss`` and no logits exist; the MTP loss then joins backward through the
  head's input instead of the logits.
- The layers come from a :class:`~shardwork.models.spec.DecoderSpec` (``spec=``; default
  :func:`~shardwork.models.spec.spec_for` of the config): each layer's mixer and MLP are built
  by the kinds registered in :mod:`shardwork.models.layer_kinds`, with no family branch here.
- ``model.token_ids``: the bos/eos/pad ids of the weights
  (:class:`~shardwork.models.token_ids.TokenIds`), set by the Hugging Face bridge.
- The model owns its :class:`~shardwork.models.rng.RNGTracker` (``model.rng_tracker``) and its
  :class:`~shardwork.models.recompute.RecomputeReplay` (``model.recompute_replay``).
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import packed_positions, rotary_cos_sin, rotary_inv_freq
from shardwork.models.attention import AttentionInputs
from shardwork.models.block_mask import build_block_mask
from shardwork.models.config import GPTConfig, check_sequence_length
from shardwork.models.context_parallel import local_positions, slice_for_context_parallel
from shardwork.models.embedding import LMHead, VocabParallelEmbedding
from shardwork.models.id_range import check_token_ids
from shardwork.models.layer_kinds import WHOLE_SEQUENCE_MIXERS, BuildContext, attach_model_state
from shardwork.models.loss import token_loss
from shardwork.models.module import ShardedModule, to_empty_keep_meta
from shardwork.models.mtp import MultiTokenPrediction
from shardwork.models.position_embedding import LearnedPositionEmbedding
from shardwork.models.recompute import RecomputeReplay
from shardwork.models.rng import RNGTracker
from shardwork.models.sharding import init_from_shards
from shardwork.models.spec import DecoderSpec, spec_for
from shardwork.models.token_ids import TokenIds
from shardwork.models.transformer_layer import TransformerBlock, hidden_dropout
from shardwork.moe_router import AuxLossScale, attach_aux_loss
from shardwork.parallel_state import ProcessGroups

__all__ = ["GPTModel"]


def _checked_layer_range(config: GPTConfig, groups: ProcessGroups, layer_range):
    """``(start, stop)`` of the decoder layers a model holds: all of them by default (pp=1)."""
    if layer_range is None:
        if groups.size("pp") > 1:
            raise ValueError(
                f"GPTModel with pp={groups.size('pp')} needs layer_range=(start, stop): "
                "build stages with shardwork.models.pipeline.build_stage"
            )
        return 0, config.num_layers
    start, stop = layer_range
    if not 0 <= start <= stop <= config.num_layers:
        raise ValueError(
            f"layer_range={layer_range} is invalid: need 0 <= start <= stop <= "
            f"num_layers={config.num_layers}"
        )
    return start, stop


class GPTModel(ShardedModule):
    """A decoder (or one pipeline stage of it) built from ``spec``, at the layout of ``groups``."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups | None = None,
        *,
        layer_range: tuple[int, int] | None = None,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        final_norm: bool | None = None,
        device: str | torch.device | None = None,
        spec: DecoderSpec | None = None,
    ) -> None:
        """``final_norm``: whether this stage applies the decoder's final norm after its layers
        (default: ``post_process``; a standalone MTP stage's previous stage applies it, see
        :mod:`shardwork.models.pipeline.mtp_stage`)."""
        groups = ProcessGroups.single() if groups is None else groups
        config.check_layout(groups.config)
        spec = spec_for(config) if spec is None else spec
        spec.check(config)
        start, stop = _checked_layer_range(config, groups, layer_range)
        super().__init__(groups)
        self.config = config
        self.pre_process = start == 0 if pre_process is None else pre_process
        self.post_process = stop == config.num_layers if post_process is None else post_process
        final_norm = self.post_process if final_norm is None else final_norm
        device = torch.device("cpu") if device is None else torch.device(device)
        # A meta build draws nothing: the tracker starts on the CPU and materialize() moves it
        # to the real device.
        rng_device = "cpu" if device.type == "meta" else device
        self.rng_tracker = RNGTracker(
            config.dropout_seed,
            tp_rank=groups.rank("tp"),
            pp_rank=groups.rank("pp"),
            first_layer=start,
            device=rng_device,
        )
        self.recompute_replay = RecomputeReplay()  # first run -> recompute (MoE router state)
        self.spec = spec
        # Tokenizer-facing ids (not math, so not GPTConfig): the HF bridge fills them on import
        # and writes them on export; None for a model built from a config or preset.
        self.token_ids: TokenIds | None = None
        self.aux_loss_tracker = self.aux_loss_scale = None
        attach_model_state(self, config, device)  # e.g. the MoE aux-loss tracker
        ctx = BuildContext(config, groups, self.rng_tracker, device, owner=self)
        self.embedding = (
            VocabParallelEmbedding(config, groups, device=device) if self.pre_process else None
        )
        learned = config.position_embedding_type == "learned_absolute"
        self.position_embeddings = (
            LearnedPositionEmbedding(config, groups, device=device)
            if self.pre_process and learned
            else None
        )
        self.decoder = TransformerBlock(
            config,
            groups,
            layer_range=(start, stop),
            final_norm=spec.final_norm if final_norm else None,
            rng=self.rng_tracker,
            specs=spec.layers,
            ctx=ctx,
            replay=self.recompute_replay,
        )
        if self.post_process:
            # Tied and on the embedding's stage: the head reads the embedding's weight. Otherwise it
            # owns a weight (untied, or the tied copy of a later pipeline stage).
            own = not (config.tie_word_embeddings and self.pre_process)
            self.output_layer = LMHead(config, groups, own_weight=own, device=device)
        else:
            self.output_layer = None
        self.mtp = None
        if spec.mtp and self.post_process:  # multi-token prediction (mtp.py)
            self.mtp = MultiTokenPrediction(
                config,
                groups,
                # Untied on a stage without the embedding: MTP needs its own copy; tied, the head's
                # copy serves.
                own_embedding=not self.pre_process and not config.tie_word_embeddings,
                specs=spec.mtp,
                ctx=ctx,
                device=device,
            )
            self.mtp_loss_scale = AuxLossScale(1.0)
        if device.type != "meta":
            self.init_parameters()

    # ---- parameters ------------------------------------------------------------------------
    def _child_prefix(self, name: str, index: int | None = None) -> str:
        # Megatron's keys: both tables live under "embedding."
        if name in ("embedding", "position_embeddings"):
            return "embedding." + ("word_embeddings" if name == "embedding" else name)
        return name

    @torch.no_grad()
    def init_parameters(self) -> None:
        """(Re)initialise every local parameter from its global key (layout-independent)."""
        cfg = self.config
        for key, param, module in self.named_param_keys():
            init_from_shards(
                param,
                key,
                module.shard_ctx,
                init_seed=cfg.init_seed,
                std=cfg.init_method_std,
                num_layers=cfg.num_layers,
            )
        for module in self.modules():  # buffers such as the MoE expert bias
            reset = getattr(module, "reset_buffers", None)
            if callable(reset):
                reset()

    def materialize(self, device: str | torch.device) -> GPTModel:
        """Allocate a meta-built model's local shards on ``device`` and initialise them."""
        to_empty_keep_meta(self, device)
        self.rng_tracker.to(device)
        self.init_parameters()
        return self

    # ---- forward ---------------------------------------------------------------------------
    def _token_positions(
        self, local_len: int, cu_seqlens: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """Global positions ``[local_len]`` of this rank's tokens (RoPE and learned positions):
        restarting at 0 per packed document, on the cp rank's two load-balanced chunks."""
        g = self.groups
        cp, cp_rank = g.size("cp"), g.rank("cp")
        if cu_seqlens is None:
            return local_positions(local_len, cp_rank=cp_rank, cp_size=cp, device=device)
        positions = packed_positions(cu_seqlens.to(device))
        if positions.numel() != local_len * cp:
            raise ValueError(
                f"cu_seqlens[-1]={positions.numel()} must equal the sequence length "
                f"{local_len * cp} (the whole packed sequence: {local_len} tokens per rank x "
                f"cp={cp})"
            )
        return slice_for_context_parallel(positions, cp_rank=cp_rank, cp_size=cp, dim=0)

    def _attention_inputs(
        self, local_len: int, cu_seqlens: torch.Tensor | None, device: torch.device
    ) -> AttentionInputs:
        """RoPE tables and block masks of this rank's ``local_len`` tokens (``cu_seqlens``: the
        global document boundaries of a packed sequence)."""
        cfg, g = self.config, self.groups
        if cu_seqlens is not None:
            scans = sorted(
                {x.mixer for x in self.spec.layers + self.spec.mtp} & WHOLE_SEQUENCE_MIXERS
            )
            if scans:
                raise ValueError(
                    f"packed sequences (cu_seqlens) are not supported by this model's {scans} "
                    "layers: their scans run each row from a zero state and would carry state "
                    "across documents; pass unpacked batches"
                )
        positions = self._token_positions(local_len, cu_seqlens, device)
        # Causality follows the token's index in the packed row (RoPE positions restart per
        # document); document boundaries and cp chunks cut the block mask's query segments.
        layout = dict(cp_rank=g.rank("cp"), cp_size=g.size("cp"), cu_seqlens=cu_seqlens)
        mask = build_block_mask(local_len, **layout)
        cos, sin = self._rotary_table(positions, cfg.rope_theta, cfg.rope_scaling)
        sliding = None
        if cfg.sliding_window is not None:
            local_cos, local_sin = cos, sin
            if cfg.rope_local_theta is not None:
                # Sliding layers' own (unscaled) RoPE table.
                local_cos, local_sin = self._rotary_table(positions, cfg.rope_local_theta, None)
            sliding_mask = build_block_mask(local_len, window=cfg.sliding_window, **layout)
            sliding = AttentionInputs(cos=local_cos, sin=local_sin, mask=sliding_mask)
        return AttentionInputs(cos=cos, sin=sin, mask=mask, sliding=sliding)

    def _rotary_table(self, positions, theta, scaling):
        """``(cos, sin)`` ``[s, 1, d_rot]`` of the spec's rotary table, None without one."""
        rotary = self.spec.rotary
        if rotary is None:  # no positional table (position_embedding_type="none")
            return None, None
        inv_freq = rotary_inv_freq(rotary.dim, base=theta, scaling=scaling)
        # fp32 angles even for bf16 activations: position·inv_freq needs more mantissa than bf16's 8
        # bits at long positions.
        fp64 = self.config.activation_dtype == torch.float64
        cos, sin = rotary_cos_sin(
            positions,
            inv_freq.to(positions.device),
            scaling=scaling,
            interleaved=rotary.interleaved,
            dtype=torch.float64 if fp64 else torch.float32,
        )
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ):
        """Run this stage.

        Args:
            input_ids: ``[b, s_local]`` token ids (needed when ``pre_process``).
            labels: ``[b, s_local]`` target ids (-100 = ignored); with ``post_process`` the
                result is ``(loss_sum, num_tokens)``.
            loss_mask: ``[b, s_local]`` 0/1 weights of tokens in the loss.
            cu_seqlens: ``[num_docs + 1]`` boundaries of packed documents (batch size 1) over the
                whole sequence (all cp ranks together).
            hidden_states: ``[s_local(/tp under SP), b, h]`` from the previous stage.
        """
        cfg, g = self.config, self.groups
        sp_factor = g.size("tp") if cfg.sequence_parallel else 1
        if self.pre_process:
            if input_ids is None:
                raise ValueError("input_ids is required on the first pipeline stage")
            check_token_ids("input_ids", input_ids, cfg.vocab_size)
            local_len = input_ids.shape[1]
            check_sequence_length(cfg, local_len * g.size("cp"), tp=g.size("tp"), cp=g.size("cp"))
            if cu_seqlens is not None and input_ids.shape[0] != 1:
                raise ValueError(
                    f"packed sequences need batch size 1, got input_ids.shape={tuple(input_ids.shape)}"
                )
            hidden = self.embedding(input_ids)
            if self.position_embeddings is not None:
                positions = self._token_positions(local_len, cu_seqlens, input_ids.device)
                hidden = hidden + self.position_embeddings(positions)
            hidden = hidden.to(cfg.activation_dtype)
            hidden = hidden_dropout(
                hidden,
                cfg.hidden_dropout,
                training=self.training,
                rng=self.rng_tracker,
                sp=cfg.sequence_parallel,
            )
        else:
            if hidden_states is None:
                raise ValueError("hidden_states is required on a stage that is not pre_process")
            hidden = hidden_states
            # Under SP the received hidden states hold s/tp tokens; RoPE and masks need the full
            # local s.
            local_len = hidden.shape[0] * sp_factor
        inputs = self._attention_inputs(local_len, cu_seqlens, hidden.device)
        hidden = self.decoder(hidden, inputs)
        if not self.post_process:
            return hidden
        tied = self.embedding.weight if self.output_layer.linear.weight is None else None
        if labels is None:
            return self.output_layer(hidden, tied)
        # -100: the ignore_index of the head losses below (token_loss, linear_token_loss).
        check_token_ids("labels", labels, cfg.vocab_size, ignore_index=-100)
        head_input = hidden
        if self.mtp is not None:
            # The MTP loss joins backward through the head's input (fused) or logits (unfused);
            # the returned loss is unchanged.
            mtp_loss = self._mtp_loss(hidden, input_ids, labels, loss_mask, cu_seqlens, inputs)
            head_input = attach_aux_loss(hidden, mtp_loss, self.mtp_loss_scale)
        return self._head_loss(head_input, tied, labels, loss_mask)

    def _mtp_loss(self, hidden, input_ids, labels, loss_mask, cu_seqlens, inputs):
        """The MTP depths' loss ``loss_coeff / D · Σ_k loss_sum_k`` (0-d, with gradient)."""
        if input_ids is None:
            raise ValueError("input_ids is required on the last stage of a model with MTP")
        emb = (
            self.embedding.weight if self.embedding is not None else self.output_layer.linear.weight
        )
        tied = self.embedding.weight if self.output_layer.linear.weight is None else None
        return self.mtp(
            hidden,
            input_ids=input_ids,
            labels=labels,
            loss_mask=loss_mask,
            cu_seqlens=cu_seqlens,
            inputs=inputs,
            embedding_weight=emb,
            head=self.output_layer,
            head_weight=tied,
        )

    def _head_loss(self, hidden, tied, labels, loss_mask):
        """``(loss_sum, num_tokens)`` of the main head: fused (no logits) or from the logits."""
        cfg = self.config
        if cfg.fused_linear_cross_entropy:
            return self.output_layer.token_loss(
                hidden,
                labels,
                weight=tied,
                loss_mask=loss_mask,
                grad_in_forward=cfg.head_grads_in_forward,
                backend=cfg.kernel_backend,
            )
        logits = self.output_layer(hidden, tied)
        return token_loss(
            logits,
            labels,
            loss_mask=loss_mask,
            tp_group=self.groups.tp,
            # The logits are this call's own: their storage can take their gradient.
            inplace_backward=True,
            backend=cfg.kernel_backend,
        )
