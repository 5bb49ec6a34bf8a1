"""Apply rotary position embedding to ``x [..., heads, head_dim]``: half-split or interleaved, partial.

- ``cos``/``sin`` are ``[..., rotary_dim]`` tables (see ``rotary_freqs.rotary_cos_sin``)
  broadcastable to ``x.shape[:-2] + (rotary_dim,)``; only the first ``rotary_dim``
  features of each head rotate, the rest pass through (partial rotary).
- Half-split pairing (Llama / HF ``rotate_half``): feature ``i`` pairs with
  ``i + rotary_dim/2``. Interleaved pairing (GPT-J, DeepSeek MLA): ``2k`` with ``2k+1``.
  ``out = x * cos + rotate(x) * sin`` where ``rotate`` negates the first of each pair,
  so any cos/sin table works, not only ``cat(f, f)``.
- Packed sequences: build cos/sin from ``packed_positions(cu_seqlens)``; the op itself
  only needs one table row per token.
- ``inplace=True`` writes the result into ``x`` (safe for the rotation itself: its
  backward needs only cos/sin); refuse on a leaf that requires grad.
- :func:`apply_rotary_qkv`: a fused ``[s, b, (nq + 2·nkv)·d]`` QKV projection split into
  SDPA's ``[b, n, s, d]`` query, key and value, the first two rotated (the same values).
- Gradients flow to ``x`` only (cos/sin are tables) in both backends: the torch backend runs
  :mod:`~shardwork.fused_kernels.eager_rotary` (no concatenation, a hand-written backward,
  the reference's values bit for bit; under ``torch.compile`` the reference itself, which
  inductor fuses); ``apply_rotary_reference`` is the autograd formula tests hold every
  backend to, and it also differentiates cos/sin. No TE backend (see
  ``te_support``).
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import eager_rotary
from shardwork.fused_kernels._checks import acc_dtype, check_float, check_int, check_same_device
from shardwork.fused_kernels.backend import resolve_backend

__all__ = ["apply_rotary", "apply_rotary_qkv", "apply_rotary_reference"]


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        # Interleaved: each pair (a, b) becomes (-b, a), re-interleaved.
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    # Half-split: HF's rotate_half, (x1, x2) -> (-x2, x1).
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Plain-torch rotary embedding in float32, cast to ``x.dtype`` (a new tensor)."""
    rotary_dim = cos.shape[-1]
    xr = x[..., :rotary_dim].to(acc_dtype(x))
    # [..., R] -> [..., 1, R]: the same table row for every head.
    c, s = cos.unsqueeze(-2).to(xr.dtype), sin.unsqueeze(-2).to(xr.dtype)
    out = (xr * c + _rotate(xr, interleaved) * s).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


def _validate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool) -> None:
    check_float("x", x)
    check_float("cos", cos)
    check_float("sin", sin)
    if x.dim() < 3:
        raise ValueError(
            f"x.shape={tuple(x.shape)} must be [..., heads, head_dim] with >= 1 leading dim"
        )
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"cos.shape={tuple(cos.shape)} must equal sin.shape={tuple(sin.shape)}")
    rotary_dim = cos.shape[-1] if cos.dim() else 0
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(
            f"cos.shape[-1]={rotary_dim} (rotary_dim) must be even, > 0 and <= head_dim={x.shape[-1]}"
        )
    lead = tuple(x.shape[:-2])
    try:
        shape = torch.broadcast_shapes(tuple(cos.shape[:-1]), lead)
    except RuntimeError:
        shape = None
    if shape != lead:
        raise ValueError(
            f"cos.shape={tuple(cos.shape)} must broadcast to x.shape[:-2] + (rotary_dim,) = "
            f"{(*lead, rotary_dim)}"
        )
    if inplace and x.is_leaf and x.requires_grad:
        raise ValueError("inplace=True on a leaf tensor that requires grad; use inplace=False")
    check_same_device(x=x, cos=cos, sin=sin)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    inplace: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` features of every head of ``x [..., heads, head_dim]``.

    Returns a new tensor, or ``x`` itself (modified) when ``inplace=True``.
    """
    _validate(x, cos, sin, inplace)
    chosen = resolve_backend("rotary", backend, x.device, dtype=x.dtype)
    if chosen == "triton":
        from shardwork.fused_kernels import triton_rotary

        return triton_rotary.rotary(x, cos, sin, interleaved=interleaved, inplace=inplace)
    if torch.compiler.is_compiling():
        # Traced: the plain formula, which inductor fuses (the eager function's out= views
        # into one buffer would break the graph).
        out = apply_rotary_reference(x, cos, sin, interleaved=interleaved)
    else:
        out = eager_rotary.rotary(x, cos, sin, interleaved=interleaved)
    if inplace:
        x.copy_(out)
        return x
    return out


def _qkv_head_dim(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> int:
    """``d`` of a fused ``[s, b, (nq + 2·nkv)·d]`` projection, or a ValueError naming the field."""
    check_float("qkv", qkv)
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        check_int(name, count)
        if count < 1:
            raise ValueError(f"{name}={count!r} must be a positive int")
    heads = num_heads + 2 * num_kv_heads
    if qkv.dim() != 3 or qkv.shape[-1] % heads:
        raise ValueError(
            f"qkv.shape={tuple(qkv.shape)} must be [s, b, (num_heads + 2*num_kv_heads) * "
            f"head_dim] = [s, b, {heads} * head_dim]"
        )
    return qkv.shape[-1] // heads


def apply_rotary_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    interleaved: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused QKV projection into attention's inputs, queries and keys rotated.

    ``qkv [s, b, (nq + 2·nkv)·d]``: sequence-first, ``[Q | K | V]`` blocks of whole heads (a
    column-parallel shard of them). ``cos``/``sin`` broadcast to ``[s, b, rotary_dim]``.
    Returns ``q [b, nq, s, d]``, ``k [b, nkv, s, d]``, ``v [b, nkv, s, d]``: the layout of
    ``F.scaled_dot_product_attention``. Values and gradients equal ``apply_rotary`` on the
    split heads, then permuted, bit for bit. q, k and v are new tensors on every backend, so
    nothing keeps ``qkv`` alive for backward (a view of v would). The torch backend writes
    queries and keys in one rotation into batch-first memory and v beside them, and its
    backward writes the fused gradient block by block instead of concatenating three; Triton
    and ``torch.compile`` rotate q and k separately and copy v.
    """
    d = _qkv_head_dim(qkv, num_heads, num_kv_heads)
    heads = qkv.unflatten(-1, (num_heads + 2 * num_kv_heads, d))
    q, k, v = heads.split((num_heads, num_kv_heads, num_kv_heads), dim=2)
    _validate(q, cos, sin, inplace=False)
    chosen = resolve_backend("rotary", backend, qkv.device, dtype=qkv.dtype)
    if chosen == "torch" and not torch.compiler.is_compiling():
        return eager_rotary.rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads,
                                       interleaved=interleaved)  # fmt: skip
    q = apply_rotary(q, cos, sin, interleaved=interleaved, backend=chosen)
    k = apply_rotary(k, cos, sin, interleaved=interleaved, backend=chosen)
    # A copy of v, as the eager path makes: a view would keep all of qkv alive for backward.
    v = v.contiguous()
    return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
