"""The ACT approximation (Algorithm 2) against a direct simulation of its definition.

``estimate`` walks the queue on a heap of unit release times, with the queue behind the
head flattened for speed; the reference below places each action by sorting the release
times, so that a fast path that drops or reorders an action shows up as a different sum.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.scheduler.core.objective import Pending, Tail, estimate, head_choices, unit_slots


def _reference(slots: list[float], rest: list[Pending], depth: int, doubling: bool) -> float:
    if not rest:
        return 0.0
    best = math.inf
    for i in head_choices(len(rest[0].units), depth, doubling):
        free = sorted(slots)
        total = 0.0
        for j, p in enumerate(rest):
            u, d = (p.units[i], p.durations[i]) if j == 0 else (p.units[0], p.durations[0])
            if u > len(free):
                total = math.inf
                break
            start = free[u - 1]  # the u-th earliest release: all u units are free then
            free = sorted(free[u:] + [start + d] * u)
            total += start + d
        best = min(best, total)
    return best


def _pending(draw: st.DrawFn, multi: bool) -> Pending:
    first = draw(st.integers(1, 3)) if multi else 1
    units = tuple(range(first, first + draw(st.integers(1, 4))))
    durations = tuple(draw(st.floats(0.0, 50.0)) for _ in units)
    return Pending(units, durations)


@st.composite
def _instances(draw: st.DrawFn) -> tuple[list[float], list[Pending], int, bool]:
    free = draw(st.integers(0, 6))
    releases = draw(st.lists(st.tuples(st.floats(0.0, 30.0), st.integers(1, 3)), max_size=4))
    slots = unit_slots(free, releases)
    multi = draw(st.booleans())  # one-unit queues take the walk's inlined path
    rest = [_pending(draw, multi) for _ in range(draw(st.integers(0, 12)))]
    return slots, rest, draw(st.integers(1, 3)), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(_instances())
def test_estimate_equals_direct_simulation(
    case: tuple[list[float], list[Pending], int, bool],
) -> None:
    slots, rest, depth, doubling = case
    got = estimate(slots, rest, depth, doubling)
    want = _reference(slots, rest, depth, doubling)
    assert got == want or math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-9)


def test_tail_flags_a_queue_of_one_unit_actions() -> None:
    one = Pending((1, 2), (4.0, 2.5))
    assert Tail.of([one, one]).single
    assert not Tail.of([one, Pending((2,), (1.0,))]).single
    assert Tail.of([]).single and Tail.of([one]).durations == [4.0]
