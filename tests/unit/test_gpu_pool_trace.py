"""The call trace of ``tangram bench gpu-pool``: rounds of bursts over a changing mix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.api.wire import ActionResult, ActionStatus, Allocation, Timings
from tangram.cli.bench_gpu_pool import Answered, Call, busy_seconds, call_trace

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


def _answer(
    setup: str, gpus: list[int], end_s: float, exec_s: float, restore_s: float = 0.0
) -> Answered:
    result = ActionResult(
        id="a",
        kind="service",
        status=ActionStatus.OK,
        allocation=Allocation(gpus=gpus),
        timings=Timings(exec_s=exec_s, restore_s=restore_s),
    )
    return Answered(Call(0.0, "s", 1.0), result, setup, end_s)


def test_busy_counts_calls_sharing_a_device_once_and_devices_apart() -> None:
    shared = [_answer("p", [0], 2.0, 1.0), _answer("p", [0], 2.5, 1.0)]  # [1, 2] and [1.5, 2.5]
    assert busy_seconds(shared) == pytest.approx(1.5)
    # The same device index on another scheduler is another device; a restore is busy time;
    # a call on two devices keeps both busy.
    apart = [
        _answer("p", [0], 2.0, 1.0),
        _answer("q", [0], 2.0, 0.5, restore_s=0.5),
        _answer("p", [1, 2], 10.0, 2.0),
    ]
    assert busy_seconds(apart) == pytest.approx(1.0 + 1.0 + 2 * 2.0)
    inside = [_answer("p", [0], 5.0, 4.0), _answer("p", [0], 3.0, 1.0)]  # [1, 5] holds [2, 3]
    assert busy_seconds(inside) == pytest.approx(4.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 10)), max_size=12))
def test_busy_is_the_measure_of_the_union(spans: list[tuple[int, int, int]]) -> None:
    """Against brute force: on a grid of tenths, the slots some call covers."""
    answers = [_answer("p", [gpu], (lo + n) / 10, n / 10) for gpu, lo, n in spans]
    covered = {(gpu, t) for gpu, lo, n in spans for t in range(lo, lo + n)}
    assert busy_seconds(answers) == pytest.approx(len(covered) / 10)
