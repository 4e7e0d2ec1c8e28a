"""What the scheduler learns stays bounded in memory, whatever the clients send: action
types are their strings, and a long training run finishes millions of trajectories."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tangram.api.wire import ExecRequest
from tangram.scheduler.core.ordering import LengthModel
from tangram.scheduler.core.profiles import ProfileBook


def test_the_book_forgets_the_least_run_types_of_a_flood() -> None:
    book = ProfileBook(max_types=4)
    for _ in range(10):
        for popular in ("suite", "lint", "build"):
            book.observe(popular, 2, 3.0)
    for i in range(100):  # a client inventing a type per action
        book.should_probe(f"once-{i}")
        book.observe(f"once-{i}", 1, 1.0)
        assert len(book) <= 8
    for popular in ("suite", "lint", "build"):
        assert book.mean_duration(popular) == pytest.approx(3.0)
    assert book.mean_duration("once-0") == book.default_s  # forgotten: as never seen


def test_a_forgotten_type_seen_again_never_gets_a_version_it_had() -> None:
    """A queued action's cached sizes carry its type's version: a type forgotten and
    learned again must not match a stale one."""
    book = ProfileBook(max_types=1)
    book.observe("x", 1, 5.0)
    old = book.version("x")
    for i in range(3):
        book.observe(f"busy-{i}", 1, 1.0)
        book.observe(f"busy-{i}", 1, 1.0)
    assert book.version("x") == 0  # forgotten
    book.observe("x", 1, 9.0)
    assert book.version("x") not in (0, old)
    assert book.mean_duration("x") == pytest.approx(9.0)


def test_lengths_are_the_most_recent_window() -> None:
    m = LengthModel(window=5)
    for steps in range(1, 11):
        m.finished(steps)
    assert m.lengths == [6, 7, 8, 9, 10]
    assert m.export(5) == [6, 7, 8, 9, 10] and m.export(2) == [7, 9]
    m.finished(1)  # drops 6, the oldest
    assert m.lengths == [1, 7, 8, 9, 10] and m.export(5) == [7, 8, 9, 10, 1]
    assert m.expected_remaining(7) == pytest.approx((8 + 9 + 10) / 3 - 7)


@given(
    st.lists(st.integers(1, 60), max_size=60),
    st.integers(1, 12),
    st.lists(st.integers(0, 70), min_size=1, max_size=10),
)
def test_expected_remaining_is_the_mean_over_the_window(
    finished: list[int], window: int, taken: list[int]
) -> None:
    """Against brute force: the mean of the window's lengths beyond what was taken."""
    m = LengthModel(window=window)
    for i, steps in enumerate(finished):
        m.finished(steps)
        recent = finished[max(0, i + 1 - window) : i + 1]
        assert m.lengths == sorted(recent)
        for t in taken:
            longer = [n for n in recent if n > t]
            want = sum(longer) / len(longer) - t if longer else max(1.0, float(t))
            assert m.expected_remaining(t) == want  # exact: the same integer sums


def test_a_clients_type_is_bounded_on_the_wire() -> None:
    ExecRequest(argv=["true"], type="t" * 256)
    with pytest.raises(ValidationError) as e:
        ExecRequest(argv=["true"], type="t" * 257)
    assert e.value.errors()[0]["loc"] == ("type",)
