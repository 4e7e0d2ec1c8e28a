"""The call trace of ``tangram bench gpu-pool``: rounds of bursts over a changing mix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.cli.bench_gpu_pool import Call, call_trace

NAMES = ["a", "b", "c", "d"]


def _trace(seed: int = 0, **kw: float) -> list[Call]:
    args = {"rounds": 4, "round_s": 5.0, "burst": 6, "compute_ms": 100.0, "active": 0.5}
    return call_trace(NAMES, seed=seed, **{**args, **kw})  # type: ignore[arg-type]


def test_the_same_seed_gives_the_same_calls() -> None:
    assert _trace(3) == _trace(3)
    assert _trace(3) != _trace(4)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rounds=st.integers(1, 6),
    active=st.floats(0.0, 1.0),
)
def test_calls_arrive_in_order_within_their_rounds(seed: int, rounds: int, active: float) -> None:
    round_s = 4.0
    calls = _trace(seed, rounds=rounds, round_s=round_s, active=active)
    assert [c.at_s for c in calls] == sorted(c.at_s for c in calls)
    for c in calls:
        assert c.service in NAMES and c.compute_ms > 0
        # the burst of a round lies in its first 60 %: trajectories finishing, then a lull
        assert (c.at_s % round_s) <= 0.6 * round_s + 1e-3 and c.at_s < rounds * round_s


def test_every_service_takes_part_when_all_are_active() -> None:
    calls = _trace(0, active=1.0, rounds=1, burst=20)
    assert {c.service for c in calls} == set(NAMES)


def test_a_round_with_no_service_drawn_still_calls_one() -> None:
    calls = _trace(0, active=0.0, rounds=5, burst=10)
    rounds = {int(c.at_s // 5.0) for c in calls}
    assert rounds == set(range(5))
    for r in rounds:
        assert len({c.service for c in calls if int(c.at_s // 5.0) == r}) == 1


def test_no_services_is_refused() -> None:
    with pytest.raises(ValueError, match="no services"):
        call_trace([], rounds=1, round_s=1, burst=1, compute_ms=1, active=1, seed=0)
