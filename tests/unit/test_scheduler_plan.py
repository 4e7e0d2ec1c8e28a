"""A round plans, then commits: ``Scheduler.plan`` decides without changing anything, and
``schedule`` applies exactly that plan."""

from __future__ import annotations

from typing import Any

import pytest

from tangram.scheduler import Assignment, Scheduler
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
