"""The GPU residency plan: hits, LRU eviction on the chunk's devices, refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.node_agent.gpu_residency import (
    BusyError,
    NeverFitsError,
    Residency,
    instance_key,
    name,
)

GB = 2**30


def _residency(devices: int = 2, gb: int = 10) -> Residency:
    return Residency({d: gb * GB for d in range(devices)})


def test_a_resident_instance_on_the_same_chunk_is_a_hit() -> None:
    r = _residency()
    judge0 = ("judge", (0,))
    assert not r.plan(judge0, 4 * GB).hit
    r.admit(judge0, 4 * GB)
    assert r.plan(judge0, 4 * GB).hit
    # The same service on another chunk is another instance (as in the scheduler's pool):
    # restored there, the first one stays.
    plan = r.plan(("judge", (1,)), 4 * GB)
    assert not plan.hit and plan.evict == ()
    assert name(("judge", (0, 1))) == "judge@0,1" and instance_key("j", [1, 0]) == ("j", (0, 1))


def test_the_least_recently_used_idle_instances_go_first() -> None:
    r = _residency(devices=1)
    for svc in ("a", "b", "c"):
        r.admit((svc, (0,)), 3 * GB)
    r.acquire(("a", (0,)))  # a call on a: most recent now, and pinned
    r.release(("a", (0,)))
    plan = r.plan(("d", (0,)), 5 * GB)  # 9 of 10 GB used: 4 must go
    assert plan.evict == (("b", (0,)), ("c", (0,)))


def test_only_the_chunks_devices_are_touched() -> None:
    r = _residency(devices=2)
    r.admit(("other-gpu", (1,)), 9 * GB)
    r.admit(("old", (0,)), 9 * GB)
    assert r.plan(("new", (0,)), 5 * GB).evict == (("old", (0,)),)


def test_a_dop_two_instance_needs_room_on_both_devices() -> None:
    r = _residency(devices=2)
    r.admit(("a", (1,)), 8 * GB)
    assert r.plan(("big", (0, 1)), 5 * GB).evict == (("a", (1,)),)


def test_an_instance_on_a_device_with_room_stays() -> None:
    r = _residency(devices=2)
    r.admit(("a", (1,)), 4 * GB)  # the least recently used, but device 1 has room for c
    r.admit(("b", (0,)), 8 * GB)
    assert r.plan(("c", (0, 1)), 4 * GB).evict == (("b", (0,)),)


def test_busy_instances_are_never_evicted() -> None:
    r = _residency(devices=1)
    running = ("running", (0,))
    r.admit(running, 8 * GB)
    r.acquire(running)
    with pytest.raises(BusyError, match="running calls"):
        r.plan(("new", (0,)), 5 * GB)
    with pytest.raises(BusyError, match="running@0 is running"):
        r.evict(running)
    assert running in r.resident


def test_a_service_larger_than_a_gpu_is_refused_with_the_sizes() -> None:
    with pytest.raises(NeverFitsError, match=r"needs 12\.00 GiB per GPU.*10\.00 GiB"):
        _residency().plan(("huge", (0,)), 12 * GB)
    with pytest.raises(ValueError, match="not this worker's"):
        _residency().plan(("x", (5,)), GB)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcdef"),
            st.sampled_from([(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]),
            st.integers(1, 10),
            st.booleans(),
        ),
        max_size=30,
    )
)
def test_executing_plans_never_overfills_a_device(
    calls: list[tuple[str, tuple[int, ...], int, bool]],
) -> None:
    """Whatever the call sequence: after a plan is carried out the instance fits on every
    device of its chunk, only idle instances sharing a device went, and a refusal happens
    only when running calls hold the memory."""
    r = Residency({d: 10 * GB for d in range(4)})
    for svc, chunk, gb, keep_running in calls:
        key = (svc, chunk)
        try:
            plan = r.plan(key, gb * GB)
        except BusyError:
            held = any(
                sum(p.bytes_per_device for p in r.resident.values() if d in p.devices and p.busy)
                + gb * GB
                > 10 * GB
                for d in chunk
            )
            assert held
            continue
        for victim in plan.evict:
            placement = r.resident[victim]
            assert not placement.busy
            assert victim != key and set(placement.devices) & set(chunk)
            r.evict(victim)
        if not plan.hit:
            r.admit(key, gb * GB)
        for d in range(4):
            assert r.used(d) <= 10 * GB
        if keep_running:
            r.acquire(key)
