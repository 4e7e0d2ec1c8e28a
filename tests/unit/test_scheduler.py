"""Behaviour of the scheduler core on small, hand-checked states."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram.api.cluster import ServiceSpec
from tangram.api.demand import AmdahlEfficiency, TableEfficiency
from tangram.scheduler import Assignment, Scheduler, SchedulerConfig, SchedulingError, dp_arrange
from tangram.scheduler.core.profiles import Profile, ProfileBook

from .helpers import api_call, cluster, elastic, exec_action, service_call, started


def one_node(cpus: int = 8, numa: int = 2, memory: float = 64.0, **kw: object) -> Scheduler:
    return Scheduler(
        cluster(nodes=[{"name": "n1", "cpus": cpus, "numa_nodes": numa, "memory_gb": memory}]),
        SchedulerConfig(**kw),  # type: ignore[arg-type]
    )


def test_elastic_candidates_share_free_cores_as_the_dp_says() -> None:
    s = one_node(8)
    specs = {"a": elastic(1, 8, 20, 0.9), "b": elastic(1, 8, 30, 0.95), "c": exec_action(1, 1.0)}
    for aid, spec in specs.items():
        s.open_trajectory(f"t-{aid}")
        s.submit(aid, f"t-{aid}", spec, 0.0)
    got = {a.action_id: a for a in s.schedule(0.0).assignments}
    assert set(got) == {"a", "b", "c"}
    durations = [
        {k: specs[x].t1_s * ((1 - p) + p / k) for k in range(1, 9)}  # type: ignore[operator]
        for x, p in (("a", 0.9), ("b", 0.95))
    ]
    _, best = dp_arrange([*durations, {1: 1.0}], 8)
    assert [got["a"].units, got["b"].units, got["c"].units] == best
    cores = [set(a.cores) for a in got.values()]
    assert sum(len(c) for c in cores) == 8 and len(set().union(*cores)) == 8  # exclusive


def test_cores_of_one_action_come_from_one_numa_node_when_possible() -> None:
    s = one_node(8, numa=2)
    for i in range(2):
        s.open_trajectory(f"t{i}")
        s.submit(f"a{i}", f"t{i}", exec_action(4, 1.0), 0.0)
    for a in s.schedule(0.0).assignments:
        assert {c // 4 for c in a.cores} in ({0}, {1})


def test_waiting_for_units_beats_starting_at_the_minimum() -> None:
    # 1 core is free; 31 are held by an action that ends in 0.1 s. A long elastic action
    # should wait for them rather than start now with one core (Algorithm 1 may evict all).
    s = one_node(32, numa=1)
    s.open_trajectory("busy")
    s.adopt("hold", "busy", exec_action(31, 0.1), units=31, started_at=0.0)
    s.open_trajectory("t")
    s.submit("long", "t", elastic(1, 32, 1000.0, 0.99), 0.0)
    first = s.schedule(0.0)
    assert first.assignments == ()
    assert any(aid == "long" and "evicted" in why for aid, why in first.blocked)
    s.complete("hold", 0.1)
    (asg,) = s.schedule(0.1).assignments
    assert asg.units == 32


def test_without_pending_releases_the_head_starts_now() -> None:
    s = one_node(4, numa=1)
    s.open_trajectory("t")
    s.submit("a", "t", elastic(1, 8, 100.0), 0.0)
    (asg,) = s.schedule(0.0).assignments
    assert asg.units == 4  # all free cores, capped by the node


def test_trajectory_stays_on_its_node_and_memory_is_balanced() -> None:
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "a", "cpus": 4, "memory_gb": 100},
                {"name": "b", "cpus": 4, "memory_gb": 100},
            ]
        )
    )
    s.open_trajectory("t1", memory_gb=60)
    s.open_trajectory("t2", memory_gb=10)
    s.submit("x", "t1", exec_action(1, 1.0), 0.0)
    (x,) = s.schedule(0.0).assignments
    s.submit("y", "t2", exec_action(1, 1.0), 0.0)
    (y,) = s.schedule(0.0).assignments
    assert x.node != y.node  # t2 goes to the node with more free memory
    s.complete("x", 1.0)
    s.submit("x2", "t1", exec_action(1, 1.0), 1.0)
    (x2,) = s.schedule(1.0).assignments
    assert x2.node == x.node
    with pytest.raises(SchedulingError, match="memory_gb"):
        s.open_trajectory("huge", memory_gb=101)


def test_fcfs_head_blocks_its_node_but_not_other_resources() -> None:
    s = Scheduler(
        cluster(
            nodes=[{"name": "a", "cpus": 2, "memory_gb": 10}],
            apis=[{"name": "search", "concurrency": 1}],
        )
    )
    for t in ("t1", "t2", "t3"):
        s.open_trajectory(t)
    s.place_trajectory("t1", "a")
    s.place_trajectory("t2", "a")
    s.submit("big", "t1", exec_action(3 - 1, 1.0), 0.0)
    s.schedule(0.0)
    s.submit("wide", "t1", exec_action(2, 1.0), 0.0)  # cannot fit: the node is full
    s.submit("small", "t2", exec_action(1, 1.0), 0.0)  # behind it on the same node
    s.submit("q", "t3", api_call("search"), 0.0)  # unrelated resource
    r = s.schedule(0.0)
    assert [a.action_id for a in r.assignments] == ["q"]
    s.complete("big", 1.0)
    assert started(s, 1.0) == ["wide"]


def test_rate_quota_sets_a_wake_up_time() -> None:
    s = Scheduler(
        cluster(nodes=[{"name": "a"}], apis=[{"name": "search", "rate_per_s": 2, "period_s": 1}])
    )
    s.open_trajectory("t")
    for i in range(3):
        s.submit(f"q{i}", "t", api_call("search", 0.01), 0.0)
    r = s.schedule(0.0)
    assert len(r.assignments) == 2
    assert r.wake_at == pytest.approx(1.0)
    for a in r.assignments:
        s.complete(a.action_id, 0.01)
    assert s.schedule(0.5).assignments == ()
    assert started(s, 1.0) == ["q2"]


def test_gpu_calls_reuse_resident_instances_and_evict_lru() -> None:
    s = Scheduler(
        cluster(
            nodes=[{"name": "g", "gpus": 2, "gpu_memory_gb": 80}],
            services=[
                {"name": "a", "gpu_memory_gb": 60, "dop_choices": [1], "restore_s": 2},
                {"name": "b", "gpu_memory_gb": 60, "dop_choices": [1], "restore_s": 2},
                {"name": "c", "gpu_memory_gb": 60, "dop_choices": [1], "restore_s": 2},
            ],
        ),
        SchedulerConfig(restore_ahead=False),  # the allocator's own LRU, alone
    )
    s.open_trajectory("t")
    now = 0.0
    restored = []
    for i, svc in enumerate(["a", "b", "a", "c", "b"]):
        s.submit(f"x{i}", "t", service_call(svc), now)
        (asg,) = s.schedule(now).assignments
        restored.append((svc, asg.restore, asg.evicted))
        now += 1.0
        s.complete(asg.action_id, now)
    assert restored[0][1] and restored[1][1]  # cold
    assert restored[2] == ("a", False, ())  # resident: no restore
    # c needs a GPU: b was used less recently than a, so b is evicted.
    assert restored[3][1] and restored[3][2] == ("b@g:1+1",)
    assert restored[4][1]  # b must be restored again


def _service_a(revision: str = "") -> ServiceSpec:
    return ServiceSpec(name="a", gpu_memory_gb=10, dop_choices=[1], restore_s=2, revision=revision)


def _one_gpu_one_service() -> Scheduler:
    """One GPU, service ``a`` (a 2 s restore), trajectory ``t`` open."""
    s = Scheduler(
        cluster(
            nodes=[{"name": "g", "gpus": 1, "gpu_memory_gb": 80}],
            services=[{"name": "a", "gpu_memory_gb": 10, "dop_choices": [1], "restore_s": 2}],
        )
    )
    s.open_trajectory("t")
    return s


def test_gpu_residency_follows_what_the_workers_hold() -> None:
    s = _one_gpu_one_service()

    def start(i: int) -> Assignment:
        s.submit(f"x{i}", "t", service_call("a"), float(i))
        (asg,) = s.schedule(float(i)).assignments
        return asg

    def call(i: int, *, ok: bool = True) -> bool:
        asg = start(i)
        s.complete(asg.action_id, i + 0.5, ok=ok)
        return asg.restore

    assert call(0, ok=False)  # a call that failed while restoring...
    assert call(1)  # ...left nothing resident: restored again
    assert not call(2, ok=False)  # one that failed on a resident instance...
    assert not call(3)  # ...left it there
    s.set_services([_service_a("v2")])  # its weights changed: the workers reload it
    assert call(4)
    running = start(5)
    assert not running.restore
    s.set_services([_service_a("v3")])  # while a call runs on it: gone when the call ends
    s.complete(running.action_id, 5.5)
    late = start(6)
    assert late.restore
    s.complete(late.action_id, 6.5, ok=False, resident=True)  # timed out, but it ran
    assert not call(7)


def test_a_service_call_is_learned_without_its_measured_restore() -> None:
    s = _one_gpu_one_service()
    s.submit("x", "t", service_call("a"), 0.0)
    (asg,) = s.schedule(0.0).assignments
    kind = s.running["x"].action.type
    s.complete("x", 3.0, restore_s=0.5)  # the estimate said 2 s of restore; it took 0.5
    assert asg.restore and s.book.mean_duration(kind) == pytest.approx(2.5)


def test_a_replayed_reply_is_not_learned_from() -> None:
    """Its agent answered with an earlier run's reply: the time it took says nothing of
    what the action takes (it would teach a duration near 0)."""
    s = _one_gpu_one_service()
    s.submit("x", "t", service_call("a"), 0.0)
    s.schedule(0.0)
    kind = s.running["x"].action.type
    s.complete("x", 0.01, restore_s=0.0, learn=False)
    assert s.book.learned(kind) is None and s.book.mean_duration(kind) == s.book.default_s
    s.submit("y", "t", service_call("a"), 1.0)
    s.schedule(1.0)
    s.complete("y", 4.0, restore_s=0.0)
    assert s.book.mean_duration(kind) == pytest.approx(3.0)


def test_unknown_targets_and_impossible_demands_are_rejected_with_the_field() -> None:
    s = one_node(4)
    s.open_trajectory("t")
    with pytest.raises(SchedulingError) as e:
        s.submit("a", "t", service_call("nope"), 0.0)
    assert e.value.field == "service"
    with pytest.raises(SchedulingError, match="unknown API quota"):
        s.submit("b", "t", api_call("nope"), 0.0)
    with pytest.raises(SchedulingError, match="exceeds the largest node"):
        s.submit("c", "t", exec_action(5), 0.0)
    s.submit("d", "t", exec_action(1), 0.0)
    with pytest.raises(SchedulingError, match="already exists"):
        s.submit("d", "t", exec_action(1), 0.0)
    with pytest.raises(SchedulingError, match="not open"):
        s.submit("e", "missing", exec_action(1), 0.0)
    with pytest.raises(SchedulingError, match="depth"):
        SchedulerConfig(depth=0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(SchedulingError, match="ageing_wait"):
            SchedulerConfig(ageing_wait=bad)


def test_fixed_dop_and_non_elastic_configs_restrict_units() -> None:
    for cfg, expected in (({"fixed_dop": 4}, 4), ({"elastic": False}, 2)):
        s = one_node(16, numa=1, **cfg)
        s.open_trajectory("t")
        s.submit("a", "t", elastic(2, 32, 100.0), 0.0)
        (asg,) = s.schedule(0.0).assignments
        assert asg.units == expected


def test_profile_book_learns_amdahl_from_observations() -> None:
    book = ProfileBook(min_samples=8, max_p_stderr=0.05)
    t1, p = 120.0, 0.9
    for i in range(12):
        m = (1, 2, 4, 8)[i % 4]
        book.observe("tests", m, t1 * ((1 - p) + p / m) * (1.0 + 0.01 * ((-1) ** i)))
    prof = book.learned("tests")
    assert prof is not None
    assert prof.t1_s == pytest.approx(t1, rel=0.05)
    assert prof.duration(4) == pytest.approx(t1 * (0.1 + 0.9 / 4), rel=0.05)
    assert book.learned("other") is None
    assert book.mean_duration("other") == book.default_s


def test_unprofiled_elastic_type_is_probed_then_scheduled_elastically() -> None:
    s = one_node(32, numa=1)
    seen = []
    now = 0.0
    for i in range(24):
        tid = f"t{i}"
        s.open_trajectory(tid)
        s.submit(f"a{i}", tid, exec_action({"min": 1, "max": 16}, type_="suite"), now)
        (asg,) = s.schedule(now).assignments
        seen.append(asg.units)
        now += 60.0 * (0.2 + 0.8 / asg.units)  # the truth: t1 60 s, p 0.8
        s.complete(asg.action_id, now)
        s.close_trajectory(tid)
    assert set(seen[:8]) == {1, 2}  # minimum, plus every 4th offered twice the minimum
    assert s.book.learned("suite") is not None
    assert max(seen[-4:]) > 2  # once trusted, the elastic algorithm takes over


def _hold_the_core(s: Scheduler, at: float = 0.0, t1: float = 10.0) -> None:
    """An adopted action "hold" takes the node's one core from ``at``: what is submitted
    meanwhile queues, in the ordering's order, until the test completes "hold"."""
    s.open_trajectory("blocker")
    s.adopt("hold", "blocker", exec_action(1, t1), units=1, started_at=at)


def _short_and_long(ordering: str, first: str, **config: Any) -> Scheduler:
    """One core, held until 1 s; "s" (of "short", 1 step left) and "l" (of "long", 50)
    queue behind it, ``first`` submitted at 0 and the other at 0.5 (so that the order seen
    is the ordering's, not submission's)."""
    s = one_node(1, numa=1, ordering=ordering, **config)
    s.open_trajectory("short", hint_steps=1)
    s.open_trajectory("long", hint_steps=50)
    _hold_the_core(s)
    second = "l" if first == "s" else "s"
    for aid, at in ((first, 0.0), (second, 0.5)):
        s.submit(aid, "short" if aid == "s" else "long", exec_action(1, 10.0), at)
    s.complete("hold", 1.0)
    return s


def test_trajectory_priority_orders_longer_trajectories_first_and_ages() -> None:
    s = _short_and_long("trajectory-priority", "s", ageing_factor=2.0, min_age_s=0.0)
    assert started(s, 1.0) == ["l"]
    # Ageing: after waiting ageing_factor x its expected duration, "s" goes before newer work.
    s.submit("l2", "long", exec_action(1, 10.0), 15.0)
    s.complete("l", 25.0)
    assert started(s, 25.0) == ["s"]


def test_shortest_remaining_orders_shorter_trajectories_first() -> None:
    s = _short_and_long("shortest-remaining", "l", min_age_s=1e9)
    assert started(s, 1.0) == ["s"]


def _waiting_pair(ageing_wait: float = 2.0) -> Scheduler:
    """One core; "w" (of "short") waited 500 s for it and started at 500; "l" (of "long")
    was submitted at 500 and "s1" (of "short", less left) at 505, both waiting."""
    s = one_node(
        1,
        numa=1,
        ordering="shortest-remaining",
        ageing_factor=1.0,
        min_age_s=0.0,
        ageing_wait=ageing_wait,
    )
    s.open_trajectory("short", hint_steps=100)
    s.open_trajectory("long", hint_steps=1000)
    _hold_the_core(s)
    assert s.recent_wait_s == 0.0  # an adopted action never waited in this queue
    s.submit("w", "short", exec_action(1, 10.0), 0.0)
    s.complete("hold", 500.0)
    assert started(s, 500.0) == ["w"]
    assert s.recent_wait_s == 500.0  # the plain mean until 100 starts
    s.submit("l", "long", exec_action(1, 10.0), 500.0)
    s.submit("s1", "short", exec_action(1, 10.0), 505.0)
    s.complete("w", 511.0)
    return s


def test_shortest_remaining_ages_by_the_duration_bound() -> None:
    s = _waiting_pair(ageing_wait=0.0)  # overdue after 1 x its 10 s: "l" at 510
    assert started(s, 511.0) == ["l"]


def test_shortest_remaining_ages_by_the_recent_wait() -> None:
    """Overdue after ageing_factor x its duration or ageing_wait x the recent mean wait,
    whichever is later: when everyone waits long, the bound grows with it."""
    s = _waiting_pair()  # "l" overdue at 500 + 2 x 500 = 1500
    assert started(s, 511.0) == ["s1"]
    s.submit("s2", "short", exec_action(1, 10.0), 1400.0)
    s.complete("s1", 1501.0)
    assert started(s, 1501.0) == ["l"]


def test_an_outlived_hint_falls_back_to_the_survival_estimate() -> None:
    s = one_node(1, numa=1, ordering="shortest-remaining", min_age_s=1e9)
    s.open_trajectory("under", hint_steps=1)
    s.open_trajectory("other", hint_steps=3)
    s.submit("u0", "under", exec_action(1, 1.0), 0.0)
    (asg,) = s.schedule(0.0).assignments
    s.complete(asg.action_id, 1.0)
    _hold_the_core(s, at=1.0, t1=1.0)
    s.submit("u1", "under", exec_action(1, 1.0), 1.0)  # one step more than it said
    s.submit("o0", "other", exec_action(1, 1.0), 1.5)
    s.complete("hold", 2.0)
    # Not "0 left, so first": with no finished trajectory yet, 8 steps are assumed.
    assert started(s, 2.0) == ["o0"]


def test_cancel_and_close_drop_queued_actions() -> None:
    s = one_node(1, numa=1)
    s.open_trajectory("t")
    s.submit("a", "t", exec_action(1, 1.0), 0.0)
    s.submit("b", "t", exec_action(1, 1.0), 0.0)
    assert s.cancel("b") is True
    assert s.cancel("b") is False
    (asg,) = s.schedule(0.0).assignments
    s.submit("c", "t", exec_action(1, 1.0), 0.0)
    with pytest.raises(SchedulingError, match="running"):
        s.close_trajectory("t")
    s.complete(asg.action_id, 1.0)
    assert s.close_trajectory("t") == ["c"]
    assert s.queued == 0


def test_a_remaining_steps_hint_counts_down() -> None:
    s = one_node(1, numa=1, ordering="trajectory-priority", min_age_s=1e9)
    s.open_trajectory("hinted")
    s.open_trajectory("other", hint_steps=3)
    s.set_hint("hinted", 5)
    # After four finished steps, "hinted" has 1 step left and "other" still 3.
    for i in range(4):
        s.submit(f"h{i}", "hinted", exec_action(1, 1.0), float(i))
        (asg,) = s.schedule(float(i)).assignments
        s.complete(asg.action_id, float(i) + 1)
    _hold_the_core(s, at=4.0, t1=1.0)
    s.submit("h4", "hinted", exec_action(1, 1.0), 4.0)
    s.submit("o0", "other", exec_action(1, 1.0), 4.5)
    s.complete("hold", 5.0)
    assert started(s, 5.0) == ["o0"]


def test_adopt_refuses_more_than_the_node_has_and_changes_nothing() -> None:
    s = one_node(8, numa=1)
    s.open_trajectory("a")
    s.open_trajectory("b")
    s.adopt("r1", "a", exec_action(6, 1.0), units=6, started_at=0.0)
    with pytest.raises(SchedulingError, match="free cores"):
        s.adopt("r2", "b", exec_action(6, 1.0), units=6, started_at=0.0)
    assert "r2" not in s.actions and "r2" not in s.running
    assert s.queued == 0 and s.cpu.nodes["n1"].free_cores == 2


def test_a_t1_only_elastic_type_is_probed_and_then_learned() -> None:
    # t1 given, no efficiency curve: the type is learned, not probed forever.
    s = one_node(32, numa=1)
    now = 0.0
    for i in range(24):
        s.open_trajectory(f"t{i}")
        s.submit(f"a{i}", f"t{i}", exec_action({"min": 1, "max": 16}, t1=60.0), now)
        (asg,) = s.schedule(now).assignments
        now += 60.0 * (0.2 + 0.8 / asg.units)
        s.complete(asg.action_id, now)
        s.close_trajectory(f"t{i}")
    assert s.book.learned("exec:cpu1-16") is not None


@given(
    t1=st.floats(1e-3, 1e5),
    p=st.floats(0.0, 1.0),
    units=st.lists(st.integers(1, 256), min_size=1, max_size=40, unique=True).map(sorted),
)
def test_a_profiles_sizes_at_once_are_its_durations_one_by_one(
    t1: float, p: float, units: list[int]
) -> None:
    """The inlined Amdahl sizes are the same floats as ``duration`` (decisions never differ)."""
    profile = Profile(t1, AmdahlEfficiency(amdahl=p))
    assert profile.durations(tuple(units)) == {m: profile.duration(m) for m in units}
    table = Profile(t1, TableEfficiency(table={1: 1.0, 8: 0.5}))
    assert table.durations(tuple(units)) == {m: table.duration(m) for m in units}


def test_an_assumed_recent_wait_moves_as_a_learned_one() -> None:
    s = one_node(1, numa=1, ordering="shortest-remaining")
    s.assume_recent_wait(100.0)
    s.open_trajectory("t")
    s.submit("a", "t", exec_action(1, 1.0), 0.0)
    assert started(s, 0.0) == ["a"]
    assert s.recent_wait_s == pytest.approx(99.0)  # one start of 0 s moves it by 1 %
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(SchedulingError, match="recent_wait_s"):
            s.assume_recent_wait(bad)
