"""``shardwork-plan``: rank the layouts of a model on a cluster (docs/planner.md).

``shardwork-plan --model llama3-70b --gpus 512 --gpu h100-sxm --global_batch 1024
--seq_length 8192 [--plot plan.svg]`` prints the ranked table; ``--tp/--cp/--pp/--dp/--ep``
restrict the search to layouts with those sizes. Every argument is checked before any layout
is priced; a mistake exits with 2 and one paragraph naming the option, the value and what
would be valid (:mod:`shardwork.trainer.errors`). When no layout fits, the table (which lists
why each layout was refused) is still printed and the exit code is 3, so a script that sweeps
models or cluster sizes can tell "nothing fits" from a plan without reading the text. The
plot is written to a temporary name and renamed, so an interrupted run leaves no partial file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from shardwork.models import preset
from shardwork.models.hf import gpt_config_from_hf
from shardwork.models.presets import PRESETS
from shardwork.trainer.errors import UserError, report
from shardwork.trainer.plan.cluster import CLUSTERS, GB, GPUS, Cluster
from shardwork.trainer.plan.planner import plan
from shardwork.trainer.plan.report import render_svg, render_table

__all__ = ["PlanArgs", "check_args", "main"]

PROG = "shardwork-plan"
EXIT_NOTHING_FITS = 3


@dataclass(kw_only=True)
class PlanArgs:
    """Rank the parallel layouts of a training run by predicted step time. Exit codes: 0 at
    least one layout fits, 1 internal error, 2 usage error, 3 no layout fits (the table says
    why each was refused)."""

    model: str
    """A shardwork.models preset name, a Hugging Face config.json, or a folder holding one."""
    gpus: int
    """Number of GPUs (>= 1)."""
    global_batch: int
    """Sequences per optimizer step (>= 1)."""
    seq_length: int
    """Tokens per sequence (>= 1)."""
    gpu: str = "h100-sxm"
    """GPU type: a100-80gb, h100-sxm or h800-sxm (sets peak, memory, NVLink)."""
    cluster: str | None = None
    """A named cluster (selene, jean-zay, meta-h100, deepseek-h800): GPU, node size, network."""
    gpus_per_node: int | None = None
    """GPUs joined by NVLink in one node (default 8, or the named cluster's)."""
    internode_gbit: float | None = None
    """Inter-node bandwidth per GPU, Gb/s per direction (default 400, or the cluster's)."""
    efficiency: float | None = None
    """Achievable fraction of peak for the matmuls, in (0, 1]; default: the GPU's constant."""
    tp: int | None = None
    """Only layouts with this tensor-parallel size."""
    cp: int | None = None
    """Only layouts with this context-parallel size."""
    pp: int | None = None
    """Only layouts with this pipeline-parallel size."""
    dp: int | None = None
    """Only layouts with this data-parallel size."""
    ep: int | None = None
    """Only layouts with this expert-parallel size."""
    top: int = 10
    """Rows of the ranked table (>= 1)."""
    refused: int = 5
    """Refused layouts to list (>= 0)."""
    plot: str | None = None
    """Write an SVG bar chart of the ranked layouts' step time to this path."""


def _positive(problems: list[str], name: str, value, *, minimum: int = 1) -> None:
    if value is not None and (isinstance(value, bool) or value < minimum):
        problems.append(f"--{name}={value}: must be an integer >= {minimum}")


def _sizes_problems(args: PlanArgs) -> list[str]:
    problems = []
    for name in ("tp", "cp", "pp", "dp", "ep"):
        value = getattr(args, name)
        _positive(problems, name, value)
        if value is not None and value >= 1 and args.gpus >= 1 and args.gpus % value:
            problems.append(f"--{name}={value}: must divide --gpus={args.gpus}")
    dp, batch = args.dp, args.global_batch
    if dp is not None and dp >= 1 and batch >= 1 and batch % dp:
        problems.append(
            f"--global_batch={batch} is not divisible by --dp={dp}: each data-parallel "
            "replica takes a whole number of sequences"
        )
    return problems


def check_args(args: PlanArgs) -> None:
    """UserError naming every bad option (value and what is valid), before any work."""
    problems = []
    for name in ("gpus", "global_batch", "seq_length", "top", "gpus_per_node"):
        _positive(problems, name, getattr(args, name))
    _positive(problems, "refused", args.refused, minimum=0)
    if args.gpu not in GPUS:
        problems.append(f"--gpu={args.gpu!r}: unknown GPU; valid: {', '.join(sorted(GPUS))}")
    if args.cluster is not None and args.cluster not in CLUSTERS:
        problems.append(
            f"--cluster={args.cluster!r}: unknown cluster; valid: {', '.join(sorted(CLUSTERS))}"
        )
    if args.internode_gbit is not None and not (
        math.isfinite(args.internode_gbit) and args.internode_gbit > 0
    ):
        problems.append(f"--internode_gbit={args.internode_gbit}: must be a number > 0")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        problems.append(f"--efficiency={args.efficiency}: must be in (0, 1]")
    problems += _sizes_problems(args)
    if args.plot is not None and not Path(args.plot).parent.is_dir():
        problems.append(f"--plot={args.plot}: its folder does not exist")
    if problems:
        raise UserError("; ".join(problems))


def load_model(spec: str):
    """The GPTConfig of a preset name, a config.json path or a folder holding one."""
    if spec in PRESETS:
        return preset(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(
            f"--model={spec!r}: neither a preset nor a readable config.json; valid: a preset "
            f"({', '.join(sorted(k for k in PRESETS if not k.startswith('tiny-')))}), a Hugging "
            "Face config.json, or a folder holding one"
        )
    try:
        hf = json.loads(path.read_text())
        return gpt_config_from_hf(hf)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--model={spec!r}: cannot read {path} as JSON ({exc})") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"--model={spec!r}: {path} is not a supported config ({exc})") from None


def check_sizes_against_model(args: PlanArgs, model) -> None:
    """UserError for a size filter no layout of ``model`` can have (the table would only say
    that no layout fits, without why)."""
    problems = []
    if args.ep is not None and args.ep > 1 and model.moe is None:
        problems.append(
            f"--ep={args.ep}: expert parallelism needs an MoE model, and --model={args.model!r} "
            "is dense; valid: --ep 1 or no --ep"
        )
    heads = model.num_attention_heads
    if args.tp is not None and heads % args.tp != 0:
        problems.append(
            f"--tp={args.tp}: tensor parallelism splits the {heads} attention heads of "
            f"--model={args.model!r}; valid: a divisor of {heads}"
        )
    if problems:
        raise UserError("; ".join(problems))


def _cluster(args: PlanArgs):
    base = dict(CLUSTERS[args.cluster]) if args.cluster else dict(gpu=GPUS[args.gpu])
    if args.cluster is None:
        base |= dict(gpus_per_node=8, internode=400 / 8 * GB)
    if args.gpus_per_node is not None:
        base["gpus_per_node"] = args.gpus_per_node
    if args.internode_gbit is not None:
        base["internode"] = args.internode_gbit / 8 * GB
    return Cluster(num_gpus=args.gpus, **base)


def _matches(row, sizes: dict) -> bool:
    return all(getattr(row.layout, k) == v for k, v in sizes.items())


def run(args: PlanArgs) -> tuple[str, int]:
    """Plan; return the table and how many parallel layouts fit (writes the plot if asked)."""
    check_args(args)
    model = load_model(args.model)
    check_sizes_against_model(args, model)
    result = plan(
        model,
        _cluster(args),
        global_batch=args.global_batch,
        seq_length=args.seq_length,
        eff=args.efficiency,
    )
    wanted = {k: getattr(args, k) for k in ("tp", "cp", "pp", "dp", "ep")}
    wanted = {k: v for k, v in wanted.items() if v is not None}
    if wanted:
        result.rows = [r for r in result.rows if _matches(r, wanted)]
        result.refused = [r for r in result.refused if _matches(r, wanted)]
    if args.plot is not None:
        tmp = Path(args.plot).with_name(f".{Path(args.plot).name}.tmp")
        tmp.write_text(render_svg(result, top=args.top))
        os.replace(tmp, args.plot)
    return render_table(result, top=args.top, refused=args.refused), len(result.ranked())


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(
        PlanArgs, args=sys.argv[1:] if argv is None else argv, use_underscores=True, prog=PROG
    )
    try:
        table, fitting = run(args)
    except UserError as exc:
        return report(PROG, str(exc), exc.exit_code)
    print(table)
    return 0 if fitting else EXIT_NOTHING_FITS


if __name__ == "__main__":
    sys.exit(main())
