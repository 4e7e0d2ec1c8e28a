"""An API quota's burst (spec.apis[].burst, docs/scheduler.md "API quotas"): at most
``burst`` starts in any window of burst / rate seconds, and, for a burst below the rate,
never more than ``rate`` in its ``periodSeconds`` either — checked against a brute force
over every window of the whole history, and through the scheduler."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.api import ActionSpec, ClusterSpec
from tangram.api.cluster import ApiSpec
from tangram.scheduler import Scheduler
from tangram.scheduler.core.quota_pool import Quota


def windows(rate: int, period: float, burst: int | None) -> list[tuple[int, float]]:
    """The limits the docs promise, as (calls, seconds): worked out here, not by the pool."""
    per_s = rate / period  # (k calls take k / per_s seconds at the rate: so in the spec)
    if burst is None or burst == rate:
        return [(rate, rate / per_s)]
    if burst < rate:
        return [(rate, rate / per_s), (burst, burst / per_s)]
    return [(burst, burst / per_s)]


def counted(starts: list[float], now: float, seconds: float) -> int:
    return sum(1 for s in starts if s + seconds > now)


def room(starts: list[float], now: float, limits: list[tuple[int, float]]) -> int:
    return max(0, min(calls - counted(starts, now, seconds) for calls, seconds in limits))


def most_in_any_window(starts: list[float], seconds: float) -> int:
    """The most starts in any window [t, t + seconds) of the history."""
    return max((sum(1 for s in starts if t <= s < t + seconds) for t in starts), default=0)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6),
    st.sampled_from([0.5, 1.0, 2.5, 60.0]),
    st.one_of(st.none(), st.integers(1, 9)),
    st.data(),
)
def test_a_burst_bounds_every_window_and_the_rate_still_holds(
    rate: int, period: float, burst: int | None, data: st.DataObject
) -> None:
    spec = ApiSpec(name="q", rate_per_s=rate / period, period_s=period, burst=burst)
    q = Quota.of(spec)
    limits = windows(rate, period, burst)
    starts: list[float] = []
    now = 0.0
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        now += data.draw(
            st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=2 * period)), label="dt"
        )
        free = q.free(now)
        assert free == room(starts, now, limits)
        wake = q.next_expiry_s(now)
        if wake is None:  # no window will ever admit more than it does now
            assert free == min(calls for calls, _ in limits)
        else:  # the window that binds lets one more start exactly then, not a moment earlier
            assert wake > now
            assert room(starts, math.nextafter(wake, -math.inf), limits) == free
            assert room(starts, wake, limits) > free
        n = data.draw(st.integers(0, max(free, 0)), label="n")
        if n:
            q.acquire(now, n)
            q.release(n)
            starts.extend([now] * n)
    most_at_once = max((starts.count(t) for t in starts), default=0)
    assert most_at_once <= (burst if burst is not None else rate)
    for calls, seconds in limits:
        assert most_in_any_window(starts, seconds) <= calls


def test_a_burst_below_the_rate_spreads_the_starts() -> None:
    """60 calls a minute, one at a time: one a second, and a full minute's 60 never more."""
    q = Quota.of(ApiSpec(name="q", rate_per_s=1.0, period_s=60.0, burst=1))
    assert q.free(0.0) == 1
    q.acquire(0.0, 1)
    assert q.free(0.5) == 0 and q.next_expiry_s(0.5) == 1.0
    assert q.free(1.0) == 1
    for t in range(1, 60):
        q.acquire(float(t), 1)
    assert q.free(60.0) == 1  # the start at 0 left the minute's window at 60


def test_a_burst_above_the_rate_starts_more_at_once_then_waits_as_long() -> None:
    """Rate 2 a minute with a burst of 6: six at once, then none for the 3 minutes six
    calls take at the rate."""
    q = Quota.of(ApiSpec(name="q", rate_per_s=2 / 60, period_s=60.0, burst=6))
    assert q.free(0.0) == 6
    q.acquire(0.0, 6)
    assert q.free(179.9) == 0 and q.next_expiry_s(1.0) == 180.0
    assert q.free(180.0) == 6


def test_the_scheduler_starts_a_burst_and_wakes_for_the_next() -> None:
    cluster = ClusterSpec.model_validate(
        {
            "nodes": [{"name": "n"}],
            "apis": [{"name": "search", "rate_per_s": 10, "period_s": 1, "burst": 2}],
        }
    )
    s = Scheduler(cluster)
    s.open_trajectory("t")
    call = ActionSpec.model_validate({"kind": "api", "api": "search"})
    for i in range(3):
        s.submit(f"a{i}", "t", call, 0.0)
    first = s.schedule(0.0)
    assert [a.action_id for a in first.assignments] == ["a0", "a1"]
    assert first.wake_at == 0.2  # two calls take 0.2 s at 10 a second
    for i in range(2):
        s.complete(f"a{i}", 0.05)
    assert [a.action_id for a in s.schedule(0.2).assignments] == ["a2"]


def test_one_action_never_waits_for_more_units_than_a_burst() -> None:
    """A burst of 2 is the most one action can ever hold: asking 3 is refused at once."""
    cluster = ClusterSpec.model_validate(
        {"nodes": [{"name": "n"}], "apis": [{"name": "search", "rate_per_s": 10, "burst": 2}]}
    )
    s = Scheduler(cluster)
    s.open_trajectory("t")
    three = ActionSpec.model_validate({"kind": "api", "api": "search", "quotas": {"search": 3}})
    try:
        s.submit("big", "t", three, 0.0)
    except ValueError as e:
        assert "search" in str(e)
    else:
        raise AssertionError("an action needing 3 units of a burst of 2 was queued")
