"""Tenants in the scheduler core: fair queuing between them, and a capped tenant held to
its share of the pool without holding anyone else back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.api.action import ActionSpec
from tangram.api.learned import LearnedState
from tangram.scheduler import Scheduler, SchedulerConfig, SchedulingError
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


def _closed_loop(s: Scheduler, declared: dict[str, float | None], until: float) -> dict[str, int]:
    """Each tenant's 4 trajectories submit a one-core action again as each ends; every
    action really takes 1 s, whatever its tenant declares (``t1_s``; None: nothing). The
    starts of each tenant up to ``until``."""
    seq, now, ends = 0, 0.0, []
    got = dict.fromkeys(declared, 0)

    def submit(tid: str) -> None:
        nonlocal seq
        seq += 1
        s.submit(f"a{seq}", tid, exec_action(1, declared[tid.partition("-")[0]]), now)

    for t in declared:
        for i in range(4):
            _open(s, f"{t}-{i}", t)
            submit(f"{t}-{i}")
    while now < until:
        for asg in s.schedule(now).assignments:
            got[asg.trajectory.partition("-")[0]] += 1
            ends.append((now + 1.0, asg.action_id, asg.trajectory))
        ends.sort()
        now, aid, tid = ends.pop(0)
        s.complete(aid, now)
        submit(tid)
    return got


def test_a_tenant_declaring_tiny_work_pays_what_its_actions_really_took() -> None:
    """Declared work orders the start only: the liar is charged the 1 s each action held
    when it ends, and the two tenants share the pool evenly."""
    for honest in (1.0, None):
        got = _closed_loop(_pool(), {"liar": 1e-6, "honest": honest}, 100.0)
        assert abs(got["liar"] - got["honest"]) <= 4, got


def test_an_over_declared_action_is_charged_only_what_it_took() -> None:
    s = _pool(cpus=1)
    for t in ("a", "b"):
        _open(s, t, t)
    s.submit("a0", "a", exec_action(1, 100.0), 0.0)  # declares 100 s, takes 1
    for i in range(1, 4):
        s.submit(f"a{i}", "a", exec_action(1, 1.0), 0.0)
    for i in range(4):
        s.submit(f"b{i}", "b", exec_action(1, 1.0), 0.0)
    served = []
    for now in range(8):
        (asg,) = s.schedule(float(now)).assignments
        served.append(asg.action_id)
        s.complete(asg.action_id, now + 1.0)
    # Charged 100 s, a would wait for b's whole backlog; charged 1 s, they alternate.
    assert served == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]


@pytest.mark.parametrize("restarted", [False, True])
def test_work_of_an_unknown_type_counts_as_its_kinds_recent_mean_not_a_second(
    restarted: bool,
) -> None:
    """A's actions of a learned type take 10 ms. B's first action of a new type runs long
    on one core; its second waits for the other core, where it should come after a turn
    or two of A's, not after the hundred that a second of expected work would make. A
    scheduler that resumes what the one that saw A's runs learned does the same."""
    s = _pool()
    _open(s, "a", "a")
    now = 0.0
    for i in range(30):  # A alone: the pool learns its type, and that actions take 10 ms
        s.submit(f"w{i}", "a", exec_action(1, type_="quick"), now)
        assert started(s, now) == [f"w{i}"]
        now += 0.01
        s.complete(f"w{i}", now)
    if restarted:
        learned = LearnedState.model_validate_json(s.learned().model_dump_json())
        s = _pool()
        s.resume(learned)
        _open(s, "a", "a")
    for i in range(200):
        s.submit(f"a{i}", "a", exec_action(1, type_="quick"), now)
    _open(s, "b", "b")
    s.submit("b0", "b", exec_action(1, type_="new"), now)
    s.submit("b1", "b", exec_action(1, type_="new"), now)
    first = started(s, now)
    assert "b0" in first
    turns = 0
    while "b1" not in first:
        (aid,) = (aid for aid in s.running if aid.startswith("a"))
        now += 0.01
        s.complete(aid, now)
        first = started(s, now)
        turns += "b1" not in first
    assert turns <= 3


def test_an_action_over_what_its_tenants_share_may_ever_hold_is_refused() -> None:
    s = _pool(cpus=4)
    s.set_tenants({"capped": TenantShare(max_share=0.5)})  # 2 of 4 cores, 2 of 4 units
    for t in ("capped", "free"):
        _open(s, t, t)
        s.open_trajectory(f"~leases/{t}", tenant=t)
    lease = ActionSpec(kind="api", api="search", quotas={"search": 2})  # 3 units
    with pytest.raises(SchedulingError) as e:
        s.submit("l", "~leases/capped", lease, 0.0)
    assert e.value.field == "units"
    assert "spec.access.tenants[].maxShare" in e.value.message and "2" in e.value.message
    with pytest.raises(SchedulingError) as e:
        s.submit("x", "capped", exec_action(3, 1.0), 0.0)
    assert e.value.field == "cpu" and "maxShare" in e.value.message
    with pytest.raises(SchedulingError) as e:  # an exec's extra quota units: its quotas
        s.submit("q", "capped", ActionSpec(kind="exec", cpu=1, quotas={"search": 3}), 0.0)
    assert e.value.field == "quotas"
    # At the cap, and over it for an uncapped tenant: queued, and started.
    s.submit("ok", "capped", exec_action(2, 1.0), 0.0)
    s.submit(
        "l2", "~leases/capped", ActionSpec(kind="api", api="search", quotas={"search": 1}), 0.0
    )
    s.submit("big", "free", exec_action({"min": 3, "max": 4}, 1.0), 0.0)
    s.submit("fl", "~leases/free", lease, 0.0)
    assert sorted(started(s, 1.0)) == ["l2", "ok"]  # (the cores are the capped tenant's)
    assert s.queued == 2


def test_a_lower_share_refuses_the_queued_actions_it_leaves_no_room_for() -> None:
    s = _pool(cpus=4)
    _open(s, "t", "t")
    s.submit("busy", "t", exec_action(4, 1.0), 0.0)
    assert started(s, 0.0) == ["busy"]
    s.submit("wide", "t", exec_action(2, 1.0), 0.0)
    s.submit("narrow", "t", exec_action(1, 1.0), 0.0)
    s.set_tenants({"t": TenantShare(max_share=0.25)})  # 1 of 4 cores from now on
    rnd = s.schedule(0.5)
    assert [(i.action_id, i.field) for i in rnd.invalid] == [("wide", "cpu")]
    assert "maxShare" in rnd.invalid[0].message
    assert sorted(s.actions) == ["narrow"]
    s.complete("busy", 1.0)
    assert started(s, 1.0) == ["narrow"]


def test_a_smaller_pool_strands_an_action_over_its_tenants_share_of_it() -> None:
    s = Scheduler(cluster(nodes=[{"name": "n", "cpus": 2, "memory_gb": 64},
                                 {"name": "m", "cpus": 2, "memory_gb": 64}]))  # fmt: skip
    s.set_tenants({"t": TenantShare(max_share=0.5)})  # 2 of 4 cores
    s.open_trajectory("t", memory_gb=1, tenant="t")
    s.place_trajectory("t", "n")
    s.submit("x", "t", exec_action(2, 1.0), 0.0)
    s.drain_node("m")  # 1 of 2 cores: x waits for the pool to grow, holding nobody back
    assert s.stranded == {"x"}
    assert not s.schedule(1.0).assignments
    s.add_node("m", 2, memory_gb=64)
    assert started(s, 2.0) == ["x"]


def test_a_probe_or_fixed_size_over_the_share_is_sized_within_it() -> None:
    """Sizes the pool picks (a probe at twice the minimum, a fixed DoP) over what the
    tenant may ever hold fall back within it, rather than wait forever."""
    for config in ({}, {"fixed_dop": 4}):
        s = _pool(cpus=4, **config)
        s.set_tenants({"t": TenantShare(max_share=0.25)})  # 1 core
        _open(s, "t", "t")
        for i in range(4):  # the 4th of an unlearned elastic type probes 2 cores
            s.submit(f"x{i}", "t", exec_action({"min": 1, "max": 4}, type_="k"), 0.0)
        for now in range(4):
            (asg,) = s.schedule(float(now)).assignments
            assert asg.units == 1
            s.complete(asg.action_id, now + 1.0)
        assert not s.queued


def test_an_adopted_action_over_its_tenants_share_is_adopted() -> None:
    s = _pool(cpus=4)
    s.set_tenants({"t": TenantShare(max_share=0.25)})
    _open(s, "t", "t")
    asg = s.adopt("x", "t", exec_action(2, 1.0), units=2, started_at=0.0)
    assert asg.units == 2  # it runs already: a restarted scheduler takes it as it is


def test_a_lease_over_its_quotas_limit_is_refused_naming_its_units() -> None:
    s = _pool()  # search: 4 units
    s.open_trajectory("~leases/t", tenant="t")
    _open(s, "x", "t")
    with pytest.raises(SchedulingError) as e:
        s.submit("l", "~leases/t", ActionSpec(kind="api", api="search", quotas={"search": 4}), 0.0)
    assert (e.value.field, e.value.message) == ("units", "5 units of search exceed its limit of 4")
    with pytest.raises(SchedulingError) as e:  # an exec's extra units are its ``quotas``
        s.submit("q", "x", ActionSpec(kind="exec", cpu=1, quotas={"search": 5}), 0.0)
    assert e.value.field == "quotas"
