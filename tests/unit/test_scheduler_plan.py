"""A round plans, then commits: ``Scheduler.plan`` decides without changing anything, and
``schedule`` applies exactly that plan."""

from __future__ import annotations

from typing import Any

import pytest

from tangram.scheduler import Assignment, Scheduler, SchedulerConfig
from tangram.scheduler.core.decisions import GroupDecision, Start
from tangram.scheduler.core.resource import Resource

from .helpers import api_call, cluster, elastic, exec_action, service_call


def busy_pool() -> Scheduler:
    """Two nodes short of memory, a GPU service, a quota: placements, elastic groups and
    waiting actions all in one round."""
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "n0", "cpus": 8, "numa_nodes": 2, "memory_gb": 16},
                {"name": "n1", "cpus": 4, "memory_gb": 8},
                {"name": "g", "gpus": 2, "gpu_memory_gb": 80},
            ],
            services=[{"name": "rm", "gpu_memory_gb": 20, "dop_choices": [1, 2]}],
            apis=[{"name": "search", "concurrency": 1}],
        )
    )
    s.open_trajectory("old", memory_gb=4)
    s.place_trajectory("old", "n0")
    s.adopt("hold", "old", exec_action(2, 50.0), units=2, started_at=0.0)
    for i, mem in enumerate((8, 6, 6, 4)):  # the last two find no memory left
        s.open_trajectory(f"t{i}", memory_gb=mem)
        s.submit(f"e{i}", f"t{i}", elastic(1, 8, 20.0 + i), 1.0)
    s.open_trajectory("svc")
    s.submit("r1", "svc", service_call("rm", 3.0, gpu={"choices": [1, 2]}), 1.0)
    for i in range(2):
        s.open_trajectory(f"q{i}")
        s.submit(f"a{i}", f"q{i}", api_call("search"), 1.0)  # one unit: a1 waits
    return s


def state(s: Scheduler) -> dict[str, Any]:
    """Everything a round could change, as plain comparable data."""
    return {
        "cpu": repr(s.cpu),
        "gpu": repr(s.gpu),
        "quotas": {n: (q.in_use, q.free(2.0)) for n, q in s.quotas.items()},
        "queue": list(s.queue.order(2.0)),
        "actions": sorted(s.actions),
        "running": sorted(s.running),
        "waiting": dict(s.waiting),
    }


def test_planning_changes_nothing_and_gives_the_same_plan_twice() -> None:
    s = busy_pool()
    before = state(s)
    first = s.plan(2.0)
    assert state(s) == before
    assert s.plan(2.0) == first
    assert state(s) == before
    # It did decide something worth checking: placements, starts and waits.
    assert first.placements and first.starts and first.blocked
    assert not set(dict(first.placements)) & set(s.cpu.placement)


def test_schedule_commits_exactly_the_plan() -> None:
    s, twin = busy_pool(), busy_pool()
    plan = twin.plan(2.0)
    rnd = s.schedule(2.0)
    assert [(a.action_id, a.units) for a in rnd.assignments] == [
        (st.action_id, st.units) for st in plan.starts
    ]
    for a, st in zip(rnd.assignments, plan.starts, strict=True):
        assert st.node is None or a.node == st.node
    assert rnd.groups == plan.groups and rnd.blocked == plan.blocked
    for tid, node in plan.placements:
        assert s.cpu.placement[tid] == node
    for st in plan.starts:
        assert s.running[st.action_id].resource == st.resource
    assert {st.resource for st in plan.starts} >= {Resource.api("search")}


def test_decision_records_take_keywords_only() -> None:
    for positional in (
        lambda: Assignment("a1", "t1", "n0"),  # type: ignore[call-arg]
        lambda: GroupDecision(Resource.cpu("n0"), ("a1",), False, 1, ()),  # type: ignore[call-arg]
        lambda: Start("a1", Resource.cpu("n0"), "n0", 1, 2.0),  # type: ignore[call-arg]
    ):
        with pytest.raises(TypeError):
            positional()


# ---- a warm instance is warm for one call of a round -----------------------------------


def _one_warm_instance(gpus: int = 8, warm: int = 1) -> Scheduler:
    """``warm`` DoP-1 instances of ``rm`` resident (restore 20 s, 10 s at DoP 1, perfectly
    parallel), then two calls that may take DoP 1 or 2."""
    s = Scheduler(
        cluster(
            nodes=[{"name": "g", "gpus": gpus, "gpu_memory_gb": 80}],
            services=[
                {"name": "rm", "gpu_memory_gb": 10, "dop_choices": [1, 2], "restore_s": 20.0,
                 "efficiency": {"amdahl": 1.0}}
            ],
        ),
        SchedulerConfig(restore_ahead=False),
    )  # fmt: skip
    s.open_trajectory("w")
    for i in range(warm):
        s.submit(f"warm{i}", "w", service_call("rm", 10.0, gpu=1), now=0.0)
    assert len(s.schedule(0.0).assignments) == warm
    for i in range(warm):
        s.complete(f"warm{i}", now=30.0)
    assert len(s.gpu.resident) == warm
    for i in range(2):
        s.open_trajectory(f"t{i}")
        s.submit(f"c{i}", f"t{i}", service_call("rm", 10.0, gpu={"choices": [1, 2]}), now=40.0)
    return s


def test_the_round_prices_a_single_warm_instance_warm_for_one_call_only() -> None:
    s = _one_warm_instance()
    (group,) = s.plan(40.0).groups
    kept = next(step for step in group.steps if step.kept == group.kept)
    rnd = s.schedule(40.0)
    got = {a.action_id: (a.units, a.restore, a.expected_s) for a in rnd.assignments}
    # c0 takes the warm DoP-1 instance; c1 restores, better at DoP 2 (5 s + 20 s / 2)
    # than on a cold DoP-1 chunk (10 s + 20 s).
    assert got == {"c0": (1, False, 10.0), "c1": (2, True, 15.0)}
    # The DP's exact sum is what the calls are expected to take, restores included.
    assert kept.exact == pytest.approx(sum(e for _, _, e in got.values()))


def test_two_warm_instances_are_warm_for_two_calls() -> None:
    s = _one_warm_instance(warm=2)
    rnd = s.schedule(40.0)
    assert {(a.units, a.restore) for a in rnd.assignments} == {(1, False)}
    assert sum(a.expected_s for a in rnd.assignments) == pytest.approx(20.0)


def test_warm_landings_follow_the_allocator_over_successive_calls() -> None:
    s = _one_warm_instance(warm=2)
    idle = s.gpu.idle_resident()
    assert idle == {("rm", 1): 2}
    landings = list(s.gpu.warm_landings("rm", 1, 2))
    assert landings == [0.0, 0.0]  # then none is left warm: the calls after restore
    assert s.gpu.chunk_counts() == (0, 0, 0, 1)  # the pool's own chunks untouched
    two = idle.get(("rm", 2), 0)  # no DoP-2 instance resident
    assert two == 0 and list(s.gpu.warm_landings("rm", 2, two)) == []
