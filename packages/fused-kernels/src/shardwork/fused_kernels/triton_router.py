"""Triton MoE router: score function, (group-limited, biased) top-k and aux statistics in one pass.

- A program holds ``BLOCK_T`` tokens × all experts (``BLOCK_E`` = next power of two
  >= E) in registers, float32. Top-k is ``k`` rounds of row argmax (lowest index
  wins a tie) with the winner masked to -inf; group-limited routing first scores each
  group by the sum of its top ``k // group_topk`` selection scores (constexpr loops
  over groups), keeps the ``group_topk`` best groups and masks the others.
- Outputs: dense probs (logits dtype), routing map (bool), aux scores (float32) and
  aux-loss token counts via one integer ``atomic_add`` per expert per program.
- Backward (one kernel): ``d logits`` from the prob gradient (softmax-over-selected,
  pre-softmax, or sigmoid / sqrt-softplus with optional renormalisation) plus the
  aux-score gradient (softmax, or normalised element-wise scores). The expert bias gets no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwork.fused_kernels.router_output import RouterTopK
from shardwork.fused_kernels.triton_launch import launch, next_pow2

__all__ = ["router_topk"]

_SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _take_max(sel, cols, BLOCK: tl.constexpr):
    """Row max of ``sel`` and a one-hot of its (lowest-index) position."""
    mv = tl.max(sel, axis=1)
    idx = tl.min(tl.where(sel == mv[:, None], cols[None, :], BLOCK), axis=1)
    return mv, cols[None, :] == idx[:, None]


@triton.jit
def _score(x, SCORE: tl.constexpr):
    """Element-wise score (1: sigmoid, 2: sqrt(softplus)) and its derivative, float32."""
    if SCORE == 1:
        s = tl.sigmoid(x)
        return s, s * (1.0 - s)
    else:
        # softplus as max(x, 0) + log(1 + exp(-|x|)): exp never overflows for large |x|.
        sp = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
        s = tl.sqrt(sp)
        return s, tl.sigmoid(x) / (2.0 * tl.maximum(s, 1e-30))  # s = 0 only in padded lanes


@triton.jit
def _router_fwd(L, BIAS, PROBS, MAP, AUX, COUNTS, N, E, scaling, TOPK: tl.constexpr,
                SCORE: tl.constexpr, PRE_SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                NORMALIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < N
    cmask = cols < E
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    x = tl.load(L + offs, mask=mask, other=0.0).to(tl.float32)
    # Padded experts at -inf: never selected, and exp(-inf) = 0 in the softmax.
    x = tl.where(cmask[None, :], x, float("-inf"))
    if SCORE > 0:
        sc, _ = _score(x, SCORE)
        sc = tl.where(cmask[None, :], sc, 0.0)
        # +1e-20 as Megatron-Core and the torch path: no 0/0 when every score underflows.
        aux = sc / (tl.sum(sc, axis=1)[:, None] + 1e-20)
        sel = sc
        if HAS_BIAS:
            sel = sc + tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    else:
        # Shift by the row max before exp (stable softmax).
        ex = tl.where(cmask[None, :], tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
        sc = ex / tl.sum(ex, axis=1)[:, None]
        aux = sc
        if PRE_SOFTMAX:
            sel = sc
        else:
            sel = x
    sel = tl.where(mask, sel, float("-inf"))
    if GROUP_TOPK > 0:
        # The experts of one group are contiguous.
        gid = cols // (E // NUM_GROUPS)
        gcols = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            tmp = tl.where((gid == g)[None, :], sel, float("-inf"))
            acc = tl.zeros([BLOCK_T], dtype=tl.float32)
            # A group's score: the sum of its best TOPK // GROUP_TOPK selection scores
            # (DeepSeek-V3).
            for _ in tl.static_range(TOPK // GROUP_TOPK):
                mv, hit = _take_max(tmp, cols, BLOCK_E)
                acc += mv
                tmp = tl.where(hit, float("-inf"), tmp)
            gscore = tl.where((gcols == g)[None, :], acc[:, None], gscore)
        gkeep = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(GROUP_TOPK):
            _, ghit = _take_max(gscore, gcols, BLOCK_G)
            gkeep = tl.where(ghit, 1, gkeep)
            gscore = tl.where(ghit, float("-inf"), gscore)
        allowed = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        for g in tl.static_range(NUM_GROUPS):
            keep_g = tl.sum(tl.where((gcols == g)[None, :], gkeep, 0), axis=1)
            allowed = tl.where((gid == g)[None, :] & (keep_g > 0)[:, None], 1, allowed)
        sel = tl.where(allowed > 0, sel, float("-inf"))
    chosen = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for _ in tl.static_range(TOPK):
        _, hit = _take_max(sel, cols, BLOCK_E)
        chosen = tl.where(hit, 1, chosen)
        sel = tl.where(hit, float("-inf"), sel)
    picked = chosen > 0
    if SCORE > 0 or PRE_SOFTMAX:
        p = tl.where(picked, sc, 0.0)
    # Post-softmax: softmax over the chosen logits = their exp shifted by the row max, renormalised
    # (the shift cancels).
    else:
        p = tl.where(picked, ex, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
    if NORMALIZE:
        p = p / (tl.sum(p, axis=1)[:, None] + 1e-20)
    p = p * scaling
    tl.store(PROBS + offs, p.to(PROBS.dtype.element_ty), mask=mask)
    tl.store(MAP + offs, chosen.to(tl.int8), mask=mask)
    tl.store(AUX + offs, aux, mask=mask)
    # Aux-loss counts: a plain top-k of the aux scores (no groups, no bias), as the torch path.
    a = tl.where(mask, aux, float("-inf"))
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for _ in tl.static_range(TOPK):
        _, hit = _take_max(a, cols, BLOCK_E)
        counts += tl.sum(tl.where(hit & rmask[:, None], 1, 0), axis=0)
        a = tl.where(hit, float("-inf"), a)
    # Integer adds are exact, so the totals do not depend on the programs' order.
    tl.atomic_add(COUNTS + cols, counts, mask=cmask)


@triton.jit
def _router_bwd(L, MAP, GP, GA, DX, N, E, scaling, SCORE: tl.constexpr, PRE_SOFTMAX: tl.constexpr,
                NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    mask = (rows < N)[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    x = tl.load(L + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, float("-inf"))
    picked = tl.load(MAP + offs, mask=mask, other=0) != 0
    # Only the chosen experts' prob gradients reach the logits.
    gp = tl.where(picked, tl.load(GP + offs, mask=mask, other=0.0).to(tl.float32) * scaling, 0.0)
    ga = tl.load(GA + offs, mask=mask, other=0.0).to(tl.float32)
    if SCORE > 0:
        sc, dsc = _score(x, SCORE)
        sc = tl.where(cmask[None, :], sc, 0.0)
        if NORMALIZE:
            v = tl.where(picked, sc, 0.0)
            den = tl.sum(v, axis=1)[:, None] + 1e-20
            # Gradient of v / (sum v + eps): (g - sum(g v) / den) / den.
            dv = (gp - tl.sum(gp * v, axis=1)[:, None] / den) / den
        else:
            dv = gp
        dv = tl.where(picked, dv, 0.0)
        aden = tl.sum(sc, axis=1)[:, None] + 1e-20
        # The aux scores' gradient through their row normalisation, added to the probs'.
        ds = dv + (ga - tl.sum(ga * sc, axis=1)[:, None] / aden) / aden
        dx = tl.where(cmask[None, :], ds * dsc, 0.0)
    else:
        ex = tl.where(cmask[None, :], tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
        sm = ex / tl.sum(ex, axis=1)[:, None]
        if PRE_SOFTMAX:
            if NORMALIZE:
                v = tl.where(picked, sm, 0.0)
                den = tl.sum(v, axis=1)[:, None] + 1e-20
                dv = (gp - tl.sum(gp * v, axis=1)[:, None] / den) / den
            else:
                dv = gp
            dsm = tl.where(picked, dv, 0.0) + ga
            # Softmax Jacobian: sm * (g - sum(g * sm)).
            dx = sm * (dsm - tl.sum(dsm * sm, axis=1)[:, None])
        else:
            ps = tl.where(picked, ex, 0.0)
            ps = ps / tl.maximum(tl.sum(ps, axis=1), 1e-30)[:, None]  # padded rows pick nothing
            dx = tl.where(picked, ps * (gp - tl.sum(gp * ps, axis=1)[:, None]), 0.0)
            dx += sm * (ga - tl.sum(ga * sm, axis=1)[:, None])
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


def _block_t(block_e: int) -> int:
    return max(1, min(16, 4096 // block_e))


class _Router(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits,
        expert_bias,
        topk,
        score,
        pre_softmax,
        num_groups,
        group_topk,
        scaling,
        normalize,
    ):
        x = logits.contiguous()
        n, e = x.shape
        probs = torch.empty_like(x)
        routing = torch.empty(n, e, dtype=torch.int8, device=x.device)
        aux = torch.empty(n, e, dtype=torch.float32, device=x.device)
        counts = torch.zeros(e, dtype=torch.int32, device=x.device)
        block_e = next_pow2(e)
        block_t = _block_t(block_e)
        launch("router_topk_fwd", _router_fwd, (triton.cdiv(n, block_t),), x,
               # No bias: x fills the pointer slot; with HAS_BIAS=False the kernel never reads it.
               x if expert_bias is None else expert_bias.contiguous(), probs, routing, aux, counts, n, e,
               scaling, TOPK=topk, SCORE=score, PRE_SOFTMAX=pre_softmax,
               HAS_BIAS=expert_bias is not None, NORMALIZE=normalize, NUM_GROUPS=num_groups or 1,
               GROUP_TOPK=group_topk or 0, BLOCK_T=block_t, BLOCK_E=block_e,
               BLOCK_G=next_pow2(num_groups or 1))  # fmt: skip
        # int8 0/1 viewed as bool: same size, no copy.
        routing_map = routing.view(torch.bool)
        ctx.save_for_backward(x, routing)
        ctx.cfg = (score, pre_softmax, normalize, scaling)
        ctx.mark_non_differentiable(routing_map, counts)
        return probs, routing_map, aux, counts

    @staticmethod
    def backward(ctx, grad_probs, _grad_map, grad_aux, _grad_counts):
        x, routing = ctx.saved_tensors
        score, pre_softmax, normalize, scaling = ctx.cfg
        n, e = x.shape
        dx = torch.empty_like(x)
        block_e = next_pow2(e)
        block_t = _block_t(block_e)
        launch("router_topk_bwd", _router_bwd, (triton.cdiv(n, block_t),), x, routing,
               grad_probs.contiguous(), grad_aux.contiguous(), dx, n, e, scaling, SCORE=score,
               PRE_SOFTMAX=pre_softmax, NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e)  # fmt: skip
        return dx, None, None, None, None, None, None, None, None


def router_topk(logits, *, topk, score_function, pre_softmax, num_groups, group_topk, expert_bias,
                scaling_factor, normalize) -> RouterTopK:  # fmt: skip
    """Router top-k through the Triton kernels (arguments validated by ``router.router_topk``)."""
    probs, routing_map, aux, counts = _Router.apply(
        logits, expert_bias, topk, _SCORES[score_function], bool(pre_softmax), num_groups,
        group_topk, float(scaling_factor or 1.0), bool(normalize),
    )  # fmt: skip
    return RouterTopK(probs, routing_map, aux, counts.to(torch.int64))
