"""Megatron-Core checkpoint -> shardwork weights: a full state dict, a model, or a folder.

- :func:`megatron_state_dict` reads the folder (:mod:`.reader`), checks Megatron-LM's
  ``args`` against the user's :class:`~shardwork.models.config.GPTConfig` when ``common.pt``
  holds them (:mod:`.config_check`), maps names and fused layouts (:mod:`.keys`) and checks
  every tensor against the keys and global shapes a model of that config has: ``{shardwork
  key: full tensor}``.
- :func:`load_megatron_weights` copies each rank's slices into a model (stage) at any layout.
- :func:`import_megatron` writes a shardwork dist-checkpoint folder (global coordinates, so it
  loads at any TP/PP/EP layout), built at world 1.

Megatron-LM pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` (128) times
TP; shardwork's checkpoints hold the real rows only, so extra embedding/output rows are dropped
when they look like that padding (a multiple of 128 rows, fewer than 1024 = 128 x TP 8 extra);
any other row count is a shape mismatch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwork.dist_checkpoint import save
from shardwork.models.config import GPTConfig
from shardwork.models.gpt_model import GPTModel
from shardwork.models.megatron.config_check import check_against_args
from shardwork.models.megatron.keys import megatron_to_shardwork
from shardwork.models.megatron.reader import read_megatron_args, read_megatron_tensors
from shardwork.models.module import to_empty_keep_meta
from shardwork.models.moe.state import moe_routers

__all__ = [
    "check_megatron_checkpoint",
    "import_megatron",
    "load_megatron_weights",
    "megatron_state_dict",
]

_PAD_MULTIPLE = 128  # Megatron-LM's default --make-vocab-size-divisible-by
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Global shapes of every key of a world-1 model of ``config`` (built on meta: no memory).

    Sequence parallelism changes no shape and needs tp > 1, so the world-1 model is built
    without it (a TP=2+SP model's config imports like any other)."""
    model = GPTModel(config.replace(sequence_parallel=False), device="meta")
    return {k: tuple(st.global_shape) for k, st in model.sharded_state_dict().items()}


def _is_vocab_padding(tensor: torch.Tensor, vocab: int) -> bool:
    rows = tensor.shape[0]
    return rows > vocab and rows % _PAD_MULTIPLE == 0 and rows - vocab < _PAD_MULTIPLE * 8


def _routing_hint(keys: list[str]) -> str:
    """The router option a routing buffer among ``keys`` points to, as a hint's tail."""
    if any(k.endswith("router.qb_beta") for k in keys):
        return "; qb_beta is saved by quantile-balancing routers: moe.router.load_balancing_type"
    if any(k.endswith("router.expert_bias") for k in keys):
        return "; expert_bias is saved by routers with moe.router.enable_expert_bias"
    return ""


def _check(state: dict, unknown: list[str], expected: dict, source: str) -> dict:
    if unknown:
        raise ValueError(
            f"{source}: Megatron tensors with no shardwork counterpart: {sorted(unknown)[:8]} "
            "(shared experts, MLA, MTP and biases other than QKV's are not imported)"
        )
    for key in _VOCAB_KEYS:
        if key in state and key in expected and _is_vocab_padding(state[key], expected[key][0]):
            state[key] = state[key][: expected[key][0]]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(
            f"{source}: missing keys for this config: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} (check num_layers, moe, qk_layernorm, "
            f"tie_word_embeddings against the checkpoint{_routing_hint(missing)})"
        )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ValueError(
            f"{source}: the checkpoint has tensors this config does not: {extra[:8]} (check "
            f"num_layers, moe and tie_word_embeddings{_routing_hint(extra)})"
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(
                f"{source}: {key!r} has shape {tuple(state[key].shape)} in the checkpoint, but "
                f"the config gives {shape} (check hidden_size, ffn_hidden_size, heads, "
                "num_query_groups, vocab_size)"
            )
    return state


def check_megatron_checkpoint(folder: str | Path, config: GPTConfig) -> None:
    """Every check of :func:`megatron_state_dict` (folder, args, keys, shapes) from the
    checkpoint's index alone: no weight is read (for validating a run's config)."""
    megatron_state_dict(folder, config, meta=True)


def megatron_state_dict(
    folder: str | Path, config: GPTConfig, *, meta: bool = False
) -> dict[str, torch.Tensor]:
    """``{shardwork key: full tensor}`` of the Megatron checkpoint ``folder`` for ``config``
    (meta-device tensors with ``meta=True``)."""
    source = f"Megatron checkpoint {str(folder)!r}"
    tensors = read_megatron_tensors(folder, meta=meta)
    args = read_megatron_args(folder)
    if args is not None:
        check_against_args(config, args, source)
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.head_dim or config.hidden_size // heads
    state, unknown = megatron_to_shardwork(
        tensors, heads=heads, groups=groups, head_dim=head_dim, hidden=config.hidden_size
    )
    return _check(state, unknown, _expected_shapes(config), source)


@torch.no_grad()
def load_megatron_weights(model: GPTModel, folder: str | Path) -> GPTModel:
    """Copy this rank's slices of the Megatron checkpoint ``folder`` into ``model`` (in place)."""
    state = megatron_state_dict(folder, model.config)
    for key, st in model.sharded_state_dict().items():
        index = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.data.shape))
        st.data.copy_(state[key][index].to(st.data.dtype))
    for router in moe_routers(model):  # step counters are not in checkpoints (meta builds)
        router.reset_step_state()
    return model


def import_megatron(src: str | Path, dst: str | Path, config: GPTConfig) -> dict[str, int]:
    """Write the Megatron checkpoint ``src`` as a shardwork dist-checkpoint folder ``dst``.

    One process, no process group: the model is built at world 1 and saved in global
    coordinates. Returns ``{"tensors": n, "parameters": numel}``.
    """
    state = megatron_state_dict(src, config)  # every error before anything is written
    model = GPTModel(config.replace(sequence_parallel=False), device="meta")  # world 1
    to_empty_keep_meta(model, "cpu")
    with torch.no_grad():
        for key, st in model.sharded_state_dict().items():
            st.data.copy_(state[key].to(st.data.dtype))
    save(
        model.sharded_state_dict(),
        dst,
        layout={"tp": 1, "pp": 1, "ep": 1},
        metadata={"imported_from": "megatron-core torch_dist", "source": str(src)},
    )
    return {"tensors": len(state), "parameters": sum(t.numel() for t in state.values())}
