"""Tenants in the scheduler core: fair queuing between them, and a capped tenant held to
its share of the pool without holding anyone else back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.scheduler import Scheduler, SchedulerConfig
from tangram.scheduler.core.shares import TenantShare

from .helpers import api_call, cluster, elastic, exec_action, started


def _pool(cpus: int = 2, **config: object) -> Scheduler:
    s = Scheduler(
        cluster(nodes=[{"name": "n", "cpus": cpus, "memory_gb": 64}],
                apis=[{"name": "search", "concurrency": 4}]),
        SchedulerConfig(**config),  # type: ignore[arg-type]
    )  # fmt: skip
    return s


def _open(s: Scheduler, tid: str, tenant: str) -> None:
    s.open_trajectory(tid, memory_gb=1, tenant=tenant)
    s.place_trajectory(tid, "n")


def _flood_then_one(s: Scheduler) -> list[str]:
    """The flood's 20 one-core actions take both cores; then one of the steady tenant
    arrives. What the first round started."""
    _open(s, "f", "flood")
    for i in range(20):
        s.submit(f"f{i}", "f", exec_action(1, 1.0), float(i))
    first = started(s, 20.0)
    _open(s, "s", "steady")
    s.submit("s0", "s", exec_action(1, 1.0), 20.5)
    return first


def test_a_newcomer_goes_next_instead_of_after_the_whole_flood() -> None:
    s = _pool()
    assert _flood_then_one(s) == ["f0", "f1"]
    s.complete("f0", 21.0)
    assert started(s, 21.0) == ["s0"]


def test_tenants_arriving_together_alternate() -> None:
    s = _pool(cpus=1)
    for t in ("a", "b"):
        _open(s, t, t)
        for i in range(3):
            s.submit(f"{t}{i}", t, exec_action(1, 1.0), float(i))
    served = []
    for now in range(6):
        (asg,) = s.schedule(float(now)).assignments
        served.append(asg.action_id)
        s.complete(asg.action_id, now + 0.5)
    assert served == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_without_tenant_fairness_the_newcomer_waits_behind_the_flood() -> None:
    s = _pool(tenant_fairness=False)
    _flood_then_one(s)
    s.complete("f0", 21.0)
    assert started(s, 21.0) == ["f2"]


def test_a_capped_tenant_leaves_its_share_free_and_blocks_nobody() -> None:
    s = _pool()
    s.set_tenants({"flood": TenantShare(max_share=0.5)})
    assert _flood_then_one(s) == ["f0"]  # one core of two, though nobody else waits yet
    assert dict(s.plan(20.0).blocked)["f1"] == "tenant flood at its maxShare"
    assert started(s, 21.0) == ["s0"]  # at once
    s.complete("f0", 22.0)
    assert started(s, 22.0) == ["f1"]


def test_a_capped_tenants_elastic_action_gets_at_most_its_share() -> None:
    s = _pool(cpus=8)
    s.set_tenants({}, default=TenantShare(max_share=0.25))  # every tenant: 2 of 8 cores
    _open(s, "t", "anyone")
    s.submit("e", "t", elastic(1, 8, 40.0, 0.99), 0.0)
    (asg,) = s.schedule(1.0).assignments
    assert asg.units == 2
    assert s.holdings().of("anyone") != {}
    s.complete("e", 2.0)
    assert s.holdings().of("anyone") == {}  # what it held is given back
    s.submit("e2", "t", elastic(1, 8, 40.0, 0.99), 3.0)
    (again,) = s.schedule(3.0).assignments
    assert again.units == 2  # its whole share again, not what was left beside the first


def test_a_capped_tenants_quota_units_count_against_its_share() -> None:
    s = _pool()
    s.set_tenants({"greedy": TenantShare(max_share=0.5)})  # 2 of the quota's 4 units
    s.open_trajectory("~leases/greedy", tenant="greedy")
    for i in range(4):
        s.submit(f"g{i}", "~leases/greedy", api_call("search"), float(i))
    s.open_trajectory("~leases/other", tenant="other")
    s.submit("o0", "~leases/other", api_call("search"), 5.0)
    assert sorted(a.action_id for a in s.schedule(6.0).assignments) == ["g0", "g1", "o0"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 4), st.floats(0.5, 20.0), st.booleans()), min_size=1, max_size=25
    )
)
def test_one_tenant_alone_is_scheduled_exactly_as_without_tenants(
    work: list[tuple[int, float, bool]],
) -> None:
    """Fair queuing with a single tenant is the pool's own order: same starts, same units,
    round after round."""
    runs = []
    for fair in (True, False):
        s = _pool(cpus=4, tenant_fairness=fair)
        _open(s, "t", "only")
        for i, (cpu, t1, grows) in enumerate(work):
            spec = elastic(1, cpu, t1) if grows and cpu > 1 else exec_action(cpu, t1)
            s.submit(f"a{i}", "t", spec, float(i))
        now, trace = float(len(work)), []
        while s.queued or s.running:
            rnd = s.schedule(now)
            trace.append(sorted((a.action_id, a.units) for a in rnd.assignments))
            if s.running:
                done = min(s.running, key=lambda a: (s.running[a].expected_end, a))
                now = max(now, s.running[done].expected_end)
                s.complete(done, now)
        runs.append(trace)
    assert runs[0] == runs[1]
