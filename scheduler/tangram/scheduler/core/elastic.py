"""Greedy eviction over one key resource (seed 000 §4.2, Algorithm 1, lines 7-12).

Start from all candidates, each scheduled by DPArrange; repeatedly evict the
last candidate (its units go to the ones ahead of it) while the approximated
objective (Algorithm 2) strictly improves. All prefixes read one DP table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tangram.scheduler.core.dp import BasicTable, ChunkState, ChunkTable, Durations, chunk_level
from tangram.scheduler.core.objective import Pending, Tail, estimate_split, unit_slots


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionStep:
    """One evaluated prefix, kept for ``tangram explain``."""

    kept: int
    units: tuple[int, ...]
    exact: float
    approx: float

    @property
    def objective(self) -> float:
        return self.exact + self.approx


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrangement:
    kept: int  # the first `kept` candidates run now
    units: tuple[int, ...]
    steps: tuple[EvictionStep, ...]


def _improves(objective: float, best: float) -> bool:
    """Whether ``objective`` is lower than ``best`` by more than rounding (relative 1e-9);
    equal infinities are a tie."""
    if math.isinf(best):
        return objective < best
    return objective < best - 1e-9 * max(1.0, abs(best))


def _pending(d: Durations) -> Pending:
    ks = tuple(sorted(d))
    return Pending(ks, tuple(d[k] for k in ks))


def greedy_evict(
    candidates: Sequence[Durations],
    rest: Sequence[Pending],
    running: Sequence[tuple[float, int]],
    depth: int,
    *,
    capacity: int | None = None,
    chunks: ChunkState | None = None,
    doubling: bool = False,
) -> Arrangement:
    """Choose how many candidates run now and their units.

    ``candidates`` map allowed units -> duration, in queue order; ``rest`` is the
    remaining queue of this resource; ``running`` holds (seconds until release,
    units) of actions already running on it. Exactly one of ``capacity`` (basic
    operator: free units) and ``chunks`` (GPU operator: free chunk counts) is given.
    """
    if (capacity is None) == (chunks is None):
        raise ValueError("give exactly one of capacity and chunks")
    table: BasicTable | ChunkTable
    size: Callable[[int], int]
    if chunks is not None:
        table = ChunkTable(candidates, chunks)
        free = sum(c * s for c, s in zip(chunks, (1, 2, 4, 8), strict=True))
        size = chunk_level
    else:
        assert capacity is not None
        table = BasicTable(candidates, capacity)
        free = capacity

        def size(k: int) -> int:
            return k

    n = len(candidates)
    if n == 0:
        return Arrangement(kept=0, units=(), steps=())
    # What waits behind prefix p is candidates[p:] then the rest: flattened once, so each
    # evaluation only slices (the rest can be the node's whole queue).
    waiting = [_pending(d) for d in candidates]
    waiting.extend(rest)
    flat = Tail.of(waiting)

    def evaluate(p: int) -> EvictionStep:
        exact, units = table.best(p)
        used = sum(size(k) for k in units)
        releases = list(running)
        releases.extend((candidates[i][k], size(k)) for i, k in enumerate(units))
        slots = unit_slots(free - used, releases)
        approx = 0.0
        if p < len(waiting):
            behind = Tail(flat.units[p + 1 :], flat.durations[p + 1 :], flat.single)
            approx = estimate_split(slots, waiting[p], behind, depth, doubling)
        return EvictionStep(kept=p, units=tuple(units), exact=exact, approx=approx)

    best = evaluate(n)
    steps = [best]
    p = n
    # As in Algorithm 1 (t runs to |C_j|), evicting every candidate is allowed — waiting
    # for more units can beat starting now at the minimum — but only while some running
    # action will release units: otherwise nothing would wake the resource up again (the
    # estimate can also be fooled by queued actions that wait on another resource).
    keep_at_least = 0 if running else 1
    while p > keep_at_least:
        step = evaluate(p - 1)
        steps.append(step)
        # Strictly better beyond rounding: a tie in exact arithmetic must not evict. Nor
        # does a tie of infinite objectives (some action behind can never get its units
        # in the estimate): ``inf - 1e-9 * inf`` would be NaN, and every step a gain.
        if not _improves(step.objective, best.objective):
            break
        best, p = step, p - 1
    return Arrangement(kept=best.kept, units=best.units, steps=tuple(steps))
