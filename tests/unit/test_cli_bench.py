"""`tangram bench`: what a Ctrl-C leaves, --out for a replay, options of another mode
refused, --depth's range, and a table that never cuts a policy's name."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tangram.cli import bench
from tangram.cli.bench import APPLIES, replay_table
from tangram.cli.files import Interrupted
from tangram.cli.main import build_parser, main
from tangram.cli.seed_runs import run_jobs
from tangram.sim.policies import simulate


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    trace, cluster = tmp_path / "t.jsonl", tmp_path / "c.yaml"
    code, _, _ = _run(
        capsys, "trace", "generate", "--scenario", "coding", "--trajectories", "4",
        "-o", str(trace), "--cluster-out", str(cluster),
    )  # fmt: skip
    assert code == 0
    return ["bench", "--trace", str(trace), "--cluster", str(cluster), "--no-plot"]


def test_ctrl_c_during_a_replay_reports_the_policies_that_finished(
    replay: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def ctrl_c_in_fixed_dop_4(trace: Any, cluster: Any, policy: str, **kw: Any) -> Any:
        if policy == "fixed-dop-4":
            raise KeyboardInterrupt  # where a Ctrl-C lands: inside a replay
        return simulate(trace, cluster, policy, **kw)

    monkeypatch.setattr(bench, "simulate", ctrl_c_in_fixed_dop_4)
    policies = ["--policy", "elastic,k8s-static,fixed-dop-4,fixed-dop-16"]
    out_json = tmp_path / "r.json"
    code, out, err = _run(capsys, *replay, *policies, "--json", "--out", str(out_json))
    assert code == 130
    assert "interrupted during fixed-dop-4; finished: elastic, k8s-static" in err
    report = json.loads(out)
    assert list(report["policies"]) == ["elastic", "k8s-static"]
    assert report["interrupted_during"] == "fixed-dop-4"
    assert json.loads(out_json.read_text())["policies"] == report["policies"]
    code, out, err = _run(capsys, *replay, *policies)  # the table: the finished rows
    assert code == 130 and "elastic" in out and "k8s-static" in out and "fixed-dop" not in out
    # Interrupted in the first policy: nothing finished, and it says so.
    code, out, err = _run(capsys, *replay, "--policy", "fixed-dop-4,elastic")
    assert (code, out) == (130, "")
    assert err == "tangram: interrupted during fixed-dop-4; finished: none\n"
    # --out is written all the same (it was not): no policy, and where it stopped.
    out_json.unlink()
    code, out, err = _run(
        capsys, *replay, "--policy", "fixed-dop-4,elastic", "--out", str(out_json)
    )
    assert (code, out) == (130, "") and "finished: none" in err
    written = json.loads(out_json.read_text())
    assert (written["policies"], written["interrupted_during"]) == ({}, "fixed-dop-4")
    code, out, err = _run(capsys, *replay, "--policy", "fixed-dop-4", "--json")
    assert code == 130 and json.loads(out)["policies"] == {}


def _ctrl_c_at_the_second(job: int, result: int) -> str:
    if job == 2:
        raise KeyboardInterrupt
    return f"job {job}: {result}"


def test_ctrl_c_during_seed_replays_says_how_many_finished() -> None:
    try:
        with pytest.raises(Interrupted, match=r"interrupted after 2 of 3 replays \(each one's"):
            run_jobs(abs, [1, 2, 3], 1, _ctrl_c_at_the_second)
    except KeyboardInterrupt:  # (would stop the whole test run)
        pytest.fail("the Ctrl-C left run_jobs as it came, saying nothing of what finished")


def test_out_writes_a_replays_report(
    replay: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "deep" / "r.json"
    code, _, err = _run(capsys, *replay, "--policy", "elastic,k8s-static", "--out",
                          str(out_json))  # fmt: skip
    assert code == 0 and f"wrote {out_json}" in err
    report = json.loads(out_json.read_text())
    assert list(report["policies"]) == ["elastic", "k8s-static"]
    assert report["policies"]["elastic"]["actions"] > 0


def test_options_of_another_mode_are_refused_naming_them(
    replay: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, flags, mode in (
        ([*replay, "--quick", "--trajectories", "5", "--batches", "8"],
         "--quick, --batches, --trajectories", "a trace replay"),
        (["bench", "scheduler", "--trace", "t.jsonl", "--depth", "3"],
         "--trace, --depth", "bench scheduler"),
        (["bench", "coding-seeds", "--policy", "k8s-static"], "--policy", "bench coding-seeds"),
    ):  # fmt: skip
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == ""
        assert err.startswith(f"tangram: error: {flags}: not options of {mode} ("), err
    code, _, err = _run(capsys, *replay, "--trajectories", "5")
    assert "--trajectories is for bench service" in err


def test_every_bench_option_names_the_modes_that_read_it() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    p = sub.choices["bench"]  # type: ignore[index]
    dests = {a.dest for a in p._actions if a.option_strings} - {"help"}
    assert dests == set(APPLIES)
    modes = {"*", bench.REPLAY, *next(a for a in p._actions if a.dest == "what").choices}
    assert {m for ms in APPLIES.values() for m in ms} <= modes


def test_depth_is_the_crds_range(replay: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for depth in ("0", "5", "50"):
        code, _, err = _run(capsys, *replay, "--depth", depth)
        assert code == 2 and f"argument --depth: must be 1 to 4, got {depth}" in err


def test_the_replay_table_never_cuts_a_policy_name() -> None:
    names = ["elastic", "elastic-paper", "fixed-dop-4", "fixed-dop-16", "k8s-static"]
    figures = {"avg_act_s": 14.18, "p99_act_s": 471.01, "avg_traj_act_s": 332.18,
               "makespan_s": 1819.14, "unit_seconds": 190055.82}  # fmt: skip
    for width, more in ((80, []), (60, []), (80, ["elastic-priority-doubling-and-more"])):
        report = {"trajectories": 600, "actions": 14052,
                  "policies": dict.fromkeys(names + more, figures)}  # fmt: skip
        console = Console(width=width, file=io.StringIO(), color_system=None)
        console.print(replay_table(report, console))
        text = console.file.getvalue()  # type: ignore[attr-defined]
        assert "…" not in text
        for name in names + more:
            assert f" {name} " in text, text
        assert max(map(len, text.splitlines())) <= width
