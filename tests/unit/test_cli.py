"""The ``tangram`` command line: its contracts (docs/architecture.md) and errors that name
the input."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from tangram.cli import seed_runs
from tangram.cli.bench import run_round_bench
from tangram.cli.main import main
from tangram.service.embedded import free_port

STATE = {
    "cluster": {"nodes": [{"name": "n0", "cpus": 8, "memory_gb": 64}]},
    "now": 10.0,
    "trajectories": [{"id": "t1", "node": "n0"}, {"id": "t2", "node": "n0"}],
    "running": [
        {
            "id": "r1",
            "trajectory": "t1",
            "units": 6,
            "started_s": 9.0,
            "action": {"kind": "exec", "cpu": 6, "t1_s": 2.0},
        }
    ],
    "queue": [
        {
            "id": "a1",
            "trajectory": "t2",
            "submitted_s": 9.5,
            "action": {
                "kind": "exec",
                "cpu": {"min": 1, "max": 8},
                "t1_s": 100,
                "efficiency": {"amdahl": 0.95},
            },
        }
    ],
}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # main returns its status: this one escaped (uvicorn's, say)
        escaped = e.code
    else:
        out, err = capsys.readouterr()
        return code, out, err
    pytest.fail(f"tangram {argv[0]}: SystemExit({escaped}) escaped main, with its traceback")


def test_trace_generate_then_bench_prints_the_contract(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, cluster, plot = tmp_path / "t.jsonl", tmp_path / "c.yaml", tmp_path / "act.png"
    code, _, _ = _run(
        capsys,
        "trace",
        "generate",
        "--scenario",
        "coding",
        "--trajectories",
        "16",
        "--seed",
        "1",
        "-o",
        str(trace),
        "--cluster-out",
        str(cluster),
    )
    assert code == 0
    assert len(trace.read_text().splitlines()) == 16
    code, out, _ = _run(
        capsys,
        "bench",
        "--trace",
        str(trace),
        "--cluster",
        str(cluster),
        "--policy",
        "elastic,fixed-dop-4,k8s-static",
        "--json",
        "--plot",
        str(plot),
    )
    assert code == 0
    report = json.loads(out)
    assert set(report["policies"]) == {"elastic", "fixed-dop-4", "k8s-static"}
    for figures in report["policies"].values():
        for key in ("avg_act_s", "p99_act_s", "avg_traj_act_s", "makespan_s", "unit_seconds"):
            assert figures[key] > 0
    assert report["avg_act_ratio_vs_elastic"]["elastic"] == 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_cluster = tmp_path / "c.yaml"
    bad_cluster.write_text("nodes:\n  - name: a\n    cpus: -1\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"version":1,"id":"x","steps":[{"action":{"kind":"exec","cpu":{"min":2,"max":1}}}]}\n'
    )
    code, _, err = _run(capsys, "bench", "--trace", str(trace), "--cluster", str(bad_cluster))
    assert code == 2 and "line 1: steps.0.action.cpu: min (2) is greater than max (1)" in err
    trace.write_text('{"version":1,"id":"x","steps":[{"action":{"kind":"exec"}}]}\n')
    code, _, err = _run(capsys, "bench", "--trace", str(trace), "--cluster", str(bad_cluster))
    assert code == 2 and "nodes.0.cpus" in err
    code, _, err = _run(
        capsys, "bench", "--trace", str(trace), "--cluster", str(bad_cluster), "--policy", "fifo"
    )
    assert code == 2 and "--policy" in err and "unknown" in err
    code, _, err = _run(
        capsys, "bench", "--trace", str(tmp_path / "missing.jsonl"), "--cluster", str(bad_cluster)
    )
    assert code == 2 and "missing.jsonl" in err
    code, _, err = _run(capsys, "trace", "generate", "--scenario", "coding", "--trajectories", "0")
    assert code == 2 and "--trajectories" in err


def test_explain_shows_candidates_eviction_and_allocation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps(STATE))
    code, out, _ = _run(capsys, "explain", str(state), "--json")
    assert code == 0
    decision = json.loads(out)
    (group,) = decision["groups"]
    assert group["resource"] == "cpu:n0" and group["candidates"] == ["a1"] and group["elastic"]
    # The paper's estimate (depth 2) only foresees waiting for 1 or 2 units, so starting now
    # on the 2 free cores is as good as waiting: it starts.
    (asg,) = decision["assignments"]
    assert asg["units"] == 2 and len(asg["cores"]) == 2
    steps = group["eviction_steps"]
    assert [s["kept"] for s in steps] == [1, 0]
    assert steps[1]["objective_s"] >= steps[0]["objective_s"]
    # Exploring doubling counts, it sees r1 free 6 cores in 1 s and waits for all 8.
    state.write_text(json.dumps({**STATE, "config": {"explore": "doubling"}}))
    code, out, _ = _run(capsys, "explain", str(state), "--json")
    decision = json.loads(out)
    assert decision["assignments"] == []
    steps = decision["groups"][0]["eviction_steps"]
    assert steps[1]["objective_s"] < steps[0]["objective_s"]
    assert decision["waiting"][0]["action"] == "a1"
    code, out, _ = _run(capsys, "explain", str(state))
    assert code == 0 and "greedy eviction" in out


def test_explain_rejects_a_bad_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state.json"
    state.write_text(
        json.dumps(
            {
                **STATE,
                "queue": [
                    {"id": "a", "trajectory": "t9", "submitted_s": 0, "action": {"kind": "exec"}}
                ],
            }
        )
    )
    code, _, err = _run(capsys, "explain", str(state))
    assert code == 2 and "t9" in err and "not open" in err


def test_round_bench_reports_every_case() -> None:
    report = run_round_bench(
        [(16, 32, 4, False), (16, 32, 4, True)],
        rounds=5,
        progress=False,
        gc_settings="default",
        gpu_cases=[(8, 32), (16, 64)],
        quota_cases=[(32, "hold"), (32, "pass")],
    )
    assert [c["elastic"] for c in report["cases"]] == [False, True]
    assert [(c["gpus"], c["queued"]) for c in report["gpu_cases"]] == [(8, 32), (16, 64)]
    assert [(c["queued"], c["quota_waiting"]) for c in report["quota_cases"]] == [
        (32, "hold"),
        (32, "pass"),
    ]
    assert report["gc"] == "default"
    for case in report["cases"]:
        assert set(case) >= {"cores", "queued", "candidates", "elastic", "p50_ms", "p99_ms"}
    for case in report["cases"] + report["gpu_cases"] + report["quota_cases"]:
        assert 0 < case["p50_ms"] <= case["p99_ms"]
        assert case["rounds"] == 5


def test_round_bench_times_rounds_under_the_services_collector_settings() -> None:
    import gc

    threshold = gc.get_threshold()
    try:
        report = run_round_bench(
            [(16, 32, 4, False)], rounds=3, progress=False, gpu_cases=[], quota_cases=[]
        )
        assert report["gc"] == "service"
        assert gc.get_threshold() == (10_000, 20, 100)  # what the service sets (quiet_gc)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def _seeds_bench(
    capsys: pytest.CaptureFixture[str], out: Path, *args: str
) -> tuple[dict[str, Any], str]:
    """Run a ``*-seeds`` benchmark writing its report to ``out``: the report, and the printed
    table, which is the one written next to it (docs/benchmarks.md cites that)."""
    code, table, _ = _run(capsys, "bench", *args, "--out", str(out))
    assert code == 0
    assert table == out.with_suffix(".md").read_text()
    report: dict[str, Any] = json.loads(out.read_text())
    return report, table


def test_coding_seeds_replays_every_batch_and_seed_and_reports_the_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "seeds.json"
    report, table = _seeds_bench(
        capsys, out, "coding-seeds", "--batches", "8,16,8", "--seeds", "3,4", "--jobs", "2"
    )
    assert list(report["batches"]) == ["8", "16"]
    for row in report["batches"].values():
        assert list(row["seeds"]) == ["3", "4"]
        ratios = []
        for v in row["seeds"].values():
            act = v["avg_act_s"]
            best = min(act["fixed-dop-4"], act["fixed-dop-16"])
            assert v["elastic_vs_best_fixed"] == pytest.approx(act["elastic"] / best, abs=1e-4)
            load = act["elastic-load"] / best  # the rule without the return term, same run
            assert v["load_vs_best_fixed"] == pytest.approx(load, abs=1e-4)
            cp = act["k8s-static-cp"] / act["elastic"]
            assert v["k8s_cp_over_elastic"] == pytest.approx(cp, abs=1e-3)
            # Batches under the bucket's burst (100 pods) are bound at once: no wait at all.
            assert act["k8s-static-cp"] == act["k8s-static"]
            ratios.append(v["elastic_vs_best_fixed"])
        spread = row["elastic_vs_best_fixed"]
        assert (spread["min"], spread["max"]) == (min(ratios), max(ratios))
    assert "| 16 | spread |" in table
    code, _, err = _run(capsys, "bench", "coding-seeds", "--seeds", "a,b")
    assert code == 2 and "--seeds" in err
    code, _, err = _run(capsys, "bench", "coding-seeds", "--out", str(tmp_path / "t.md"))
    assert code == 2 and "--out" in err and "JSON" in err


def test_bench_gpu_seeds_reports_each_seed_and_the_fewest_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu.json"
    report, _ = _seeds_bench(
        capsys, out, "gpu-seeds", "--batches", "16", "--seeds", "0,1",
        "--mixed-batch", "16", "--jobs", "2",
    )  # fmt: skip
    for v in report["mopd"]["16"].values():
        act, gpu = v["service_act_s"], v["gpu_s"]
        assert set(act) == {"elastic", "elastic-unbatched", "static-gpu"}
        assert v["act_vs_static"] == pytest.approx(act["elastic"] / act["static-gpu"], abs=1e-4)
        assert v["gpu_s_vs_static"] == pytest.approx(gpu["elastic"] / gpu["static-gpu"], abs=1e-3)
    assert report["mixed"]["batch"] == 16 and list(report["mixed"]["seeds"]) == ["0", "1"]
    for v in report["mixed"]["seeds"].values():
        fewest = v["fewest_gpus_matching_static"]
        matching = [int(g) for g, s in v["pooled_s"].items() if s <= v["static_40_s"]]
        assert fewest == (min(matching) if matching else None)
    assert report["command"].endswith("--mixed-batch 16 --out " + str(out))


def test_bench_gpu_seeds_replays_with_the_restore_cost_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tangram.cli.bench_gpu_seeds import _replay

    job = ("mopd", 16, 0, "elastic-unbatched", None)  # every call restores its instance
    assumed = _replay(job)["avg_act_service_s"]
    measured = _replay(job, restore_gbps=44.4, restore_fixed_s=0.1)["avg_act_service_s"]
    assert measured < assumed
    for flag, value in (("--restore-gbps", "0"), ("--restore-gbps", "nan"),
                        ("--restore-fixed-s", "-1"), ("--restore-fixed-s", "inf")):  # fmt: skip
        code, _, err = _run(capsys, "bench", "gpu-seeds", flag, value)
        assert code == 2 and flag in err, err
    code, _, err = _run(capsys, "bench", "coding-seeds", "--restore-gbps", "44.4")
    assert code == 2 and "--restore-gbps" in err and "gpu-seeds" in err, err


def test_bench_search_seeds_counts_the_points_each_policy_meets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Batch 256, seeds 0-1: contended enough that some policies meet the target at both
    # seeds, some at one and some at none, so a wrong count or rule shows.
    report, table = _seeds_bench(
        capsys, tmp_path / "search.json", "search-seeds", "--batches", "256", "--seeds", "0,1",
        "--jobs", "2",
    )  # fmt: skip
    assert report["hint_sigmas"]["elastic-shortest-hinted-0"] == 0.0
    batch = report["deepsearch"]["256"]
    assert list(batch["seeds"]) == ["0", "1"]
    for policy, s in batch["policies"].items():
        met = 0
        for row in batch["seeds"].values():
            avg, p99 = row["avg_act_s"], row["p99_act_s"]
            meets = (
                row["failed"][policy] == 0
                and avg[policy] <= avg["unmanaged"]
                and p99[policy] < p99["unmanaged"]
            )
            assert row["meets"][policy] == meets
            met += meets
        assert (s["met"], s["of"]) == (met, 2)
        ratios = [
            r["avg_act_s"][policy] / r["avg_act_s"]["unmanaged"] for r in batch["seeds"].values()
        ]
        assert s["mean_vs_unmanaged"]["min"] == pytest.approx(min(ratios), abs=1e-3)
        assert s["mean_vs_unmanaged"]["max"] == pytest.approx(max(ratios), abs=1e-3)
    assert {s["met"] for s in batch["policies"].values()} == {0, 1, 2}  # the rule was tested
    assert "| 256 | hinted, σ 0.6 |" in table


def test_the_readme_explain_example_shows_an_eviction(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "explain" / "waiting.json"
    code, out, _ = _run(capsys, "explain", str(example), "--json")
    assert code == 0
    decision = json.loads(out)
    # Holding back the 0.2 s shell command gives the 120 s test suite a third core.
    assert [a["action"] for a in decision["assignments"]] == ["reward-t2"]
    assert decision["assignments"][0]["units"] == 3
    assert decision["waiting"][0]["action"] == "ls-t3"


def test_errors_found_late_are_found_first_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - name: a\n    cpus: 4\n    memory_gb: 8\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"version":1,"id":"x","steps":[{"action":{"kind":"exec","t1_s":1}},'
        '{"action":{"kind":"service","service":"judge","t1_s":1}}]}\n'
    )
    code, _, err = _run(
        capsys,
        "bench",
        "--trace",
        str(trace),
        "--cluster",
        str(cluster),
        "--policy",
        "elastic,static-gpu",
    )
    assert code == 2 and "trajectory x, step 1: service 'judge'" in err
    code, _, err = _run(
        capsys, "bench", "--trace", str(trace), "--cluster", str(cluster), "--seed", "-1"
    )
    assert code == 2 and "--seed" in err
    trace.write_bytes(b'{"version":1,"id":"\xff"}\n')
    code, _, err = _run(capsys, "bench", "--trace", str(trace), "--cluster", str(cluster))
    assert code == 2 and "not UTF-8" in err
    code, _, err = _run(
        capsys, "trace", "generate", "--scenario", "coding", "--trajectories", "2", "--seed", "-3"
    )
    assert code == 2 and "--seed" in err
    code, _, err = _run(
        capsys,
        "trace",
        "generate",
        "--scenario",
        "coding",
        "--trajectories",
        "2",
        "-o",
        str(tmp_path / "missing-dir" / "t.jsonl"),
    )
    assert code == 2 and "--out: cannot write" in err


def test_the_act_plot_is_drawn_next_to_the_trace_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, cluster = tmp_path / "t.jsonl", tmp_path / "c.yaml"
    _run(
        capsys,
        "trace",
        "generate",
        "--scenario",
        "coding",
        "--trajectories",
        "4",
        "-o",
        str(trace),
        "--cluster-out",
        str(cluster),
    )
    code, out, err = _run(
        capsys, "bench", "--trace", str(trace), "--cluster", str(cluster), "--json"
    )
    assert code == 0
    assert json.loads(out)["plot"] == str(tmp_path / "t.act.png")
    assert f"wrote {tmp_path / 't.act.png'}" in err  # (said nowhere but in the JSON)
    assert (tmp_path / "t.act.png").read_bytes()[:4] == b"\x89PNG"
    code, _, err = _run(
        capsys,
        "bench",
        "--trace",
        str(trace),
        "--cluster",
        str(cluster),
        "--plot",
        str(trace / "dir.png"),  # (a missing folder is created, as --out's: a file is not)
    )
    assert code == 2 and "--plot: cannot write" in err and "Not a directory" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["up", "-f", "x", "--cores", "-2"], "argument --cores: must be at least 1, got -2"),
        (["up", "-f", "x", "--port", "70000"], "argument --port: 70000 is not a TCP port"),
        (["up", "-f", "x", "--grace", "nan"], "argument --grace: nan is not a number"),
        (["serve", "-f", "x", "--port", "0"], "argument --port: must be at least 1, got 0"),
        (
            ["agent", "--scheduler", "ws://x", "--idle-cores", "0"],
            "--idle-cores: must be at least 1, got 0",
        ),
        (["agent", "--scheduler", "ws://x", "--cores", "two"], "--cores: 'two' is not an integer"),
    ],
)
def test_bad_numbers_on_the_command_line_are_usage_errors_naming_the_flag(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert said in err and "Traceback" not in err


def test_without_a_service_the_client_and_the_example_say_so_in_one_line() -> None:
    import subprocess
    import sys

    from tangram.client import Client, ServiceUnreachableError
    from tangram.service.embedded import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with (
        Client(url, "t" * 24, retries=1, backoff_s=0.01) as client,
        pytest.raises(ServiceUnreachableError, match=f"cannot reach .* at {url}"),
    ):
        client.open("sandbox")
    example = Path(__file__).resolve().parents[2] / "examples" / "rollout.py"
    done = subprocess.run([sys.executable, str(example), "--url", url, "-n", "1"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith(f"rollout: cannot reach the ARL-Tangram service at {url}")
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_explain_replays_shortest_remainings_ageing_by_the_recent_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One core; "long" (50 steps left) waited since 0, "short" (1 step left) since 9. With no
    # recent wait "long" is overdue at 10 (deadline 0 + 4 x its 1 s) and goes first; after
    # a scheduler saw 10 s waits, its deadline is 0 + 2 x 10 s: least work first again.
    one = {"kind": "exec", "cpu": 1, "t1_s": 1.0}
    state = {
        "cluster": {"nodes": [{"name": "n0", "cpus": 1, "memory_gb": 64}]},
        "config": {"ordering": "shortest-remaining"},
        "now": 10.0,
        "trajectories": [
            {"id": "long", "node": "n0", "hint_steps": 50},
            {"id": "short", "node": "n0", "hint_steps": 1},
        ],
        "queue": [
            {"id": "l", "trajectory": "long", "submitted_s": 0.0, "action": one},
            {"id": "s", "trajectory": "short", "submitted_s": 9.0, "action": one},
        ],
    }
    path = tmp_path / "state.json"
    started = []
    for recent in (0.0, 10.0):
        path.write_text(json.dumps({**state, "recent_wait_s": recent}))
        code, out, _ = _run(capsys, "explain", str(path), "--json")
        assert code == 0
        started.append([a["action"] for a in json.loads(out)["assignments"]])
    assert started == [["l"], ["s"]]
    path.write_text(json.dumps({**state, "recent_wait_s": -1}))
    code, _, err = _run(capsys, "explain", str(path))
    assert code == 2 and "recent_wait_s" in err


def _small_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    trace, cluster = tmp_path / "t.jsonl", tmp_path / "c.yaml"
    code, _, _ = _run(
        capsys, "trace", "generate", "--scenario", "coding", "--trajectories", "2",
        "-o", str(trace), "--cluster-out", str(cluster),
    )  # fmt: skip
    assert code == 0
    return trace, cluster


def test_bench_checks_its_output_paths_before_replaying(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, cluster = _small_replay(tmp_path, capsys)

    def no_replay(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("replayed before the output paths were checked")

    monkeypatch.setattr("tangram.cli.bench.replay_all", no_replay)
    monkeypatch.setattr("tangram.cli.bench_seeds.run_jobs", no_replay)
    argv = ["bench", "--trace", str(trace), "--cluster", str(cluster)]
    code, _, err = _run(capsys, *argv, "--plot", str(tmp_path / "act.txt"))
    assert code == 2 and "tangram: error: --plot:" in err and ".png" in err
    (tmp_path / "r.md").mkdir()  # where the table of --out r.json would go
    code, _, err = _run(capsys, "bench", "coding-seeds", "--out", str(tmp_path / "r.json"))
    assert code == 2 and f"--out: cannot write {tmp_path / 'r.md'}" in err
    code, _, err = _run(capsys, "bench", "coding-seeds", "--out", str(trace / "r.json"))
    assert code == 2 and "--out: cannot write" in err and "Not a directory" in err


def test_a_plot_or_table_failing_at_the_end_warns_and_keeps_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, cluster = _small_replay(tmp_path, capsys)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tangram.cli.plots.act_cdf", disk_full)
    code, out, err = _run(capsys, "bench", "--trace", str(trace), "--cluster", str(cluster),
                          "--policy", "elastic", "--json")  # fmt: skip
    assert code == 0 and "warning: --plot" in err and "No space left" in err
    report = json.loads(out)
    assert "plot" not in report and report["policies"]["elastic"]["actions"] > 0
    # The table's path is fine when checked, then cannot be written at the end.
    monkeypatch.setattr(seed_runs, "check_writable", lambda *a, **k: None, raising=False)
    out_json = tmp_path / "seeds.json"
    out_json.with_suffix(".md").mkdir()
    code, table, err = _run(capsys, "bench", "coding-seeds", "--batches", "8", "--seeds", "0",
                            "--jobs", "1", "--out", str(out_json))  # fmt: skip
    assert code == 0 and "warning: --out: cannot write" in err
    assert json.loads(out_json.read_text())["batches"]["8"]["seeds"]["0"]
    assert "| 8 | 0 |" in table


LOCAL_POOL = str(Path(__file__).resolve().parents[2] / "manifests" / "examples" / "local")


def _up(tmp_path: Path, port: int) -> list[str]:
    state, tokens = str(tmp_path / "state"), str(tmp_path / "tokens")
    return ["up", "-f", LOCAL_POOL, "--port", str(port), "--runtime", "noop",
            "--state-dir", state, "--token-file", tokens]  # fmt: skip


def _spy_on_agent_shutdowns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The nodes of the agents shut down (what removes their cgroups and containers)."""
    from tangram.node_agent.agent import NodeAgent

    stopped: list[str] = []
    shutdown = NodeAgent.shutdown

    async def spy(agent: NodeAgent) -> None:
        stopped.append(agent.node)
        await shutdown(agent)

    monkeypatch.setattr(NodeAgent, "shutdown", spy)
    return stopped


def test_a_port_in_use_is_one_line_naming_it_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_agent(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an agent was built for a port that cannot be served")

    monkeypatch.setattr("tangram.cli.up.make_agent", no_agent)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv in (
            _up(tmp_path, port),
            ["serve", "-f", LOCAL_POOL, "--port", str(port),
             "--token-file", str(tmp_path / "tokens")],
        ):  # fmt: skip
            code, _, err = _run(capsys, *argv)
            assert (code, err) == (2, f"tangram: error: --port {port}: address already in use\n")
    assert not (tmp_path / "tokens").exists()


def test_a_failed_start_after_the_agent_is_built_shuts_the_agent_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped = _spy_on_agent_shutdowns(monkeypatch)
    # The port taken between the early check and the server's own bind: uvicorn's exit.
    monkeypatch.setattr("tangram.cli.up.check_listen", lambda host, port: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = _run(capsys, *_up(tmp_path, port))
    assert code == 2
    assert (
        err.splitlines()[-1] == f"tangram: error: --port {port}: the server could not listen there"
    )
    assert len(stopped) == 1
    # Serving, then failing before the embedded run's own shutdown is reached.

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("broken reload handler")

    monkeypatch.setattr("tangram.cli.up.reload_on_hangup", broken)
    with pytest.raises(RuntimeError, match="broken reload handler"):
        main(_up(tmp_path, free_port()))
    assert len(stopped) == 3  # (the run's own stop and the CLI's both shut it down: harmless)


def test_up_refuses_a_token_file_without_an_agent_token_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped = _spy_on_agent_shutdowns(monkeypatch)
    tokens = tmp_path / "tokens"
    tokens.write_text("abcdefghijklmnopqrstuvwx alice\n")
    tokens.chmod(0o600)  # (one every user can read is warned of first)
    code, _, err = _run(capsys, *_up(tmp_path, free_port()))
    assert code == 2
    said = f"--token-file {tokens}: no system:agent line (the local agent's token)"
    assert err == f"tangram: error: {said}\n"
    assert stopped == [] and not (tmp_path / "state").exists()  # no agent was built


def test_the_agent_only_reads_its_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped = _spy_on_agent_shutdowns(monkeypatch)

    async def link_fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the scheduler link failed")

    monkeypatch.setattr("tangram.node_agent.link.serve", link_fails)
    missing = tmp_path / "tokenz"  # a typo: made here, its token would be refused for ever
    argv = ["agent", "--scheduler", "ws://127.0.0.1:9/v1/agents", "--runtime", "noop",
            "--state-dir", str(tmp_path / "state"), "--token-file", str(missing)]  # fmt: skip
    code, _, err = _run(capsys, *argv)
    assert (code, err) == (2, f"tangram: error: --token-file {missing}: no such file\n")
    assert not missing.exists() and stopped == []
    # A link that fails leaves no agent running either.
    missing.write_text("abcdefghijklmnopqrstuvwx system:agent\n")
    with pytest.raises(RuntimeError, match="link failed"):
        main(argv)
    assert len(stopped) == 1


def test_the_client_takes_no_system_tenants_token_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tangram.client.common import settings

    tokens = tmp_path / "tokens"
    tokens.write_text(
        "# tokens\n" + "o" * 22 + " system:operator\n" + "a" * 22 + " system:agent\n"
        + "c" * 22 + " local\n"
    )  # fmt: skip
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(tokens))
    assert settings("http://x", None) == ("http://x", "c" * 22)
    tokens.write_text("o" * 22 + " system:operator\n")
    assert settings("http://x", None) == ("http://x", None)


def test_up_refuses_a_state_directory_another_agent_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second `tangram up` on the default state directory (only --port differs) would
    take the first one's environments for leftovers and remove them at exit."""
    from tangram.node_agent import state_lock

    held = state_lock.hold(tmp_path / "state")  # the first one's agent
    try:
        code, _, err = _run(capsys, *_up(tmp_path, free_port()))
    finally:
        state_lock.release(held)
    assert code == 2
    assert err.endswith(
        f"tangram: error: --state-dir {tmp_path / 'state'} is in use by another agent "
        f"(pid {os.getpid()}); give each agent its own state directory\n"
    )


def test_trace_generate_checks_both_outputs_before_writing_either(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    argv = ["trace", "generate", "--scenario", "coding", "--trajectories", "2", "-o", str(trace)]
    code, _, err = _run(capsys, *argv, "--cluster-out", str(tmp_path / "no" / "c.yaml"))
    assert code == 2 and "--cluster-out: cannot write" in err
    assert not trace.exists()  # nothing written: the cluster's path was bad
    code, _, err = _run(capsys, *argv, "--cluster-out", str(trace))
    assert code == 2 and "is the --out file too" in err and not trace.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "generate", "--scenario", "coding", "--trajectories", "4"],
        ["explain", "examples/explain/waiting.json", "--json"],
    ],
)
def test_a_reader_that_left_ends_the_command_without_a_traceback(argv: list[str]) -> None:
    """``tangram … | head`` (here: a pipe whose reader is gone) printed BrokenPipeError's
    traceback and exited 1."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    root = Path(__file__).resolve().parents[2]
    code = "import sys; from tangram.cli.main import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, *argv], stdout=write, cwd=root,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False)  # fmt: skip
    os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_up_refuses_a_learned_file_it_could_not_save_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory given as --learned-file: it served, and only logged that it could not
    read or save the file."""
    from tangram.service.embedded import free_port

    pool = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "local"
    code, _, err = _run(
        capsys, "up", "-f", str(pool), "--runtime", "noop", "--cores", "2",
        "--port", str(free_port()), "--state-dir", str(tmp_path / "state"),
        "--token-file", str(tmp_path / "tokens"), "--learned-file", str(tmp_path),
    )  # fmt: skip
    assert code == 2
    assert f"--learned-file: cannot write {tmp_path}: Is a directory" in err


def test_the_banners_client_hint_names_a_token_file_the_client_would_not_find(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tangram.cli.up import _tokens_env
    from tangram.client.common import DEFAULT_TOKEN_FILE

    monkeypatch.delenv("TANGRAM_TOKEN_FILE", raising=False)
    assert _tokens_env(str(DEFAULT_TOKEN_FILE)) == ""
    # (the hint was the default's, and the example, run as told, got 401)
    assert _tokens_env("/tmp/a b/tokens") == "TANGRAM_TOKEN_FILE='/tmp/a b/tokens' "


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.startswith("tangram ") and len(out.split()) >= 2
