"""Actions the pool cannot run where they must: refused when their trajectory is placed
on a node too small for them, and, when no node present can host them, left waiting
without holding anyone back until one that can joins."""

from __future__ import annotations

import pytest

from tangram.api import ApiSpec
from tangram.scheduler import Scheduler, SchedulingError
from tangram.scheduler.core.decisions import Invalid
from tangram.scheduler.core.elastic import greedy_evict
from tangram.scheduler.core.objective import Pending

from .helpers import api_call, cluster, elastic, exec_action, service_call, started


def _small_and_big() -> Scheduler:
    """``small`` (8 cores) has the most free memory; ``big`` (32 cores) is half full."""
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "small", "cpus": 8, "memory_gb": 1000},
                {"name": "big", "cpus": 32, "memory_gb": 100},
            ]
        )
    )
    s.open_trajectory("filler", memory_gb=50)
    s.place_trajectory("filler", "big")
    return s


def test_an_action_too_wide_for_the_node_its_trajectory_lands_on_is_refused_there() -> None:
    s = _small_and_big()
    s.open_trajectory("t", memory_gb=1)
    s.submit("a1", "t", exec_action(1, 5.0), now=0.0)
    s.submit("a2", "t", elastic(16, 32, 100.0, 0.9), now=0.0)  # queued before t is placed
    rnd = s.schedule(0.0)
    assert [(a.action_id, a.node) for a in rnd.assignments] == [("a1", "small")]
    (bad,) = rnd.invalid
    with pytest.raises(SchedulingError) as at_submit:
        s.submit("a3", "t", elastic(16, 32, 100.0, 0.9), now=0.0)
    assert bad == Invalid(action_id="a2", field="cpu", message=at_submit.value.message)
    assert str(bad) == str(at_submit.value)
    assert "a2" not in s.actions and s.queued == 0 and not any(s.waiting.values())
    assert rnd.blocked == ()  # it reserved nothing on its way out
    # small's other trajectories are not held back by it.
    s.open_trajectory("u", memory_gb=1)
    s.place_trajectory("u", "small")
    s.submit("b1", "u", exec_action(1, 5.0), now=1.0)
    assert started(s, 1.0) == ["b1"]
    s.complete("a1", now=5.0)
    assert s.trajectories["t"].in_flight == 0


def test_a_placement_outside_a_round_refuses_in_the_next_round() -> None:
    s = _small_and_big()
    s.open_trajectory("t", memory_gb=1)
    s.submit("wide", "t", exec_action(16, 5.0), now=0.0)
    s.submit("narrow", "t", exec_action(2, 5.0), now=0.0)
    s.place_trajectory("t", "small")  # its environment lives there
    assert list(s.actions) == ["narrow"]
    rnd = s.schedule(0.0)
    assert [a.action_id for a in rnd.assignments] == ["narrow"]
    assert [i.action_id for i in rnd.invalid] == ["wide"]
    assert s.schedule(0.0).invalid == ()  # reported once


def test_an_unplaced_action_wider_than_every_node_left_waits_and_holds_nothing() -> None:
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "big", "cpus": 32, "memory_gb": 100},
                {"name": "small", "cpus": 16, "memory_gb": 100},
            ]
        )
    )
    s.open_trajectory("u")
    s.place_trajectory("u", "small")
    s.open_trajectory("t", memory_gb=1)
    s.submit("wide", "t", exec_action(32, 10.0), now=0.0)
    s.drain_node("big")
    assert s.stranded == {"wide"} and not any(s.waiting.values())
    for now in (1.0, 2.0):
        s.submit(f"u{now}", "u", exec_action(1, 1.0), now=now)
        rnd = s.schedule(now)
        assert [a.action_id for a in rnd.assignments] == [f"u{now}"]
        assert [a for a, _ in rnd.blocked] == ["wide"]
        s.complete(f"u{now}", now + 0.5)
    s.add_node("big2", cores=32, memory_gb=100)  # one that can host it joins
    assert not s.stranded
    (asg,) = s.schedule(3.0).assignments
    assert (asg.action_id, asg.node) == ("wide", "big2")


def test_a_stranded_action_can_still_be_cancelled_by_its_queue_timeout() -> None:
    s = Scheduler(cluster(nodes=[{"name": "big", "cpus": 32}, {"name": "small", "cpus": 8}]))
    s.open_trajectory("t")
    s.submit("wide", "t", exec_action(32, 10.0), now=0.0)
    s.drain_node("big")
    assert s.stranded == {"wide"}
    assert s.cancel("wide")
    assert not s.stranded and s.queued == 0 and s.trajectories["t"].in_flight == 0


def test_a_trajectory_whose_memory_no_node_left_has_holds_no_placement_back() -> None:
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "roomy", "cpus": 8, "memory_gb": 64},
                {"name": "tight", "cpus": 8, "memory_gb": 16},
            ]
        )
    )
    s.open_trajectory("fat", memory_gb=60)
    s.open_trajectory("busy")
    s.place_trajectory("busy", "roomy")
    s.drain_node("roomy")
    s.submit("f", "fat", exec_action(1, 1.0), now=0.0)  # queued after: no node has 60 GB
    s.open_trajectory("thin", memory_gb=1)
    s.submit("n", "thin", exec_action(1, 1.0), now=0.0)
    rnd = s.schedule(0.0)
    assert [a.action_id for a in rnd.assignments] == ["n"]  # f reserves no placement
    assert s.stranded == {"f"}


def _gpus() -> Scheduler:
    return Scheduler(
        cluster(
            nodes=[
                {"name": "g8", "gpus": 8, "gpu_memory_gb": 80},
                {"name": "g2", "gpus": 2, "gpu_memory_gb": 80},
            ],
            services=[
                {"name": "big", "gpu_memory_gb": 100, "dop_choices": [8]},
                {"name": "small", "gpu_memory_gb": 10, "dop_choices": [1]},
            ],
        )
    )


def test_a_call_no_gpu_node_left_can_host_leaves_the_gpus_open_until_one_joins() -> None:
    s = _gpus()
    for t in ("t0", "t1", "t2"):
        s.open_trajectory(t)
    s.submit("b0", "t0", service_call("big", 10.0), now=0.0)
    assert started(s, 0.0) == ["b0"]
    s.submit("b1", "t1", service_call("big", 10.0), now=1.0)  # waits for g8
    assert started(s, 1.0) == []
    s.drain_node("g8")
    assert s.stranded == {"b1"}
    s.submit("s1", "t2", service_call("small", 1.0), now=2.0)
    assert started(s, 2.0) == ["s1"]  # FCFS on the GPUs no longer stops at b1
    s.add_gpu_node("g8", gpus=8, memory_gb=80)
    assert started(s, 3.0) == ["b1"]


def test_a_call_asking_more_of_a_quota_than_its_new_limit_waits_without_blocking_it() -> None:
    s = Scheduler(cluster(nodes=[{"name": "n", "cpus": 1}], apis=[{"name": "q", "concurrency": 4}]))
    s.open_trajectory("t")
    s.place_trajectory("t", "n")
    s.submit("two", "t", exec_action(1, 1.0).model_copy(update={"quotas": {"q": 2}}), now=0.0)
    s.open_trajectory("u")
    s.set_quotas([ApiSpec(name="q", concurrency=1)])
    assert s.stranded == {"two"}
    s.submit("one", "u", api_call("q"), now=0.0)
    assert started(s, 0.0) == ["one"]
    s.complete("one", now=1.0)
    s.set_quotas([ApiSpec(name="q", concurrency=2)])
    assert started(s, 1.0) == ["two"]


# ---- greedy eviction with an infinite objective ---------------------------------------


def test_equal_infinite_objectives_are_a_tie_and_evict_nothing() -> None:
    # 3 GPUs free and 1 running: a queued call needing 8 can never get them in the
    # estimate, so every prefix's objective is infinite.
    candidates = [{1: 5.0, 2: 3.0}, {1: 5.0, 2: 3.0}]
    arrangement = greedy_evict(
        candidates, [Pending((8,), (10.0,))], [(50.0, 1)], 2, chunks=(1, 1, 0, 0)
    )
    assert arrangement.kept == 2
    assert [s.objective for s in arrangement.steps] == [float("inf")] * 2
