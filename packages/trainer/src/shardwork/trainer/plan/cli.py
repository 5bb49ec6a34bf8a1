"""``shardwork-plan``: rank the layouts of a model on a cluster (docs/planner.md).

``shardwork-plan --model llama3-70b --gpus 512 --gpu h100-sxm --global_batch 1024
--seq_length 8192 [--plot plan.svg]`` prints the ranked table; ``--tp/--cp/--pp/--dp/--ep``
restrict the search to layouts with those sizes. Every argument is checked before any layout
is priced; a mistake exits with 2 and one paragraph naming the option, the value and what
would be valid (:mod:`shardwork.trainer.errors`). When no layout fits, the table (which lists
why each layout was refused) is still printed and the exit code is 3, so a script that sweeps
models or cluster sizes can tell "nothing fits" from a plan without reading the text. Size
filters no layout can have (by the enumeration's rules) are mistakes (exit 2, naming the valid
sizes); a GPU count on which no layout can be formed at all exits 3 with one line saying why
and which GPU counts nearby can. The plot is written to a temporary name and renamed, so an
interrupted run leaves no partial file.
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
from shardwork.trainer.plan.layouts import MIN_CP_TOKENS, Layout, parallel_layouts, variants
from shardwork.trainer.plan.planner import plan, planning_model
from shardwork.trainer.plan.report import render_svg, render_table

__all__ = ["PlanArgs", "check_args", "main"]

PROG = "shardwork-plan"
EXIT_NOTHING_FITS = 3
SIZES = ("tp", "cp", "pp", "dp")
"""The sizes whose product is the GPU count (ep splits the tp·cp·dp ranks of a stage)."""
NEARBY = 8
"""How far from --gpus to look for GPU counts that can form a layout (when none can)."""


class NoLayoutError(UserError):
    """No layout at all can be formed from the GPU count, model and batch: exit 3 like "nothing
    fits", because a script sweeping cluster sizes meets it as one more size with no plan."""

    exit_code = EXIT_NOTHING_FITS


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
    """The size filters against --gpus and --global_batch, each alone and then together (the
    model's own limits come later, in :func:`check_sizes_against_model`)."""
    problems = []
    for name in ("tp", "cp", "pp", "dp", "ep"):
        value = getattr(args, name)
        _positive(problems, name, value)
        if value is not None and value >= 1 and args.gpus >= 1 and args.gpus % value:
            problems.append(f"--{name}={value}: must divide --gpus={args.gpus}")
    if not problems and args.gpus >= 1:  # each size divides --gpus: now their product
        problems += _product_problems(args)
    dp, batch = args.dp, args.global_batch
    if dp is not None and dp >= 1 and batch >= 1 and batch % dp:
        problems.append(
            f"--global_batch={batch} is not divisible by --dp={dp}: each data-parallel "
            "replica takes a whole number of sequences"
        )
    return problems


def _product_problems(args: PlanArgs) -> list[str]:
    """The given sizes together against --gpus, by the planner's rule that every layout has
    ``tp·cp·pp·dp = gpus`` and ep splits the ``tp·cp·dp = gpus / pp`` ranks of a pipeline
    stage (:func:`~shardwork.trainer.plan.layouts.parallel_layouts`)."""
    gpus, problems = args.gpus, []
    given = {k: getattr(args, k) for k in SIZES if getattr(args, k) is not None}
    product = math.prod(given.values())
    options = " ".join(f"--{k}={v}" for k, v in given.items())
    formula = f"{'·'.join(given)} = {product}"
    if len(given) == len(SIZES) and product != gpus:
        problems.append(
            f"{options}: {formula} must equal --gpus={gpus} (one rank per GPU); valid: "
            f"sizes whose product is {gpus}"
        )
    elif len(given) > 1 and gpus % product:
        problems.append(
            f"{options}: {formula} must divide --gpus={gpus} (dp takes the remaining factor, "
            f"one rank per GPU); valid: sizes whose product divides {gpus}"
        )
    stage = None  # the ranks of one pipeline stage, when the given sizes fix it
    if args.pp is not None and not problems:
        stage, of = gpus // args.pp, f"--gpus={gpus} / --pp={args.pp}"
    elif all(getattr(args, k) is not None for k in ("tp", "cp", "dp")) and not problems:
        stage, of = args.tp * args.cp * args.dp, f"tp·cp·dp = {args.tp}·{args.cp}·{args.dp}"
    if args.ep is not None and stage is not None and stage % args.ep:
        problems.append(
            f"--ep={args.ep}: expert parallelism splits the {stage} ranks of one pipeline "
            f"stage ({of}); valid: a divisor of {stage}"
        )
    return problems


def _plot_problems(plot: str) -> list[str]:
    """--plot must name a file (not a folder) in an existing, writable folder."""
    path = Path(plot)
    if path.is_dir():
        return [
            f"--plot={plot}: is a directory; valid: a file path for the SVG, e.g. "
            f"{path / 'plan.svg'}"
        ]
    existing = next((p for p in path.parents if p.exists()), path.parent)  # nearest that is
    if existing.exists() and not existing.is_dir():
        return [f"--plot={plot}: {existing} is a file, not a folder; valid: a path in a folder"]
    if not path.parent.is_dir():
        return [f"--plot={plot}: its folder {path.parent} does not exist"]
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return [f"--plot={plot}: its folder {path.parent} is not writable"]
    return []


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
    if args.plot is not None:
        problems += _plot_problems(args.plot)
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
    that no layout fits, without why), by the rules of the planner's enumeration
    (:mod:`shardwork.trainer.plan.layouts`)."""
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
    per_node = _cluster(args).gpus_per_node
    if args.tp is not None and args.tp > per_node:
        problems.append(
            f"--tp={args.tp}: the planner keeps tensor parallelism inside one node of "
            f"{per_node} GPUs (--gpus_per_node); valid: tp <= {per_node}"
        )
    layers = model.num_layers
    if args.pp is not None and args.pp > layers:
        problems.append(
            f"--pp={args.pp}: the planner splits the {layers} layers of --model={args.model!r} "
            f"over at most {layers} pipeline stages; valid: pp <= {layers}"
        )
    problems += _cp_problems(args)
    if problems:
        raise UserError("; ".join(problems))


def _cp_problems(args: PlanArgs) -> list[str]:
    """--cp against --seq_length: the planner's ``MIN_CP_TOKENS`` per rank, and the 2·cp
    load-balanced chunks of ``GPTConfig.check_layout``."""
    cp, seq, problems = args.cp, args.seq_length, []
    if cp is None or cp <= 1:
        return problems
    if seq // cp < MIN_CP_TOKENS:
        problems.append(
            f"--cp={cp}: the planner uses context parallelism only while each rank keeps at "
            f"least {MIN_CP_TOKENS} tokens of a sequence, and --seq_length={seq} leaves "
            f"{seq // cp}; valid: --cp 1, or a cp with seq_length / cp >= {MIN_CP_TOKENS}"
        )
    if seq % (2 * cp):
        problems.append(
            f"--cp={cp}: context parallelism splits each sequence into 2·cp = {2 * cp} "
            f"load-balanced chunks, and --seq_length={seq} is not divisible by {2 * cp}; "
            "valid: a cp with seq_length divisible by 2·cp"
        )
    return problems


def _wanted(args: PlanArgs) -> dict[str, int]:
    """The size filters given (``--tp`` ... ``--ep``) as ``{name: size}``."""
    sizes = {k: getattr(args, k) for k in (*SIZES, "ep")}
    return {k: v for k, v in sizes.items() if v is not None}


def _layouts(model, args: PlanArgs, num_gpus: int, gpus_per_node: int) -> list[Layout]:
    """The parallel layouts ``plan`` would price (each with a micro-batch it can run)."""
    found = parallel_layouts(
        planning_model(model),
        num_gpus=num_gpus,
        gpus_per_node=gpus_per_node,
        global_batch=args.global_batch,
        seq_length=args.seq_length,
    )
    return [lay for lay in found if any(variants(lay, args.global_batch))]


def _working(model, args: PlanArgs, counts, gpus_per_node: int, most: int = 2) -> list[int]:
    """The first ``most`` of ``counts`` (GPU counts) on which some layout can be formed."""
    found = []
    for g in counts:
        if len(found) < most and _layouts(model, args, g, gpus_per_node):
            found.append(g)
    return found


def _no_layout_message(args: PlanArgs, model, gpus: int, per_node: int) -> str:
    """Why no layout can use ``gpus`` GPUs (the enumeration's rules), and GPU counts within
    ``NEARBY`` that can, so a user (or a sweep) sees what to try instead."""
    below = _working(model, args, range(gpus - 1, max(gpus - NEARBY, 1) - 1, -1), per_node)
    above = _working(model, args, range(gpus + 1, gpus + NEARBY + 1), per_node)
    near = sorted(below + above)
    valid = (
        f"valid nearby: --gpus {', '.join(map(str, near))}"
        if near
        else f"no GPU count within {NEARBY} of {gpus} works either"
    )
    return (
        f"--gpus={gpus}: no layout of --model={args.model!r} can use {gpus} GPUs: the planner "
        f"needs tp·cp·pp·dp = {gpus} with tp <= {per_node} (one node) dividing the "
        f"{model.num_attention_heads} attention heads, cp > 1 only with >= {MIN_CP_TOKENS} "
        f"tokens of --seq_length={args.seq_length} per rank, pp <= {model.num_layers} with a "
        f"split of the layers, and dp dividing --global_batch={args.global_batch}; {valid}"
    )


def check_layouts_exist(args: PlanArgs, model, cluster: Cluster) -> None:
    """Before pricing: NoLayoutError (exit 3) when no layout can be formed at all, and
    UserError (exit 2) when layouts exist but none has the given sizes, naming the sizes that
    would be valid. Either way the table would only say "0 parallel layouts fit; 0 do not
    fit at all"."""
    gpus, per_node = cluster.num_gpus, cluster.gpus_per_node
    layouts = _layouts(model, args, gpus, per_node)
    if not layouts:
        raise NoLayoutError(_no_layout_message(args, model, gpus, per_node))
    wanted = _wanted(args)
    if not wanted or any(_matches(lay, wanted) for lay in layouts):
        return
    valid = []
    for name in wanted:
        others = {k: v for k, v in wanted.items() if k != name}
        values = {getattr(lay, name) for lay in layouts if _matches(lay, others)}
        values = values or {getattr(lay, name) for lay in layouts}
        valid.append(f"--{name} {', '.join(map(str, sorted(values)))}")
    options = " ".join(f"--{k}={v}" for k, v in wanted.items())
    raise UserError(
        f"{options}: no layout of --model={args.model!r} on --gpus={gpus} with "
        f"--global_batch={args.global_batch} and --seq_length={args.seq_length} has these "
        f"sizes; valid (with the other sizes given): {'; '.join(valid)}"
    )


def _cluster(args: PlanArgs):
    base = dict(CLUSTERS[args.cluster]) if args.cluster else dict(gpu=GPUS[args.gpu])
    if args.cluster is None:
        base |= dict(gpus_per_node=8, internode=400 / 8 * GB)
    if args.gpus_per_node is not None:
        base["gpus_per_node"] = args.gpus_per_node
    if args.internode_gbit is not None:
        base["internode"] = args.internode_gbit / 8 * GB
    return Cluster(num_gpus=args.gpus, **base)


def _matches(layout: Layout, sizes: dict) -> bool:
    """Whether ``layout`` has every size of ``sizes`` (``{"tp": 2, ...}``)."""
    return all(getattr(layout, k) == v for k, v in sizes.items())


def _write_plot(path: str, svg: str) -> None:
    """Write ``svg`` to a temporary name beside ``path``, then rename it over ``path`` (so an
    interrupted run leaves no partial file); on an OSError remove the temporary and raise
    UserError naming the path."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        tmp.write_text(svg)
        os.replace(tmp, target)
    except OSError as exc:
        if tmp.is_file():
            tmp.unlink()
        raise UserError(f"--plot={path}: cannot write it ({exc.strerror or exc})") from None


def run(args: PlanArgs) -> tuple[str, int]:
    """Plan; return the table and how many parallel layouts fit (writes the plot if asked)."""
    check_args(args)
    model = load_model(args.model)
    check_sizes_against_model(args, model)
    cluster = _cluster(args)
    check_layouts_exist(args, model, cluster)
    result = plan(
        model,
        cluster,
        global_batch=args.global_batch,
        seq_length=args.seq_length,
        eff=args.efficiency,
    )
    wanted = _wanted(args)
    if wanted:
        result.rows = [r for r in result.rows if _matches(r.layout, wanted)]
        result.refused = [r for r in result.refused if _matches(r.layout, wanted)]
    if args.plot is not None:
        _write_plot(args.plot, render_svg(result, top=args.top))
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
