"""The simulator: closed-loop replay, the baselines' models, determinism."""

from __future__ import annotations

from typing import Any

import pytest

from tangram.api import ClusterSpec, TrajectoryTrace
from tangram.api.action import ActionKind
from tangram.api.demand import AmdahlEfficiency
from tangram.sim.backends import Overheads, SchedulerBackend, _water_fill, speedup
from tangram.sim.policies import HINT_SIGMA, build, check_policy, simulate
from tangram.sim.tracegen import generate, scenario_cluster

NO_OVERHEAD = Overheads(exec_s=0.0, profile_noise=0.0)


def traj(
    tid: str, steps: list[dict[str, Any]], memory: float = 1.0, arrival: float = 0.0
) -> TrajectoryTrace:
    return TrajectoryTrace.model_validate(
        {"version": 1, "id": tid, "memory_gb": memory, "arrival_s": arrival, "steps": steps}
    )


def cpu_cluster(cpus: int = 4, memory: float = 100.0) -> ClusterSpec:
    return ClusterSpec.model_validate({"nodes": [{"name": "n", "cpus": cpus, "memory_gb": memory}]})


def test_closed_loop_think_then_act() -> None:
    steps = [{"think_s": 2.0, "action": {"kind": "exec", "t1_s": 3.0}}] * 3
    r = simulate([traj("t", steps)], cpu_cluster(), "elastic", overheads=NO_OVERHEAD)
    starts = [rec.submitted for rec in r.records]
    assert starts == pytest.approx([2.0, 7.0, 12.0])  # think 2, act 3, think 2, ...
    assert [rec.act_s for rec in r.records] == pytest.approx([3.0, 3.0, 3.0])
    assert r.makespan_s == pytest.approx(15.0)
    assert r.summary()["avg_traj_act_s"] == pytest.approx(9.0)


def test_contention_queues_actions_and_counts_it_in_act() -> None:
    step = [{"think_s": 0.0, "action": {"kind": "exec", "t1_s": 10.0}}]
    trace = [traj(f"t{i}", step) for i in range(3)]
    r = simulate(trace, cpu_cluster(cpus=2), "elastic", overheads=NO_OVERHEAD)
    assert sorted(rec.act_s for rec in r.records) == pytest.approx([10.0, 10.0, 20.0])
    assert r.summary()["unit_seconds"] == pytest.approx(30.0)
    assert r.summary()["unit_seconds_exec"] == pytest.approx(30.0)


def test_elastic_beats_fixed_dop_one_on_an_idle_node() -> None:
    step = [
        {
            "think_s": 0.0,
            "action": {
                "kind": "exec",
                "cpu": {"min": 1, "max": 8},
                "t1_s": 80.0,
                "efficiency": {"amdahl": 1.0},
            },
        }
    ]
    el = simulate([traj("t", step)], cpu_cluster(cpus=8), "elastic", overheads=NO_OVERHEAD)
    fx = simulate([traj("t", step)], cpu_cluster(cpus=8), "fixed-dop-1", overheads=NO_OVERHEAD)
    assert el.records[0].units == 8 and el.records[0].act_s == pytest.approx(10.0)
    assert fx.records[0].units == 1 and fx.records[0].act_s == pytest.approx(80.0)


def test_water_fill_is_max_min_fair() -> None:
    assert _water_fill([4, 4, 4], 6.0) == pytest.approx([2, 2, 2])
    assert _water_fill([1, 4, 4], 6.0) == pytest.approx([1, 2.5, 2.5])
    assert _water_fill([1, 1], 6.0) == pytest.approx([1, 1])


def test_speedup_below_one_core_is_time_slicing() -> None:
    eff = AmdahlEfficiency(amdahl=0.5)
    assert speedup(eff, 0.5) == 0.5
    assert speedup(None, 3.0) == 1.0  # a single process cannot use more than a core
    assert speedup(eff, 2.0) == pytest.approx(1 / (0.5 + 0.25))


def test_k8s_static_shares_a_nodes_cores_and_waits_for_pods() -> None:
    step = [{"think_s": 0.0, "action": {"kind": "exec", "t1_s": 10.0}}]
    # Two pods fit (2 x 0.5 CPU on 1 core); their single-process actions share the core.
    trace = [traj("a", step), traj("b", step), traj("c", step)]
    r = simulate(trace, cpu_cluster(cpus=1), "k8s-static", overheads=NO_OVERHEAD)
    by = {rec.trajectory: rec for rec in r.records}
    a, b = by["a"], by["b"]
    # Pod starts are random, so the two overlap only partly; while they do, each runs at
    # half a core, and the one core stays busy: 20 core-seconds end 20 s after the first start.
    assert a.ended - a.started > 10.0 and b.ended - b.started > 10.0
    assert max(a.ended, b.ended) - min(a.started, b.started) == pytest.approx(20.0)
    # c's pod is Pending until a pod ends, so its action waits for admission + pod start.
    assert by["c"].submitted == 0.0
    assert by["c"].started > by["a"].ended


def test_static_gpu_splits_gpus_evenly_and_queues_per_service() -> None:
    cluster = scenario_cluster("mopd")
    trace = generate("mopd", 32, 0)
    r = simulate(trace, cluster, "static-gpu", seed=0)
    assert any("36 GPUs dedicated" in n for n in r.notes)  # 9 teachers x TP 4, as the paper
    services = [rec for rec in r.records if rec.kind == "service"]
    assert services and all(rec.units == 4 for rec in services)
    judge = simulate(generate("deepsearch", 16, 0), scenario_cluster("deepsearch"), "static-gpu")
    assert any("40 GPUs dedicated" in n for n in judge.notes)  # five TP-8 replicas


def test_unmanaged_api_calls_fail_after_retries_when_over_the_rate() -> None:
    cluster = ClusterSpec.model_validate(
        {
            "nodes": [{"name": "n"}],
            "apis": [{"name": "search", "rate_per_s": 0.01, "period_s": 100}],
        }
    )
    step = [{"think_s": 0.0, "action": {"kind": "api", "api": "search", "t1_s": 1.0}}]
    trace = [traj(f"t{i}", step) for i in range(2)]
    un = simulate(trace, cluster, "unmanaged", overheads=NO_OVERHEAD)
    failed = [rec for rec in un.records if not rec.ok]
    assert len(failed) == 1 and failed[0].attempts == 4  # the first call + 3 retries
    managed = simulate(trace, cluster, "elastic", overheads=NO_OVERHEAD)
    assert all(rec.ok for rec in managed.records)
    assert max(rec.act_s for rec in managed.records) == pytest.approx(101.0)  # waits its window


def test_replay_is_deterministic_for_a_seed() -> None:
    trace = generate("coding", 24, 3)
    cluster = scenario_cluster("coding", cpu_nodes=1)
    a = simulate(trace, cluster, "elastic", seed=5).summary()
    b = simulate(trace, cluster, "elastic", seed=5).summary()
    assert a == b


def test_policy_names_are_checked() -> None:
    good = ("elastic", "fixed-dop-16", "k8s-static", "k8s-static-dop-4", "static-gpu")
    for name in (*good, "elastic-shortest-hinted-0", "elastic-shortest-hinted-1.25"):
        assert check_policy(name) == name
    for bad in ("fixed-dop-0", "k8s", "elastic2", "elastic-shortest-hinted-", "-hinted-.5"):
        with pytest.raises(ValueError, match="unknown"):
            check_policy(bad)


def _hints(policy: str, trace: list[TrajectoryTrace]) -> list[int | None]:
    """The remaining-steps hint each trajectory of ``trace`` opens with under ``policy``."""
    backend = build(policy, cpu_cluster()).routes[ActionKind.EXEC]
    assert isinstance(backend, SchedulerBackend)
    for t in trace:
        backend.open(t, 0.0, lambda: None)
    return [backend.sched.trajectories[t.id].hint_steps for t in trace]


def test_hinted_policies_take_the_hints_sigma_from_the_name() -> None:
    step = {"think_s": 1.0, "action": {"kind": "exec", "t1_s": 1.0}}
    trace = [traj(f"t{i}", [step] * (i + 1)) for i in range(30)]
    assert _hints("elastic-shortest-hinted-0", trace) == [i + 1 for i in range(30)]  # exact
    default = _hints("elastic-shortest-hinted", trace)
    assert default == _hints(f"elastic-shortest-hinted-{HINT_SIGMA}", trace)
    assert default != [i + 1 for i in range(30)]
    assert _hints("elastic-shortest", trace) == [None] * 30


BATCHING = ClusterSpec.model_validate(
    {
        "nodes": [{"name": "g", "gpus": 4}],
        "services": [
            {
                "name": "rm",
                "gpu_memory_gb": 10,
                "dop_choices": [4],
                "max_calls": 8,
                "batch_slowdown": 0.1,
            }
        ],
    }
)


@pytest.mark.parametrize("policy", ["static-gpu", "elastic"])
def test_instances_batch_concurrent_calls_with_a_slowdown(policy: str) -> None:
    step = [{"think_s": 0.0, "action": {"kind": "service", "service": "rm", "t1_s": 10.0}}]
    trace = [traj(f"t{i}", step) for i in range(3)]
    r = simulate(trace, BATCHING, policy, overheads=NO_OVERHEAD)
    # One TP-4 instance; all three calls run at once, admitted with 0, 1 and 2 in flight:
    # a static deployment, and a pooled instance the two later calls join.
    assert sorted(rec.started for rec in r.records) == [0.0, 0.0, 0.0]
    assert sorted(rec.act_s for rec in r.records) == pytest.approx([10.0, 11.0, 12.0])
    if policy == "elastic":  # the chunk is held once, from the first start to the last end
        assert r.unit_seconds_by["service"] == pytest.approx(4 * 12.0)


def test_unbatched_pool_runs_one_call_per_instance() -> None:
    step = [{"think_s": 0.0, "action": {"kind": "service", "service": "rm", "t1_s": 10.0}}]
    trace = [traj(f"t{i}", step) for i in range(3)]
    r = simulate(trace, BATCHING, "elastic-unbatched", overheads=NO_OVERHEAD)
    assert sorted(rec.started for rec in r.records) == [0.0, 10.0, 20.0]
    assert r.unit_seconds_by["service"] == pytest.approx(4 * 30.0)


def test_unmanaged_calls_over_concurrency_wait_at_the_provider_then_time_out() -> None:
    cluster = ClusterSpec.model_validate(
        {"nodes": [{"name": "n"}], "apis": [{"name": "search", "concurrency": 1, "timeout_s": 5}]}
    )
    long_call = [{"think_s": 0.0, "action": {"kind": "api", "api": "search", "t1_s": 100.0}}]
    r = simulate(
        [traj(f"t{i}", long_call) for i in range(2)], cluster, "unmanaged", overheads=NO_OVERHEAD
    )
    by = sorted(r.records, key=lambda rec: rec.ended)
    # The second call queues at the provider, times out after 5 s, and retries 3 times
    # (backoff 1, 2, 4 s) while the first still holds the only slot: it fails at 26 s.
    assert not by[0].ok and by[0].attempts == 4
    assert by[0].ended == pytest.approx(5 + 1 + 5 + 2 + 5 + 4 + 5)
    assert by[1].ok and by[1].act_s == pytest.approx(100.0)
