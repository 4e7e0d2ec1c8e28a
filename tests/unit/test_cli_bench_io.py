"""`tangram bench` and the standard streams: a trace on the standard input, where its plot
goes (never beside a file that is not a regular one), --plot's folder, and a standard
output that cannot be written."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tangram.cli.bench import _plot_path
from tangram.cli.main import main

TRACE = (
    '{"version": 1, "id": "a", "steps": [{"think_s": 1, "action": {"kind": "exec", "t1_s": 2}}]}\n'
)


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{name: n0, cpus: 4, memory_gb: 8}]\n")
    return path


def test_a_trace_on_the_standard_input_is_replayed_without_a_default_plot(
    tmp_path: Path,
    cluster: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(TRACE))
    code = main(["bench", "--trace", "-", "--cluster", str(cluster), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["trajectories"] == 1 and "plot" not in report
    assert "no plot: the standard input is not a regular file" in err
    assert not list(tmp_path.glob("*.png"))


def test_plot_creates_its_folder_as_out_does(
    tmp_path: Path,
    cluster: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(TRACE))
    plot = tmp_path / "missing2" / "deeper" / "p.png"
    code = main(["bench", "--trace", "-", "--cluster", str(cluster), "--plot", str(plot)])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert plot.is_file()


def test_no_default_plot_beside_a_file_that_is_not_a_regular_one(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)  # as /dev/stdin or a process substitution: no folder of its own
    args = argparse.Namespace(trace=str(fifo), plot=None, no_plot=False)
    assert _plot_path(args) is None
    regular = tmp_path / "t.jsonl"
    regular.write_text(TRACE)
    args = argparse.Namespace(trace=str(regular), plot=None, no_plot=False)
    assert _plot_path(args) == str(tmp_path / "t.act.png")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_standard_output_that_cannot_be_written_is_said_without_a_traceback(
    tmp_path: Path, cluster: Path
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    argv = ["bench", "--trace", str(trace), "--cluster", str(cluster), "--json", "--no-plot"]
    code = f"import sys; from tangram.cli.main import main; sys.exit(main({argv!r}))"
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-c", code],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert "cannot write the report to the standard output: No space left" in done.stderr


def test_a_reader_that_left_still_gets_the_out_file_written(tmp_path: Path, cluster: Path) -> None:
    """``tangram bench ... --out r.json | head -1``: the broken pipe ended the command
    before ``--out`` was written (a full disk did write it)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    out = tmp_path / "r.json"
    argv = ["bench", "--trace", str(trace), "--cluster", str(cluster), "--json", "--no-plot",
            "--out", str(out)]  # fmt: skip
    code = f"import sys; from tangram.cli.main import main; sys.exit(main({argv!r}))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before the report is printed
    err = proc.stderr.read()
    assert proc.wait(120) == 141, err  # (a guard only)
    assert "Traceback" not in err
    assert json.loads(out.read_text())["policies"]
