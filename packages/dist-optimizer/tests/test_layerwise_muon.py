"""Layer-wise distributed Muon equals single-process Muon (DP=2, and DP=2 x TP=2 with a
fused [gate | up] weight split over TP, and with a fused GQA [Q | K | V] weight against
separate Q, K, V matrices or separate heads); Newton–Schulz and owner assignment unit tests."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shardwork.dist_optimizer import (
    DDPConfig,
    DistributedDataParallel,
    LayerWiseDistributedOptimizer,
    Muon,
    OptimizerConfig,
)
from shardwork.dist_optimizer.muon import newton_schulz, orthogonalize
from shardwork.parallel_state import (
    ParallelConfig,
    ParamMeta,
    copy_to_tp_region,
    gather_from_tp_region,
    init_process_groups,
    set_param_meta,
)
from shardwork.parallel_state.testing import run_on_ranks

IN, HID, FF, BATCH, STEPS = 6, 8, 4, 3, 3


class GatedMLP(nn.Module):
    """x -> tanh(W1 x + b1) -> [gate | up] = W2 h (column-parallel over TP) -> silu(gate)*up."""

    def __init__(self, tp_group=None, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(HID, IN) / IN**0.5)
        self.b1 = nn.Parameter(torch.randn(HID) * 0.1)
        w2 = torch.randn(2 * FF, HID) / HID**0.5
        gate, up = w2.split(FF)
        local = FF // tp_size
        rows = slice(tp_rank * local, (tp_rank + 1) * local)
        self.w2 = nn.Parameter(torch.cat([gate[rows], up[rows]]))
        set_param_meta(self.w2, ParamMeta(tp_axis=0, tp_partition_sizes=(FF, FF)))
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w1.T + self.b1)
        h = copy_to_tp_region(h, self.tp_group)
        gate, up = (h @ self.w2.T).chunk(2, dim=-1)
        return gather_from_tp_region(nn.functional.silu(gate) * up, self.tp_group)


def data(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(STEPS, dp * BATCH, IN, generator=g), torch.randn(
        STEPS, dp * BATCH, FF, generator=g
    )


def muon(groups, tp_group=None):
    return Muon(groups, lr=0.05, momentum=0.9, weight_decay=0.01, tp_group=tp_group)


def reference(dp: int, clip: float) -> tuple[list[torch.Tensor], list[float]]:
    """Parameters after STEPS plain Muon steps, and each step's full-gradient norm."""
    model = GatedMLP()
    opt = muon(model.parameters())
    x, y = data(dp)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip if clip else 1e30)))
        opt.step()
    return [p.detach() for p in model.parameters()], norms


def _run_layerwise(tp: int, clip: float, overlap: bool):
    pg = init_process_groups(ParallelConfig(tp=tp))
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = GatedMLP(pg.tp, tp, pg.rank("tp"))
    ddp = DistributedDataParallel(model, config=DDPConfig(bucket_size=20), process_groups=pg)
    opt = LayerWiseDistributedOptimizer(
        ddp,
        lambda groups: muon(groups, pg.tp),
        config=OptimizerConfig(clip_grad=clip, overlap_param_gather=overlap),
        process_groups=pg,
    )
    x, y = data(dp)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[s, local]), y[s, local]).backward()
        result = opt.step()
        assert result.update_successful
        norms.append(result.grad_norm)
    opt.finish_param_sync()
    params = [p.detach().clone() for p in model.parameters()]
    return params, norms, pg.rank("tp"), len(opt.owned)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("tp", "world", "clip", "overlap"), [(1, 2, 0.0, True), (2, 4, 0.0, False), (2, 4, 0.5, True)]
)
def test_layerwise_muon_matches_single_process(tp, world, clip, overlap):
    results = run_on_ranks(_run_layerwise, world, args=(tp, clip, overlap))
    (w1, b1, w2), ref_norms = reference(world // tp, clip)
    gate, up = w2.split(FF)
    local = FF // tp
    for params, norms, tp_rank, _ in results:
        # the norm of the full (unsplit, all-data) gradient: TP replicas of w1/b1 counted once
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        rows = slice(tp_rank * local, (tp_rank + 1) * local)
        torch.testing.assert_close(params[0], w1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params[1], b1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            params[2], torch.cat([gate[rows], up[rows]]), rtol=1e-5, atol=1e-6
        )
    # every data-parallel rank owns something, each parameter exactly once per TP rank
    assert sum(n for *_, n in results) == 3 * tp


def test_newton_schulz_orthogonalises():
    g = torch.randn(12, 20, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.6 and s.max() < 1.25  # NS5 pushes all singular values into ~[0.7, 1.2]
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity(
        newton_schulz(g).flatten(), (u @ vh).flatten(), dim=0
    )
    assert cos > 0.98


def test_orthogonalize_splits_fused_blocks():
    g = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    meta = ParamMeta(tp_axis=0, tp_partition_sizes=(4, 6))
    got = orthogonalize(g, meta)
    want = torch.cat([newton_schulz(g[:4]), newton_schulz(g[4:]) * (6 / 6) ** 0.5])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, orthogonalize(g, ParamMeta()))


def test_assign_owners_balances_by_size():
    owners = LayerWiseDistributedOptimizer.assign_owners([100, 60, 50, 40, 10], 2)
    load = [sum(n for n, o in zip([100, 60, 50, 40, 10], owners) if o == r) for r in range(2)]
    assert owners[0] == 0 and sorted(load) == [120, 140]


def test_orthogonalize_per_head():
    g = torch.randn(12, 5, generator=torch.Generator().manual_seed(2))
    meta = ParamMeta(tp_axis=0, tp_partition_sizes=(8, 4))  # [Q (2 heads) | K (1 head)]
    got = orthogonalize(g, meta, head_dim=4)
    want = torch.cat([newton_schulz(h) for h in g.split(4)])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="head_dim"):
        orthogonalize(g, meta, head_dim=3)
    # as a param-group option of the optimizer
    p = torch.nn.Parameter(torch.randn(12, 5))
    set_param_meta(p, meta)
    q = torch.nn.Parameter(p.detach().clone())
    set_param_meta(q, meta)
    for param, head_dim in ((p, 4), (q, None)):
        opt = Muon(
            [{"params": [param], "head_dim": head_dim}], lr=0.1, momentum=0.0, nesterov=False
        )
        param.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), q.detach() + 0.1 * orthogonalize(g, meta) - 0.1 * want)


# ---------------------------------------------------------------- fused GQA QKV over TP=2
NQ, NKV, D = 4, 2, 2  # query heads, key/value heads, head dim
QKV_SIZES = (NQ * D, NKV * D, NKV * D)


def mix_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A per-head function of q, k, v (GQA: each k/v head serves NQ/NKV query heads)."""
    b, nq, nkv = q.shape[0], q.shape[1] // D, k.shape[1] // D
    q = q.view(b, nq, D)
    k = k.view(b, nkv, D).repeat_interleave(nq // nkv, dim=1)
    v = v.view(b, nkv, D).repeat_interleave(nq // nkv, dim=1)
    return (torch.tanh(q) * k + v * q).reshape(b, nq * D)


def qkv_init() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(5)
    return torch.randn(HID, IN) / IN**0.5, torch.randn(sum(QKV_SIZES), HID) / HID**0.5


class FusedQKV(nn.Module):
    """tanh(W_in x) -> column-parallel fused [Q | K | V] (whole heads per TP rank) -> heads."""

    def __init__(self, tp_group=None, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        w_in, w_qkv = qkv_init()
        self.w_in = nn.Parameter(w_in)
        blocks = [b.chunk(tp_size)[tp_rank] for b in w_qkv.split(QKV_SIZES)]
        self.w_qkv = nn.Parameter(torch.cat(blocks))
        set_param_meta(self.w_qkv, ParamMeta(tp_axis=0, tp_partition_sizes=QKV_SIZES))
        self.local_sizes = [b.size(0) for b in blocks]
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = copy_to_tp_region(torch.tanh(x @ self.w_in.T), self.tp_group)
        q, k, v = (h @ self.w_qkv.T).split(self.local_sizes, dim=-1)
        return gather_from_tp_region(mix_heads(q, k, v), self.tp_group)


class SeparateQKV(nn.Module):
    """The same function with the QKV rows as separate plain matrices (no ParamMeta):
    ``pieces`` row counts, e.g. Q, K, V blocks or one matrix per head."""

    def __init__(self, pieces: list[int]) -> None:
        super().__init__()
        w_in, w_qkv = qkv_init()
        self.w_in = nn.Parameter(w_in)
        self.pieces = nn.ParameterList(nn.Parameter(w) for w in w_qkv.split(pieces))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w_in.T)
        qkv = torch.cat([h @ w.T for w in self.pieces], dim=-1)
        return mix_heads(*qkv.split(QKV_SIZES, dim=-1))


def qkv_data(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.randn(STEPS, dp * BATCH, IN, generator=g), torch.randn(
        STEPS, dp * BATCH, NQ * D, generator=g
    )


def separate_qkv_reference(per_head: bool, dp: int) -> tuple[torch.Tensor, list[float]]:
    """Plain single-process Muon on separate matrices; returns the full [Q | K | V] rows."""
    pieces = [D] * (sum(QKV_SIZES) // D) if per_head else list(QKV_SIZES)
    model = SeparateQKV(pieces)
    opt = muon(model.parameters())
    x, y = qkv_data(dp)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1e30)))
        opt.step()
    return torch.cat([w.detach() for w in model.pieces]), norms


def _run_fused_qkv():
    pg = init_process_groups(ParallelConfig(tp=2))
    dp, rank, tp_rank = pg.size("dp"), pg.rank("dp"), pg.rank("tp")
    x, y = qkv_data(dp)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    out = {}
    for per_head in (False, True):
        model = FusedQKV(pg.tp, 2, tp_rank)
        ddp = DistributedDataParallel(model, config=DDPConfig(bucket_size=20), process_groups=pg)
        qkv_group = {"fused_blocks": 3, **({"head_dim": D} if per_head else {})}
        opt = LayerWiseDistributedOptimizer(
            ddp,
            lambda groups: muon(groups, pg.tp),
            config=OptimizerConfig(overlap_param_gather=True),
            process_groups=pg,
            param_group_fn=lambda name, p, g=qkv_group: g if name == "w_qkv" else None,
        )
        norms = []
        for s in range(STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[s, local]), y[s, local]).backward()
            norms.append(opt.step().grad_norm)
        opt.finish_param_sync()
        out[per_head] = (model.w_qkv.detach().clone(), norms)
    return tp_rank, out


@pytest.mark.multirank
def test_fused_qkv_over_tp_equals_separate_matrices():
    """TP=2 x DP=2: the fused, TP-split GQA weight gets exactly the update of plain Muon on
    separate Q, K, V matrices (default) or on separate heads (``head_dim``)."""
    refs = {per_head: separate_qkv_reference(per_head, 2) for per_head in (False, True)}
    assert not torch.allclose(refs[False][0], refs[True][0], atol=1e-3)  # the two differ
    for tp_rank, out in run_on_ranks(_run_fused_qkv, 4):
        for per_head, (w_qkv, norms) in out.items():
            full, ref_norms = refs[per_head]
            want = torch.cat([b.chunk(2)[tp_rank] for b in full.split(QKV_SIZES)])
            torch.testing.assert_close(w_qkv, want, rtol=1e-5, atol=1e-6)
            assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_fused_blocks_option_checks_the_layout():
    fused = torch.nn.Parameter(torch.randn(sum(QKV_SIZES), HID))
    set_param_meta(fused, ParamMeta(tp_axis=0, tp_partition_sizes=QKV_SIZES))
    Muon([{"params": [fused], "fused_blocks": 3}])
    with pytest.raises(
        ValueError, match=r"fused_blocks=2: parameter 0 .*tp_partition_sizes=\(8, 4, 4\)"
    ):
        Muon([{"params": [fused], "fused_blocks": 2}])
    with pytest.raises(ValueError, match="tp_partition_sizes=None"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "fused_blocks": 3}])
    with pytest.raises(ValueError, match="head_dim"):
        Muon([fused], head_dim=0)


def test_muon_param_group_mistakes_raise_at_construction():
    """head_dim that does not divide a block, or use_muon=True on a 1-D parameter, used to
    construct fine and fail only at the first step()."""
    rows6 = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Muon.param_groups[0]['head_dim']=4 does not divide a block of 6 rows of parameter "
            "0 of the group (shape (6, 4))"
        ),
    ):
        Muon([{"params": [rows6], "head_dim": 4}])
    bias = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(
        ValueError,
        match=re.escape("Muon.param_groups[1]['use_muon']=True but parameter 1 of the group has "),
    ):
        matrix = torch.nn.Parameter(torch.randn(2, 2))
        Muon([{"params": [rows6]}, {"params": [matrix, bias], "use_muon": True}])
    # a refused group added later is not kept; valid groups still work and step
    opt = Muon([{"params": [rows6], "head_dim": 3}], lr=0.1)
    with pytest.raises(ValueError, match=re.escape("Muon.param_groups[1]['use_muon']=True")):
        opt.add_param_group({"params": [bias], "use_muon": True})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [bias], "head_dim": 4})  # AdamW parameter: head_dim unused
    rows6.grad, bias.grad = torch.randn(6, 4), torch.randn(4)
    opt.step()


def _muon_head_dim_over_tp():
    """TP=2: each rank holds half of every block of a fused [8 | 4 | 4]-row weight."""
    pg = init_process_groups(ParallelConfig(tp=2))
    local = torch.nn.Parameter(torch.randn(8, 3))
    set_param_meta(local, ParamMeta(tp_axis=0, tp_partition_sizes=(8, 4, 4)))
    Muon([{"params": [local], "head_dim": 4}], tp_group=pg.tp)  # local blocks 4, 2, 2
    try:
        Muon([{"params": [local], "head_dim": 8}], tp_group=pg.tp)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.multirank
def test_muon_head_dim_is_checked_against_the_full_tp_blocks():
    """The step orthogonalises the TP-gathered matrix, so head_dim must divide its blocks
    (4 divides 8, 4, 4 though not the local 2), not the local slices."""
    for error in run_on_ranks(_muon_head_dim_over_tp, 2, timeout=60):
        assert error is not None and "['head_dim']=8 does not divide a block of 4 rows" in error
