"""The README's two examples run as written: the first on 4 gloo ranks (as under torchrun),
the second, a user's multi-rank pytest test, as a test of this module.

The first block's printed groups and derived sizes are checked against Megatron's rank-order
rule written out here, and its column-parallel product against one dense product of the
gathered weight."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwork.parallel_state.testing import run_on_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _first_example():
    scope: dict = {"__name__": "readme"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(BLOCKS[0], str(README), "exec"), scope)
    groups, x, weight, y = scope["groups"], scope["x"], scope["weight"], scope["y"]
    # the full weight: every tp rank's rows, in tp-rank order
    parts = [torch.empty_like(weight) for _ in range(groups.size("tp"))]
    dist.all_gather(parts, weight.detach(), group=groups.tp)
    xs = [torch.empty_like(x) for _ in range(groups.size("tp"))]
    dist.all_gather(xs, x.detach(), group=groups.tp)
    outs = [torch.empty_like(y) for _ in range(groups.size("tp"))]
    dist.all_gather(outs, y.detach(), group=groups.tp)
    return printed.getvalue(), xs, torch.cat(parts), torch.cat(outs, dim=1)


@pytest.mark.multirank
def test_first_example_on_four_ranks():
    results = run_on_ranks(_first_example, 4, timeout=300)
    # tp 8 fastest, then pp 4 (order tp-cp-ep-dp-pp): tp groups are runs of 8 consecutive
    # ranks; dp = 512 / (8 * 4), edp = 512 / (4 * 16 * 1)
    expected = f"{[list(range(8)), list(range(8, 16))]} 16 8\n"
    for printed, xs, full_weight, y in results:
        assert printed == expected
        # a column-parallel linear needs the same input on every tp rank (the README seeds it);
        # its outputs, gathered along the columns, are one dense product with the weight's rows
        # gathered in tp-rank order (values ~8: fp32 sums of 64 products, compared at 1e-5)
        assert all(torch.equal(other, xs[0]) for other in xs)
        torch.testing.assert_close(y, xs[0] @ full_weight.t(), rtol=1e-5, atol=1e-5)


# The second example is a user's test module: run as this one's (its test is collected here,
# and the harness re-imports this file on every rank, where _sum is defined the same way).
exec(compile(BLOCKS[1], str(README), "exec"), globals())
