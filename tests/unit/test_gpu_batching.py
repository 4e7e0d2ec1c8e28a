"""Forward passes shared by the calls on one replica (node agent, no torch needed)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.node_agent.gpu_batching import SharedPasses


def _in_threads(passes: SharedPasses, calls: list[list[Any]], forward: Any) -> list[Any]:
    """Run each call in a thread of its own; each result is its outputs or its error."""
    results: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        try:
            results[i] = passes.run(calls[i], forward)
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    return results


def _queued(passes: SharedPasses, n: int, timeout_s: float = 30.0) -> None:
    """Wait until ``n`` calls queue behind the running pass (failing, not hanging, if not)."""
    deadline = time.monotonic() + timeout_s
    while len(passes._queue) < n:
        assert time.monotonic() < deadline, f"{len(passes._queue)} of {n} calls queued"
        time.sleep(0.01)


def test_calls_that_arrive_during_a_pass_share_the_next_one() -> None:
    passes = SharedPasses(max_batch=4)
    gate, started = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def forward(batch: list[int]) -> list[int]:
        if not batches:  # the first pass waits, so that the others queue behind it
            started.set()
            gate.wait(30)
        batches.append(list(batch))
        return [x * 10 for x in batch]

    first: list[Any] = []
    t = threading.Thread(target=lambda: first.append(passes.run([1, 2, 3], forward)))
    t.start()
    assert started.wait(30)
    later: list[Any] = []
    waiting = [
        threading.Thread(target=lambda c=c: later.append((c, passes.run(c, forward))))
        for c in ([4, 5], [6, 7])
    ]
    for w in waiting:
        w.start()
    _queued(passes, 2)  # both behind the running pass
    gate.set()
    for w in [t, *waiting]:
        w.join(30)
    assert first == [[10, 20, 30]]
    assert sorted(later) == [([4, 5], [40, 50]), ([6, 7], [60, 70])]
    # One pass for the first call, then one pass of four inputs for both later calls.
    assert len(batches) == 2 and sorted(batches[1]) == [4, 5, 6, 7]


def test_a_call_with_more_inputs_than_max_batch_is_split_in_order() -> None:
    passes = SharedPasses(max_batch=2)
    sizes: list[int] = []

    def forward(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        return [-x for x in batch]

    assert passes.run(list(range(5)), forward) == [0, -1, -2, -3, -4]
    assert sizes == [2, 2, 1] and passes.run([], forward) == []


def test_only_the_call_whose_inputs_fail_gets_the_error() -> None:
    passes = SharedPasses(max_batch=8)
    gate, started = threading.Event(), threading.Event()
    seen: list[list[Any]] = []

    def forward(batch: list[Any]) -> list[Any]:
        if not seen:
            seen.append(batch)
            started.set()
            gate.wait(30)
            return [0 for _ in batch]
        seen.append(batch)
        if "bad" in batch:
            raise ValueError("cannot score 'bad'")
        return [len(str(x)) for x in batch]

    holder = threading.Thread(target=lambda: passes.run(["hold"], forward), daemon=True)
    holder.start()
    assert started.wait(30)
    out: list[Any] = [None, None]

    def run(i: int, inputs: list[Any]) -> None:
        try:
            out[i] = passes.run(inputs, forward)
        except ValueError as e:
            out[i] = e

    callers = [
        threading.Thread(target=run, args=(0, ["ok", "fine"]), daemon=True),
        threading.Thread(target=run, args=(1, ["bad"]), daemon=True),
    ]
    for c in callers:
        c.start()
    _queued(passes, 2)
    gate.set()
    for c in [holder, *callers]:
        c.join(30)
    assert out[0] == [2, 4]
    assert isinstance(out[1], ValueError) and "bad" in str(out[1])
    # The shared pass failed, then each call was scored alone.
    assert seen[1:] == [["ok", "fine", "bad"], ["ok", "fine"], ["bad"]]


def test_a_wrong_number_of_outputs_fails_the_call() -> None:
    passes = SharedPasses(max_batch=4)
    with pytest.raises(ValueError, match="2 outputs for 3 inputs"):
        passes.run([1, 2, 3], lambda batch: batch[:2])
    with pytest.raises(ValueError, match="max_batch"):
        SharedPasses(0)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5),
    st.lists(st.lists(st.integers(-50, 50), max_size=7), min_size=1, max_size=6),
)
def test_concurrent_calls_get_their_own_outputs_in_order(
    max_batch: int, calls: list[list[int]]
) -> None:
    passes = SharedPasses(max_batch)
    sizes: list[int] = []
    lock = threading.Lock()

    def forward(batch: list[int]) -> list[int]:
        with lock:
            sizes.append(len(batch))
        return [x * x + 1 for x in batch]

    results = _in_threads(passes, calls, forward)
    assert results == [[x * x + 1 for x in c] for c in calls]
    assert all(1 <= n <= max_batch for n in sizes)
    assert sum(sizes) == sum(len(c) for c in calls)
