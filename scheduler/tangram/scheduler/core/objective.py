"""ACT approximation (seed 000 Appendix A, Algorithm 2).

The objective of a candidate prefix is the exact sum of the candidates' durations
under the DP allocation, plus an estimate for the rest of the queue of the same
key resource: each remaining action, in order, waits for its minimum units to
free up and then runs. The first remaining action additionally tries its first
``depth`` allowed unit counts and the best variant counts.

One deliberate refinement: the completion heap holds one entry per *unit* (the
time that unit frees up), not one per action, so an action needing u units waits
for the u-th earliest release rather than for any single completion. With
one-unit actions the two coincide.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pending:
    """A queued action as the estimate sees it: allowed unit counts and their durations."""

    units: tuple[int, ...]  # ascending; units[0] is the minimum
    durations: tuple[float, ...]


def unit_slots(free_units: int, releases: Sequence[tuple[float, int]]) -> list[float]:
    """Heap of the times (from now) at which each unit becomes free."""
    slots = [0.0] * free_units
    for t, u in releases:
        slots.extend([t] * u)
    heapq.heapify(slots)
    return slots


def _run(slots: list[float], units: int, dur: float) -> float:
    """Place one action on the slot heap; return its completion time."""
    if units == 1:
        end = slots[0] + dur
        heapq.heapreplace(slots, end)
        return end
    if units > len(slots):
        return float("inf")
    start = 0.0
    for _ in range(units):
        start = heapq.heappop(slots)
    end = start + dur
    for _ in range(units):
        heapq.heappush(slots, end)
    return end


def head_choices(n: int, depth: int, doubling: bool) -> list[int]:
    """Indices into the head's ``n`` allowed counts that the estimate tries.

    The paper's rule tries the first ``depth`` counts. ``doubling`` (our option)
    tries indices 0, 1, 3, 7, ... and the last, so a waiting action can foresee
    waiting for many units (e.g. 1, 2, 4, 8, 16, 32 cores), not only for 1 or 2.
    """
    if not doubling:
        return list(range(min(max(depth, 1), n)))
    out, i = [0], 1
    while i < n:
        out.append(i)
        i = 2 * i + 1
    if out[-1] != n - 1:
        out.append(n - 1)
    return out


@dataclass(frozen=True, slots=True)
class Tail:
    """The queue behind the head as the estimate walks it: each action's minimum units and
    its duration there, as flat lists (the walk is the hot loop of an elastic round)."""

    units: list[int]
    durations: list[float]
    single: bool  # every action needs one unit: the walk skips the unit test

    @classmethod
    def of(cls, items: Sequence[Pending]) -> Tail:
        units = [p.units[0] for p in items]
        return cls(units, [p.durations[0] for p in items], max(units, default=1) == 1)


def estimate(
    slots: Sequence[float], rest: Sequence[Pending], depth: int, doubling: bool = False
) -> float:
    """Approximate sum of completion times of ``rest`` started in order on ``slots``."""
    if not rest:
        return 0.0
    return estimate_split(slots, rest[0], Tail.of(rest[1:]), depth, doubling)


def estimate_split(
    slots: Sequence[float], head: Pending, tail: Tail, depth: int, doubling: bool = False
) -> float:
    """``estimate`` of ``[head, *tail]``, with the tail already flattened."""
    best = float("inf")
    if not slots:  # no unit will ever be free: nothing waiting can run
        return best
    for i in head_choices(len(head.units), depth, doubling):
        heap = list(slots)
        total = _run(heap, head.units[i], head.durations[i])
        total += _run_all(heap, tail)
        best = min(best, total)
    return best


def _run_all(heap: list[float], tail: Tail) -> float:
    """``_run`` over the tail; the one-unit case is inlined (it is the hot loop)."""
    total = 0.0
    replace = heapq.heapreplace
    if tail.single:
        for d in tail.durations:
            end = heap[0] + d
            replace(heap, end)
            total += end
        return total
    for u, d in zip(tail.units, tail.durations, strict=True):
        if u == 1:
            end = heap[0] + d
            replace(heap, end)
            total += end
        else:
            total += _run(heap, u, d)
    return total
