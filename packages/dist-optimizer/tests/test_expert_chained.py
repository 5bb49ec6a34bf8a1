"""Dense + expert ChainedOptimizer equals the single-process run: expert gradients summed over
edp and scaled by 1/(dp·cp); a pipeline stage without experts still joins the statistics."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwork.dist_optimizer import (
    ChainedOptimizer,
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
    build_optimizer,
)
from shardwork.parallel_state import (
    ParallelConfig,
    ParamMeta,
    all_to_all,
    group_rank,
    init_process_groups,
    set_param_meta,
)
from shardwork.parallel_state.testing import run_on_ranks

IN, HID, OUT, BATCH, STEPS = 5, 6, 3, 4, 3


class MoEBlock(nn.Module):
    """Dense in-projection, one expert per token (token i -> expert i % num_experts), dense
    out-projection. With ``ep_group`` this rank holds expert ``ep_rank`` only and tokens
    travel by all-to-all."""

    def __init__(self, seed: int, num_experts: int, ep_group=None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN, HID)
        experts = [nn.Linear(HID, HID) for _ in range(num_experts)]
        self.out = nn.Linear(HID, OUT)
        self.ep_group = ep_group
        self.num_experts = num_experts
        keep = [group_rank(ep_group)] if ep_group is not None else range(num_experts)
        self.experts = nn.ModuleList([experts[i] for i in keep])
        for p in self.experts.parameters():
            set_param_meta(p, ParamMeta(is_expert=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        e = torch.arange(h.size(0)) % self.num_experts
        if len(self.experts) == 0:
            y = h
        elif self.ep_group is None:
            y = torch.stack([self.experts[int(k)](h[i]) for i, k in enumerate(e)])
        else:
            order = torch.argsort(e, stable=True)
            send = torch.bincount(e, minlength=self.num_experts)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.ep_group)
            hr = all_to_all(
                h[order], self.ep_group, output_splits=recv.tolist(), input_splits=send.tolist()
            )
            yr = self.experts[0](hr)
            ys = all_to_all(
                yr, self.ep_group, output_splits=send.tolist(), input_splits=recv.tolist()
            )
            y = ys[torch.argsort(order)]
        return self.out(torch.tanh(y))


def data(dp: int):
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, dp * BATCH, IN, generator=g), torch.randn(
        STEPS, dp * BATCH, OUT, generator=g
    )


def adamw(groups):
    return torch.optim.AdamW(groups, lr=2e-2, weight_decay=0.05)


def _run(
    pp: int,
    ep: int,
    clip: float,
    stage_has_experts: tuple[bool, ...],
    in_collective: bool,
    overlap: bool = False,
):
    pg = init_process_groups(ParallelConfig(pp=pp, ep=ep))
    dp, rank, stage = pg.size("dp"), pg.rank("dp"), pg.rank("pp")
    experts = 2 if stage_has_experts[stage] else 0
    model = MoEBlock(10 + stage, max(experts, 1), pg.ep if experts else None)
    if not experts:
        model.experts = nn.ModuleList()
    cfg = DDPConfig(
        use_distributed_optimizer=True,
        bucket_size=30,
        pad_multiple=1,
        average_in_collective=in_collective,
    )
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    ocfg = OptimizerConfig(clip_grad=clip, count_zeros=True, overlap_param_gather=overlap)
    chain = build_optimizer(ddp, adamw, process_groups=pg, config=ocfg)
    x, y = data(dp)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    norms = []
    for s in range(STEPS):
        chain.zero_grad()
        nn.functional.mse_loss(ddp(x[s, local]), y[s, local]).backward()
        result = chain.step()
        norms.append(result.grad_norm)
    chain.finish_param_sync()  # overlap: the last step's gathers are still in flight before it
    named = dict(model.named_parameters())
    if pp > 1:  # local names collide across stages: global keys are required to save
        with pytest.raises(ValueError, match="param_rects"):
            chain.sharded_state_dict()
    return (
        stage,
        pg.rank("ep"),
        norms,
        {k: v.detach().clone() for k, v in named.items()},
        pg.size("edp"),
        _gathers_in_flight(ddp),
    )


def _gathers_in_flight(ddp) -> int:
    """Parameter all-gather buckets of ``ddp`` launched and not yet waited for."""
    last = {}
    for kind, key, index in ddp.param_gather_log:
        last[(key, index)] = kind
    return sum(kind == "launch" for kind in last.values())


def reference(dp: int, clip: float, stage_has_experts: tuple[bool, ...]):
    stages = []
    for stage, has in enumerate(stage_has_experts):
        m = MoEBlock(10 + stage, 2 if has else 1)
        if not has:
            m.experts = nn.ModuleList()
        stages.append(m)
    params = [p for m in stages for p in m.parameters()]
    opt = adamw(params)
    x, y = data(dp)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        sum(nn.functional.mse_loss(m(x[s]), y[s]) for m in stages).backward()
        norms.append(float(nn.utils.clip_grad_norm_(params, clip if clip else 1e30)))
        opt.step()
    return stages, norms


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("pp", "ep", "clip", "stage_has_experts", "in_collective", "overlap"),
    [
        (1, 2, 0.0, (True,), False, False),
        (1, 2, 0.0, (True,), True, False),
        (1, 2, 0.3, (True,), False, False),
        (2, 2, 0.3, (False, True), False, False),
        (1, 2, 0.3, (True,), False, True),
    ],
)
def test_chained_dense_expert_matches_single_process(
    pp, ep, clip, stage_has_experts, in_collective, overlap
):
    """Dense and expert parts chained equal one process; with overlap_param_gather the
    chain's ``finish_param_sync`` waits for both parts' gathers."""
    args = (pp, ep, clip, stage_has_experts, in_collective, overlap)
    results = run_on_ranks(_run, 4, args=args)
    stages, ref_norms = reference(4 // pp, clip, stage_has_experts)
    if pp == 1:
        assert results[0][4] == 2  # edp (2) differs from dp (4)
    for stage, ep_rank, norms, params, _, in_flight in results:
        assert in_flight == 0
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        ref = dict(stages[stage].named_parameters())
        for name, value in params.items():
            want = ref[name.replace("experts.0.", f"experts.{ep_rank}.")]
            torch.testing.assert_close(value, want.detach(), rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------- EP=2 x DP=4 checkpoint -> one process
def _moe_train(path: str, ep: int, first: int, last: int, load: bool):
    dcp = pytest.importorskip("shardwork.dist_checkpoint")
    from shardwork.dist_optimizer import rects_from_model_state

    pg = init_process_groups(ParallelConfig(ep=ep))
    dp, rank, ep_rank = pg.size("dp"), pg.rank("dp"), pg.rank("ep")
    model = MoEBlock(77 if load else 10, 2, pg.ep if ep > 1 else None)
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=30, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    parts = [
        DistributedOptimizer(ddp, adamw, process_groups=pg),
        DistributedOptimizer(ddp, adamw, expert=True, process_groups=pg),
    ]
    chain = ChainedOptimizer(parts)

    def key(name: str) -> str:
        return name.replace("experts.0.", f"experts.{ep_rank}.") if ep > 1 else name

    model_state = {
        n: dcp.ShardedTensor(key(n), p.data, tuple(p.shape), (0,) * p.dim())
        for n, p in model.named_parameters()
    }
    rects = [
        rects_from_model_state(model_state, tp_rank=pg.rank("tp")),
        rects_from_model_state(model_state, tp_rank=pg.rank("etp")),
    ]

    def state():
        return {"optimizer": chain.sharded_state_dict(param_rects=rects)}

    if load:
        loaded = dcp.load(state(), path)
        chain.load_sharded_state_dict(loaded["optimizer"], param_rects=rects)
    x, y = data(4)
    per = 4 * BATCH // dp
    for s in range(first, last):
        chain.zero_grad()
        local = slice(rank * per, (rank + 1) * per)
        nn.functional.mse_loss(ddp(x[s, local]), y[s, local]).backward()
        chain.step()
    if not load:
        dcp.save(state(), path)
    ddp.finish_param_sync()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.multirank
def test_expert_parallel_state_resumes_in_one_process(tmp_path):
    pytest.importorskip("shardwork.dist_checkpoint")
    path = str(tmp_path / "ckpt")
    run_on_ranks(_moe_train, 4, args=(path, 2, 0, 2, False))
    (resumed,) = run_on_ranks(_moe_train, 1, args=(path, 1, 2, STEPS, True))
    ref = MoEBlock(10, 2)
    opt = adamw(ref.parameters())
    x, y = data(4)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ref(x[s]), y[s]).backward()
        opt.step()
    for name, want in ref.named_parameters():
        torch.testing.assert_close(resumed[name], want.detach(), rtol=1e-5, atol=1e-6, msg=name)
