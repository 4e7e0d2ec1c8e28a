"""DPArrange (seed 000 Appendix B; docs/architecture.md) against brute force.

The DP adds durations in candidate order, exactly as ``sum`` over a combination
does, and float addition is monotone, so the DP optimum must equal the brute-force
minimum *exactly* (no tolerance), and the returned units must add up to it exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.scheduler import dp_arrange, dp_arrange_chunks
from tangram.scheduler.core.dp import (
    CHUNK_SIZES,
    BasicTable,
    ChunkState,
    ChunkTable,
    chunk_level,
    take_chunk,
)

Durations = dict[int, float]

FAST = settings(max_examples=300, deadline=None)
MEDIUM = settings(max_examples=150, deadline=None)

finite_durations = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
# Integer-valued durations make ties common (and exact), for the tie-break properties.
tied_durations = st.integers(min_value=0, max_value=6).map(float)


def candidate(
    units: st.SearchStrategy[int], dur: st.SearchStrategy[float]
) -> st.SearchStrategy[Durations]:
    return st.dictionaries(units, dur, min_size=1, max_size=4)


def basic_instances(
    dur: st.SearchStrategy[float] = finite_durations,
) -> st.SearchStrategy[tuple[list[Durations], int]]:
    return st.tuples(
        st.lists(candidate(st.integers(1, 6), dur), min_size=1, max_size=5),
        st.integers(0, 16),
    )


chunk_states = st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2))


def chunk_instances(
    dur: st.SearchStrategy[float] = finite_durations,
) -> st.SearchStrategy[tuple[list[Durations], ChunkState]]:
    # Counts up to 10: 9 and 10 exceed a node and must never be chosen.
    return st.tuples(
        st.lists(candidate(st.integers(1, 10), dur), min_size=1, max_size=4),
        chunk_states,
    )


# ---- references -----------------------------------------------------------------------


def total_of(durations: Sequence[Mapping[int, float]], units: Sequence[int]) -> float:
    return sum(d[k] for d, k in zip(durations, units, strict=True))


def brute_basic(
    durations: Sequence[Mapping[int, float]], capacity: int
) -> list[tuple[float, tuple[int, ...]]]:
    """Every feasible combination with its total (summed in candidate order)."""
    out = []
    for combo in itertools.product(*(sorted(d) for d in durations)):
        if sum(combo) <= capacity:
            out.append((total_of(durations, combo), combo))
    return out


def ref_take_chunk(state: ChunkState, k: int) -> ChunkState | None:
    """Independent statement of the best-fit buddy rule (seed 000 §5.3)."""
    need = 1 << max(0, math.ceil(math.log2(k)))
    counts = list(state)
    for level in range(4):
        size = 1 << level
        if size >= need and counts[level] > 0:
            counts[level] -= 1
            # Halving `size` down to `need` frees one buddy at each level in between.
            for lower in range(level):
                if need <= (1 << lower) < size:
                    counts[lower] += 1
            return (counts[0], counts[1], counts[2], counts[3])
    return None


def free_gpus(state: ChunkState) -> int:
    return sum(c * s for c, s in zip(state, CHUNK_SIZES, strict=True))


def brute_chunks(
    durations: Sequence[Mapping[int, float]], chunks: ChunkState
) -> list[tuple[float, tuple[int, ...], ChunkState]]:
    out = []
    for combo in itertools.product(*(sorted(d) for d in durations)):
        state: ChunkState | None = chunks
        for k in combo:
            if k > 8 or state is None:
                state = None
                break
            state = ref_take_chunk(state, k)
        if state is not None:
            out.append((total_of(durations, combo), combo, state))
    return out


# ---- dp_arrange -----------------------------------------------------------------------


@FAST
@given(basic_instances())
def test_dp_arrange_equals_brute_force(instance: tuple[list[Durations], int]) -> None:
    durations, capacity = instance
    feasible = brute_basic(durations, capacity)
    if not feasible:
        with pytest.raises(ValueError):
            dp_arrange(durations, capacity)
        return
    total, units = dp_arrange(durations, capacity)
    assert total == min(t for t, _ in feasible)
    assert len(units) == len(durations)
    assert all(k in d for d, k in zip(durations, units, strict=True))
    assert sum(units) <= capacity
    assert total_of(durations, units) == total


@FAST
@given(basic_instances(tied_durations))
def test_dp_arrange_ties_leave_most_units_free(instance: tuple[list[Durations], int]) -> None:
    """Among optimal allocations the DP returns one that uses the fewest units."""
    durations, capacity = instance
    feasible = brute_basic(durations, capacity)
    if not feasible:
        return
    total, units = dp_arrange(durations, capacity)
    best = min(t for t, _ in feasible)
    assert total == best
    assert sum(units) == min(sum(c) for t, c in feasible if t == best)


@FAST
@given(basic_instances())
def test_basic_table_serves_every_prefix(instance: tuple[list[Durations], int]) -> None:
    durations, capacity = instance
    table = BasicTable(durations, capacity)
    assert table.best(0) == (0.0, [])
    for p in range(1, len(durations) + 1):
        try:
            expected = dp_arrange(durations[:p], capacity)
        except ValueError:
            with pytest.raises(ValueError):
                table.best(p)
            continue
        assert table.best(p) == expected


def test_dp_arrange_small_known_instance() -> None:
    # Two elastic candidates, 4 units: (2, 2) costs 5 + 5 = 10, beats (1, 3) = 9 + 3 = 12.
    d = [{1: 9.0, 2: 5.0, 3: 3.0}, {1: 9.0, 2: 5.0, 3: 3.0}]
    assert dp_arrange(d, 4) == (10.0, [2, 2])
    assert dp_arrange(d, 6) == (6.0, [3, 3])
    assert dp_arrange(d, 2) == (18.0, [1, 1])


def test_dp_arrange_empty_candidate_list() -> None:
    assert dp_arrange([], 0) == (0.0, [])
    assert dp_arrange([], 7) == (0.0, [])
    assert BasicTable([], 3).best(0) == (0.0, [])


def test_dp_arrange_capacity_zero_is_infeasible_for_any_candidate() -> None:
    with pytest.raises(ValueError, match="infeasible"):
        dp_arrange([{1: 1.0}], 0)


def test_dp_arrange_candidate_whose_counts_all_exceed_capacity() -> None:
    with pytest.raises(ValueError, match="infeasible"):
        dp_arrange([{5: 1.0, 7: 0.5}], 4)
    # ... also when it is not the first candidate, and the prefix before it stays feasible.
    table = BasicTable([{1: 2.0, 2: 1.0}, {5: 1.0}], 4)
    assert table.best(1) == (1.0, [2])
    with pytest.raises(ValueError, match="infeasible"):
        table.best(2)


def test_dp_arrange_sum_of_minimums_over_capacity() -> None:
    with pytest.raises(ValueError):
        dp_arrange([{2: 1.0, 3: 0.5}, {2: 1.0}, {1: 1.0}], 4)


@pytest.mark.parametrize(
    "bad",
    [
        [{1: math.nan}],
        [{1: -1.0}],
        [{1: 1.0, 2: -0.5}],
        [{1: 1.0, 2: math.nan}],
        [{1: math.inf}],
        [{1: math.inf, 2: 1.0}],
        [{}],
        [{0: 1.0}],
        [{-1: 1.0}],
    ],
)
def test_dp_arrange_rejects_bad_candidates(bad: list[Durations]) -> None:
    with pytest.raises(ValueError):
        dp_arrange(bad, 8)
    with pytest.raises(ValueError):
        dp_arrange_chunks(bad, (0, 0, 0, 1))


def test_dp_arrange_rejects_negative_capacity() -> None:
    with pytest.raises(ValueError):
        dp_arrange([], -1)


def test_bad_duration_is_rejected_even_after_feasible_candidates() -> None:
    with pytest.raises(ValueError, match="candidate 1"):
        dp_arrange([{1: 1.0}, {1: math.nan}], 8)


# ---- GPU chunk operator ---------------------------------------------------------------


@FAST
@given(chunk_states, st.integers(1, 8))
def test_take_chunk_is_the_best_fit_buddy_rule(state: ChunkState, k: int) -> None:
    got = take_chunk(state, k)
    assert got == ref_take_chunk(state, k)
    if got is not None:
        assert free_gpus(got) == free_gpus(state) - chunk_level(k)


@pytest.mark.parametrize(("k", "size"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8)])
def test_chunk_level(k: int, size: int) -> None:
    assert chunk_level(k) == size


@pytest.mark.parametrize("k", [0, -1, 9, 16])
def test_chunk_level_rejects_out_of_range(k: int) -> None:
    with pytest.raises(ValueError):
        chunk_level(k)


def test_take_chunk_splits_down_to_the_requested_level() -> None:
    assert take_chunk((0, 0, 0, 1), 1) == (1, 1, 1, 0)
    assert take_chunk((0, 0, 0, 1), 3) == (0, 0, 1, 0)
    assert take_chunk((1, 0, 1, 1), 2) == (1, 1, 0, 1)  # the 4 is split, not the 8
    assert take_chunk((3, 1, 0, 0), 4) is None


@MEDIUM
@given(chunk_instances())
def test_dp_arrange_chunks_equals_brute_force(instance: tuple[list[Durations], ChunkState]) -> None:
    durations, chunks = instance
    feasible = brute_chunks(durations, chunks)
    if not feasible:
        with pytest.raises(ValueError):
            dp_arrange_chunks(durations, chunks)
        return
    total, units = dp_arrange_chunks(durations, chunks)
    assert total == min(t for t, _, _ in feasible)
    assert all(k in d and k <= 8 for d, k in zip(durations, units, strict=True))
    assert total_of(durations, units) == total
    # The units are realisable one after another by the allocator's rule.
    state: ChunkState | None = chunks
    for k in units:
        assert state is not None
        state = ref_take_chunk(state, k)
    assert state is not None


@MEDIUM
@given(chunk_instances(tied_durations))
def test_dp_arrange_chunks_ties_leave_most_gpus_free(
    instance: tuple[list[Durations], ChunkState],
) -> None:
    durations, chunks = instance
    feasible = brute_chunks(durations, chunks)
    if not feasible:
        return
    total, units = dp_arrange_chunks(durations, chunks)
    best = min(t for t, _, _ in feasible)
    assert total == best
    used = sum(chunk_level(k) for k in units)
    assert used == min(sum(chunk_level(k) for k in c) for t, c, _ in feasible if t == best)


@MEDIUM
@given(chunk_instances())
def test_chunk_table_serves_every_prefix(instance: tuple[list[Durations], ChunkState]) -> None:
    durations, chunks = instance
    table = ChunkTable(durations, chunks)
    assert table.best(0) == (0.0, [])
    for p in range(1, len(durations) + 1):
        try:
            expected = dp_arrange_chunks(durations[:p], chunks)
        except ValueError:
            with pytest.raises(ValueError):
                table.best(p)
            continue
        assert table.best(p) == expected


def test_dp_arrange_chunks_edge_cases() -> None:
    assert dp_arrange_chunks([], (0, 0, 0, 0)) == (0.0, [])
    with pytest.raises(ValueError, match="infeasible"):
        dp_arrange_chunks([{1: 1.0}], (0, 0, 0, 0))
    with pytest.raises(ValueError, match="infeasible"):
        dp_arrange_chunks([{9: 1.0, 16: 0.5}], (0, 0, 0, 2))  # more than one node's GPUs
    with pytest.raises(ValueError, match="infeasible"):
        dp_arrange_chunks([{8: 1.0}], (4, 2, 1, 0))  # 8 GPUs free, but no whole chunk of 8
    # One 4-chunk free: a 3-GPU task takes all of it, so a 1-GPU task cannot follow.
    with pytest.raises(ValueError, match="infeasible"):
        dp_arrange_chunks([{3: 1.0}, {1: 1.0}], (0, 0, 1, 0))
    assert dp_arrange_chunks([{1: 5.0, 2: 3.0}, {1: 5.0, 2: 3.0}], (0, 0, 1, 0)) == (6.0, [2, 2])
    assert dp_arrange_chunks([{1: 5.0, 4: 1.0}, {1: 5.0}], (0, 0, 1, 0)) == (10.0, [1, 1])


@pytest.mark.parametrize("chunks", [(0, 0, -1, 1), (0, 0, 1), (0, 0, 0, 0, 1)])
def test_dp_arrange_chunks_rejects_bad_chunk_counts(chunks: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        dp_arrange_chunks([{1: 1.0}], chunks)  # type: ignore[arg-type]
