"""``shardwork-plot`` on a RUN_DIR that is not a plottable run: one line on stderr naming the
file (and line), exit 2, no traceback, and no ``plots`` folder made or changed. A torn last
line of a live run is still skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.observe.plot import main

FORM = r"a metrics log holds one JSON object per line"


def _run_dir(tmp_path, content: bytes):
    (tmp_path / "metrics.jsonl").write_bytes(content)
    return tmp_path


def _refused(run_dir, capsys) -> str:
    """Run the CLI, check exit 2, one stderr line without a traceback, nothing written."""
    before = sorted(p.name for p in run_dir.iterdir())
    assert main([str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert captured.err.startswith("shardwork-plot: ")
    assert sorted(p.name for p in run_dir.iterdir()) == before
    return captured.err


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"not json\n", rf"metrics\.jsonl, line 1: not JSON .*{FORM}"),
        (
            b'{"kind":"train","step":1,"loss":2.0}\n{"kind":"train","step":"x","loss":"abc"}\n',
            rf"metrics\.jsonl, line 2: step='x' is not a number; {FORM}",
        ),
        (
            b'{"kind":"train","step":3,"loss":"abc"}\n',
            rf"metrics\.jsonl, line 1: loss='abc' is not a number; {FORM}",
        ),
        (
            b'[1,2]\n{"kind":"train","step":1,"loss":NaN}\n',
            rf"metrics\.jsonl, line 1: a JSON list, not an object; {FORM}",
        ),
        (b"", rf"metrics\.jsonl holds no train record with a loss \(0 records in all\).*{FORM}"),
        (
            b'{"kind":"event","step":0,"bigram_nats":2.0}\n',
            r"metrics\.jsonl holds no train record with a loss \(1 records in all\)",
        ),
    ],
    ids=["not-json", "step-not-number", "loss-not-number", "list-line", "empty", "no-train"],
)
def test_not_a_metrics_log_is_refused_naming_the_file_and_line(tmp_path, capsys, content, pattern):
    err = _refused(_run_dir(tmp_path, content), capsys)
    assert re.search(re.escape(str(tmp_path)) + r"/" + pattern, err), err


def test_non_utf8_log_is_refused_naming_the_file(tmp_path, capsys):
    err = _refused(
        _run_dir(tmp_path, b'{"kind":"train","step":1,"loss":1.0}\n\xff\xfe{}\n'), capsys
    )
    assert re.search(
        re.escape(str(tmp_path / "metrics.jsonl")) + r", line 2: not UTF-8 text \(byte 0xff", err
    ), err


def test_plots_that_is_a_file_is_refused_and_kept(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, b'{"kind":"train","step":1,"loss":1.0}\n')
    (run_dir / "plots").write_text("mine")
    err = _refused(run_dir, capsys)
    assert re.search(re.escape(str(run_dir / "plots")) + r" is a file, not a folder", err), err
    assert (run_dir / "plots").read_text() == "mine"


def test_torn_last_line_is_skipped_and_the_run_plotted(tmp_path, capsys):
    """A live run's record being written (no newline yet) is not an error."""
    run_dir = _run_dir(
        tmp_path,
        b'{"kind":"train","step":1,"loss":2.0}\n{"kind":"train","step":2,"loss":"nan"}\n'
        b'{"kind":"train","st',
    )
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert main([str(run_dir)]) == 0
    assert {p.name for p in (run_dir / "plots").iterdir()} == {"loss.png", "lr.png"}
    capsys.readouterr()


def test_a_bad_line_before_the_last_is_not_skipped(tmp_path):
    """Only the last line may be torn: an undecodable line in the middle is refused."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"kind":"train","step":1,"loss":2.0}\n{"kind":"tr\n{"kind":"train"}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2: not JSON"):
        read_metrics(path)


def test_a_resume_from_an_older_checkpoint_replaces_the_replayed_steps(tmp_path):
    """Steps 1-4 logged, the run killed, resumed from the step-2 checkpoint: steps 3-4 come
    again with other losses. The curve is the run's last timeline (1, 2, then the new 3, 4,
    5), not a line that jumps back from 4 to 3."""
    import json

    from shardwork.trainer.observe.plot import plot_run

    losses = [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.4), (3, 3.0), (4, 2.9), (5, 2.8)]
    lines = [json.dumps({"kind": "train", "step": s, "loss": v, "lr": 1e-3}) for s, v in losses]
    lines.append(json.dumps({"kind": "valid", "step": 4, "loss": 3.3}))
    lines.insert(4, json.dumps({"kind": "valid", "step": 4, "loss": 3.45}))
    run_dir = _run_dir(tmp_path, ("\n".join(lines) + "\n").encode())
    figures = {}
    real_save = Figure.savefig

    def keep(fig, path, **kwargs):
        figures[Path(path).name] = fig
        return real_save(fig, path, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", keep)
        plot_run(run_dir)
    train_line, valid_line = figures["loss.png"].axes[0].lines[:2]
    assert list(train_line.get_xdata()) == [1, 2, 3, 4, 5]
    assert list(train_line.get_ydata()) == [5.0, 4.0, 3.0, 2.9, 2.8]
    assert list(valid_line.get_ydata()) == [3.3]


def test_help_is_an_answer_and_a_missing_folder_is_named(tmp_path, capsys):
    assert main(["--help"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: shardwork-plot RUN_DIR") and captured.err == ""
    assert main([]) == 2 and capsys.readouterr().err.startswith("usage: shardwork-plot")
    missing = tmp_path / "nowhere"
    assert main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"shardwork-plot: RUN_DIR={str(missing)!r} is not a directory\n"
    assert not missing.exists()


def test_a_folder_holding_only_set_aside_logs_names_them(tmp_path, capsys):
    # a fresh run moved the earlier ones aside (observe/earlier_run.py) and logged nothing yet
    for number in (1, 2):
        (tmp_path / f"metrics.{number}.jsonl").write_text('{"kind":"train","step":1,"loss":2}\n')
    err = _refused(tmp_path, capsys)
    assert "set aside by a later run (metrics.1.jsonl, metrics.2.jsonl)" in err
    assert "rename one to metrics.jsonl to plot that run" in err
    (tmp_path / "metrics.1.jsonl").unlink()
    (tmp_path / "metrics.2.jsonl").unlink()
    assert "has no metrics.jsonl: is it a shardwork run?" in _refused(tmp_path, capsys)
