"""``shardwork-plan`` mistakes found before any layout is priced: a --plot path that is a
folder or below a file, size filters no layout can have (their product against --gpus, pp
against the model's layers, cp against the sequence length), and a GPU count no layout can
use at all. Each ends in one stderr line naming the option, the value and what is valid, with
nothing written to the working folder."""

from __future__ import annotations

import re

import pytest

from shardwork.models import preset
from shardwork.trainer.plan import cli
from shardwork.trainer.plan.cli import main
from shardwork.trainer.plan.cluster import GB, GPUS, Cluster
from shardwork.trainer.plan.planner import plan

BASE = ["--model", "llama3-8b", "--global_batch", "64", "--seq_length", "2048"]


@pytest.fixture
def no_pricing(monkeypatch, tmp_path):
    """Work in an empty folder, and fail if the planner is reached: each mistake here must be
    reported before any work."""
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("plan() ran: the mistake was not caught before pricing")

    monkeypatch.setattr(cli, "plan", refuse)
    return tmp_path


def _error(argv, code, capsys, folder) -> str:
    """Run the CLI; check the exit code, one stderr line, no traceback, nothing new written."""
    before = sorted(p.name for p in folder.iterdir())
    assert main(argv) == code
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith("shardwork-plan: ") and captured.err.count("\n") == 1
    assert sorted(p.name for p in folder.iterdir()) == before
    return captured.err


def test_plot_that_is_a_folder_is_refused_before_planning(no_pricing, capsys):
    (no_pricing / "SOMEDIR").mkdir()
    err = _error([*BASE, "--gpus", "8", "--plot", "SOMEDIR"], 2, capsys, no_pricing)
    assert re.search(r"--plot=SOMEDIR: is a directory; valid: .*SOMEDIR/plan\.svg", err), err
    assert list((no_pricing / "SOMEDIR").iterdir()) == []


def test_plot_below_a_file_says_it_is_a_file(no_pricing, capsys):
    (no_pricing / "afile").write_text("")
    err = _error([*BASE, "--gpus", "8", "--plot", "afile/x.svg"], 2, capsys, no_pricing)
    assert re.search(r"--plot=afile/x\.svg: afile is a file, not a folder", err), err
    assert "does not exist" not in err


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (
            ["--gpus", "8", "--tp", "8", "--pp", "8"],
            r"--tp=8 --pp=8: tp·pp = 64 must divide --gpus=8 .*valid: sizes whose product "
            r"divides 8",
        ),
        (
            ["--gpus", "8", "--tp", "2", "--cp", "1", "--pp", "2", "--dp", "4"],
            r"tp·cp·pp·dp = 16 must equal --gpus=8",
        ),
        (
            ["--gpus", "64", "--pp", "64"],
            r"--pp=64: .*32 layers of --model='llama3-8b'.*valid: pp <= 32",
        ),
        (
            ["--gpus", "8", "--seq_length", "2047", "--cp", "8"],
            r"--cp=8: .*at least 4096 tokens.*--seq_length=2047 leaves 255.*"
            r"2·cp = 16 load-balanced chunks.*not divisible by 16",
        ),
        (
            ["--gpus", "16", "--tp", "16"],
            r"--tp=16: .*one node of 8 GPUs.*valid: tp <= 8",
        ),
        (
            ["--gpus", "16", "--pp", "8", "--ep", "4", "--model", "mixtral-8x7b"],
            r"--ep=4: expert parallelism splits the 2 ranks of one pipeline stage "
            r"\(--gpus=16 / --pp=8\); valid: a divisor of 2",
        ),
    ],
    ids=["product-divides", "product-equals", "pp-layers", "cp-sequence", "tp-node", "ep-stage"],
)
def test_size_filters_no_layout_can_have_exit_2_with_why(extra, pattern, no_pricing, capsys):
    argv = list(BASE)
    for i in range(0, len(extra), 2):
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i : i + 2]
    err = _error(argv, 2, capsys, no_pricing)
    assert re.search(pattern, err), err


def _planner(gpus: int, global_batch: int = 64):
    """What the planner itself finds for llama3-8b, 2048 tokens, on ``gpus`` H100s."""
    cluster = Cluster(num_gpus=gpus, gpus_per_node=8, internode=400 / 8 * GB, gpu=GPUS["h100-sxm"])
    return plan(preset("llama3-8b"), cluster, global_batch=global_batch, seq_length=2048)


def test_a_filter_no_enumerated_layout_has_names_the_valid_sizes(no_pricing, capsys):
    """26 GPUs, batch 26: pp 13 divides everything, but 32 layers have no 13-stage split."""
    layouts = _planner(26, global_batch=26)
    found = {r.layout.pp for r in layouts.rows + layouts.refused}
    assert found == {1, 2}  # the planner's own answer
    argv = [*BASE, "--gpus", "26", "--global_batch", "26", "--pp", "13"]
    err = _error(argv, 2, capsys, no_pricing)
    assert re.search(r"--pp=13: no layout of --model='llama3-8b' on --gpus=26 .*--pp 1, 2$", err)


def test_gpu_count_no_layout_can_use_exits_3_naming_counts_that_work(no_pricing, capsys):
    """13 GPUs: the planner enumerates nothing (the table said only "0 fit; 0 do not fit")."""
    assert not _planner(13).rows and not _planner(13).refused
    for g in (11, 12, 14, 16):  # the nearest counts with layouts, two each side
        found = _planner(g)
        assert found.rows or found.refused
    err = _error([*BASE, "--gpus", "13"], 3, capsys, no_pricing)
    assert re.search(r"--gpus=13: no layout of --model='llama3-8b' can use 13 GPUs", err), err
    assert re.search(r"dp dividing --global_batch=64; valid nearby: --gpus 11, 12, 14, 16$", err)
