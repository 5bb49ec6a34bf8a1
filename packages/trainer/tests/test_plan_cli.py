"""``shardwork-plan``: its table against ``plan()``, Hugging Face config input, the SVG plot,
the size filters, argument errors (exit 2, one paragraph naming the option) and the exit code
when nothing fits (3)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from shardwork.models import preset
from shardwork.models.hf import hf_config_from_gpt
from shardwork.trainer.plan.cli import main
from shardwork.trainer.plan.cluster import CLUSTERS, GPUS, Cluster
from shardwork.trainer.plan.planner import plan

ARGS = ["--model", "llama3-8b", "--gpus", "64", "--global_batch", "128", "--seq_length", "4096"]


def _table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line[:4].strip().isdigit()]


def test_table_lists_the_planners_ranking(capsys):
    assert main([*ARGS, "--cluster", "meta-h100", "--top", "5"]) == 0
    out = capsys.readouterr().out
    expected = plan(
        preset("llama3-8b"),
        Cluster(num_gpus=64, **CLUSTERS["meta-h100"]),
        global_batch=128,
        seq_length=4096,
    ).ranked()[:5]
    rows = _table_rows(out)
    assert len(rows) == 5
    for i, (line, row) in enumerate(zip(rows, expected), start=1):
        assert line.split()[0] == str(i)
        assert row.layout.describe() in line
        step = row.time.total
        shown = f"{step:.2f} s" if step >= 1 else f"{step * 1e3:.3g} ms"
        assert shown in line and f"{row.mfu:.1%}" in line
    assert out.splitlines()[0].startswith("64 x h100-sxm (8 per node), global batch 128 x 4096")


@pytest.mark.parametrize(
    ("model", "gpus", "batch", "seq", "sizes"),
    [
        ("llama3-8b", 64, 128, 4096, {}),  # TP 2 with sequence parallelism
        ("tiny-deepseek-v3", 4, 8, 64, {}),  # an uneven pipeline split
        ("tiny-mixtral-8x7b", 4, 8, 64, {"tp": 2, "ep": 2}),  # experts at etp 1 below tp 2
    ],
)
def test_the_first_rows_flags_give_shardwork_train_that_layout(
    model, gpus, batch, seq, sizes, capsys
):
    """The table ends with the #1 layout as shardwork-train flags; given to the trainer's own
    parser and validation at that world size, they give the layout's sizes (ETP resolved,
    sequence parallelism with TP, the uneven split, micro-batch, recompute) and the problem."""
    from shardwork.trainer.config.cli import parse_train_args
    from shardwork.trainer.config.validate import validate_config

    args = ["--model", model, "--gpus", str(gpus), "--global_batch", str(batch)]
    args += [f"--{name}={size}" for name, size in sizes.items()]
    assert main([*args, "--seq_length", str(seq), "--cluster", "meta-h100"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("#1 with shardwork-train")]
    assert f"on {gpus} ranks" in line
    flags = line.split(": ", 1)[1].split()
    config, _ = parse_train_args(["--model.preset", model, *flags])
    config = validate_config(config, world_size=gpus)
    cluster = Cluster(num_gpus=gpus, **CLUSTERS["meta-h100"])
    ranked = plan(preset(model), cluster, global_batch=batch, seq_length=seq).ranked()
    best = next(
        row.layout
        for row in ranked
        if all(getattr(row.layout, name) == size for name, size in sizes.items())
    )
    par = config.parallel
    got = (par.tp, par.cp, par.pp, par.vpp or 1, par.ep, par.etp or par.tp)
    assert got == (
        best.tp,
        best.cp,
        best.pp,
        best.vpp,
        best.ep,
        best.etp if preset(model).moe else par.tp,
    )
    assert (par.first_stage_layers, par.last_stage_layers) == (
        best.first_stage_layers, best.last_stage_layers,
    )  # fmt: skip
    assert par.sequence_parallel == (best.tp > 1)
    assert config.schedule.micro_batch_size == best.micro_batch
    assert config.model.settings.get("recompute", "none") == best.recompute
    assert (config.schedule.global_batch_size, config.data.seq_length) == (batch, seq)


def test_hf_config_json_and_folder_plan_like_the_preset(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_gpt(preset("llama3-8b"))))
    outs = []
    for model in ("llama3-8b", str(tmp_path / "config.json"), str(tmp_path)):
        args = list(ARGS)
        args[1] = model
        assert main(args) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2]


def test_plot_is_an_svg_with_one_bar_group_per_row(tmp_path, capsys):
    path = tmp_path / "plan.svg"
    assert main([*ARGS, "--top", "4", "--plot", str(path)]) == 0
    root = ET.fromstring(path.read_text())
    assert root.tag.endswith("svg")
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert sum(1 for t in texts if t and t[:2] in ("1.", "2.", "3.", "4.")) == 4
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert sum(1 for t in titles if t.startswith("compute")) == 4
    assert [p.name for p in tmp_path.iterdir()] == ["plan.svg"]  # no temporary left


def test_size_filters_keep_only_matching_layouts(capsys):
    assert main([*ARGS, "--tp", "2", "--pp", "2"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert rows and all(" TP2 " in f" {r} " and " PP2" in r for r in rows)


def test_nothing_fits_prints_the_refusals_and_exits_3(capsys):
    """A 70B model on two 80 GiB GPUs: no layout holds its weights and optimizer state."""
    args = ["--model", "llama3-70b", "--gpus", "2", "--global_batch", "2", "--seq_length", "4096"]
    expected = plan(
        preset("llama3-70b"),
        Cluster(num_gpus=2, gpus_per_node=8, internode=400 / 8 * 1e9, gpu=GPUS["h100-sxm"]),
        global_batch=2,
        seq_length=4096,
    )
    assert expected.rows == [] and expected.refused  # the planner itself finds nothing
    assert main(args) == 3
    captured = capsys.readouterr()
    assert "(no layout fits)" in captured.out and "0 parallel layouts fit" in captured.out
    assert captured.out.count("  refused ") >= 1 and captured.err == ""


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--gpu", "b300"], ["--gpu='b300'", "a100-80gb, h100-sxm, h800-sxm"]),
        (["--dp", "3"], ["--dp=3: must divide --gpus=64"]),
        (
            ["--dp", "64", "--global_batch", "100"],
            ["--global_batch=100 is not divisible by --dp=64"],
        ),
        (["--efficiency", "1.5"], ["--efficiency=1.5", "(0, 1]"]),
        (["--cluster", "nowhere"], ["--cluster='nowhere'", "selene"]),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(extra, needles, capsys):
    args = list(ARGS)
    for i in range(0, len(extra), 2):  # override or append
        if extra[i] in args:
            args[args.index(extra[i]) + 1] = extra[i + 1]
        else:
            args += extra[i : i + 2]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwork-plan: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_unknown_model_and_unreadable_config(tmp_path, capsys):
    args = list(ARGS)
    args[1] = "llama9-1t"
    assert main(args) == 2
    assert "--model='llama9-1t'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    args[1] = str(tmp_path)
    assert main(args) == 2
    assert "cannot read" in capsys.readouterr().err
