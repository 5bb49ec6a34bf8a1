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
        assert f"{row.time.total:.2f}" in line and f"{row.mfu:.1%}" in line
    assert out.splitlines()[0].startswith("64 x h100-sxm (8 per node), global batch 128 x 4096")


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
