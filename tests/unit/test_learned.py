"""What a scheduler learned outlives it: exported as a document, resumed by the next one."""

from __future__ import annotations

import logging
from pathlib import Path
from unittest.mock import patch

import pytest
from pydantic import ValidationError

from tangram.api.field_errors import described
from tangram.api.learned import MAX_SECONDS, MAX_STEPS, LearnedFit, LearnedState
from tangram.scheduler import Scheduler, SchedulerConfig
from tangram.scheduler.core.ordering import LengthModel
from tangram.scheduler.core.profiles import ProfileBook
from tangram.scheduler.core.returns import RunningMean
from tangram.service.learned_file import LearnedFile, _unusable, read_state

from .helpers import cluster, exec_action

SUITE = exec_action({"min": 1, "max": 16}, type_="suite")
BAD_FIT = {"n": 1, "sx": 1, "sy": 1, "sxx": 1, "sxy": 1, "syy": 1}


def _node() -> Scheduler:
    nodes = [{"name": "n1", "cpus": 32, "numa_nodes": 1, "memory_gb": 64}]
    return Scheduler(cluster(nodes=nodes), SchedulerConfig())


def _first_size(s: Scheduler, tid: str = "next") -> int:
    """The cores the next "suite" run gets on an idle node."""
    s.open_trajectory(tid)
    s.submit(f"{tid}-a", tid, SUITE, 0.0)
    (asg,) = s.schedule(0.0).assignments
    return asg.units


def _taught() -> Scheduler:
    """A scheduler that ran 24 trajectories of one step each: the suite's profile trusted
    (as in test_scheduler's probing test), their lengths and think times seen."""
    s = _node()
    now = 0.0
    for i in range(24):
        tid = f"t{i}"
        s.open_trajectory(tid)
        s.submit(f"a{i}", tid, SUITE, now)
        (asg,) = s.schedule(now).assignments
        now += 60.0 * (0.1 + 0.9 / asg.units)
        s.complete(asg.action_id, now)
        s.close_trajectory(tid)
    s.returns.think.observe(4.0)
    return s


def test_a_resumed_scheduler_sizes_as_the_one_that_learned() -> None:
    taught = _taught()
    assert taught.book.learned("suite") is not None
    saved = taught.learned().model_dump_json()
    resumed = _node()
    resumed.resume(LearnedState.model_validate_json(saved))
    assert resumed.book.learned("suite") == taught.book.learned("suite")
    assert resumed.book.mean_duration("suite") == taught.book.mean_duration("suite")
    assert resumed.lengths.lengths == taught.lengths.lengths == [1] * 24
    assert resumed.recent_wait_s == taught.recent_wait_s
    assert resumed.returns.think == taught.returns.think
    assert (resumed.returns.work, resumed.returns.run) == (taught.returns.work, taught.returns.run)
    assert resumed.learned() == taught.learned()
    # What resuming is for: elastic sizes at once, where a fresh scheduler probes first.
    assert _first_size(resumed) == _first_size(taught) > 2
    assert _first_size(_node()) == 1


def test_resuming_replaces_what_was_learned_of_the_same_types_only() -> None:
    taught = _taught()
    s = _node()
    s.book.observe("other", 1, 5.0)
    s.book.observe("suite", 1, 1000.0)
    version = s.book.version("suite")
    s.resume(taught.learned())
    assert s.book.mean_duration("other") == 5.0
    assert s.book.mean_duration("suite") == taught.book.mean_duration("suite")
    assert s.book.version("suite") > version  # sizes cached for the old profile are stale


def test_many_lengths_are_kept_as_evenly_spaced_quantiles() -> None:
    m = LengthModel(lengths=list(range(10_000)))
    assert m.export(4) == [1250, 3750, 6250, 8750]
    assert m.export(10_000) == m.lengths and m.export(20_000) == m.lengths
    m.restore([9, 3, 5])
    assert m.lengths == [3, 5, 9] and m.expected_remaining(4) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("version", 2, "version"),
        ("lengths", [3, -1], "lengths.1"),
        ("profiles", {"suite": {**BAD_FIT, "counts": [0]}}, "profiles.suite.counts.0"),
        ("think_s", {"mean": -1.0, "seen": 3}, "think_s.mean"),
        ("recent_work", {"exec": {"mean": -1.0, "seen": 3}}, "recent_work.exec.mean"),
        ("extra", 1, "extra"),
    ],
)
def test_a_bad_document_names_the_field(field: str, value: object, where: str) -> None:
    with pytest.raises(ValidationError) as e:
        LearnedState.model_validate({field: value})
    assert ".".join(str(p) for p in e.value.errors()[0]["loc"]) == where


def test_the_document_keeps_the_most_observed_types_of_sane_names() -> None:
    book = ProfileBook()
    for i in range(5):
        for _ in range(i + 1):
            book.observe(f"type-{i}", 1, 1.0)
    book.observe("x" * 300, 1, 1.0)  # a client's invented name: not kept
    book.should_probe("never-ran")  # counted for probing, no run seen: nothing to keep
    assert list(book.export(3, 256)) == ["type-4", "type-3", "type-2"]
    assert len(book.export(100, 256)) == 5
    with pytest.raises(ValidationError):  # and a document must not hold more
        LearnedState.model_validate({"profiles": {"x" * 300: BAD_FIT | {"counts": [1]}}})


def test_the_document_keeps_the_recent_work_of_the_most_run_kinds_of_sane_names() -> None:
    s = _node()
    for kind, runs in (("exec", 3), ("api:search", 2), ("service:judge", 1), ("x" * 300, 5)):
        for _ in range(runs):
            s.recent_work.setdefault(kind, RunningMean()).observe(2.0)
    s.recent_work["api:idle"] = RunningMean()  # none ended: nothing learned
    assert set(s.learned().recent_work) == {"exec", "api:search", "service:judge"}
    with patch("tangram.scheduler.core.scheduler.MAX_PROFILES", 2):
        assert set(s.learned().recent_work) == {"exec", "api:search"}
    with pytest.raises(ValidationError):  # and a document must not hold a longer one
        LearnedState.model_validate({"recent_work": {"x" * 300: {"mean": 1.0, "seen": 1}}})


def test_the_environments_to_close_are_bounded_and_read_back() -> None:
    from tangram.api.learned import MAX_CLOSING

    with pytest.raises(ValidationError, match=f"closing: more than {MAX_CLOSING}"):
        LearnedState(closing={"n1": [f"t{i}" for i in range(MAX_CLOSING + 1)]})
    kept = LearnedState(closing={"n1": ["t1"]})
    assert LearnedState.model_validate_json(kept.model_dump_json()) == kept


FIT = {"n": 3, "sx": 1.5, "sy": 30.0, "sxx": 1.25, "sxy": 12.0, "syy": 400.0, "counts": [1, 2]}


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("lengths", [10**400, 3], "lengths.0"),  # validated as an int, overflowed every estimate
        ("lengths", [3, MAX_STEPS + 1], "lengths.1"),
        ("profiles", {"suite": {**FIT, "sy": 1e300}}, "profiles.suite.sy"),
        ("profiles", {"suite": {**FIT, "n": 10**30}}, "profiles.suite.n"),
        ("profiles", {"suite": {**FIT, "counts": [1, 10**6]}}, "profiles.suite.counts.1"),
        ("think_s", {"mean": 1e300, "seen": 3}, "think_s.mean"),
        ("exec_run_s", {"mean": 1.0, "seen": 10**20}, "exec_run_s.seen"),
    ],
)
def test_a_number_no_scheduler_learns_is_refused_naming_the_field(
    field: str, value: object, where: str
) -> None:
    with pytest.raises(ValidationError) as e:
        LearnedState.model_validate({field: value})
    assert described(e.value).startswith(f"{where}: Input should be less than or equal to")


def test_what_a_real_scheduler_learns_is_in_range_and_the_core_can_use_it() -> None:
    s = _taught()
    s.lengths.finished(MAX_STEPS * 10)  # a trajectory longer than any: counted as MAX_STEPS
    s.book.observe("suite", 16, MAX_SECONDS)
    kept = LearnedState.model_validate_json(s.learned().model_dump_json())
    assert max(kept.lengths) == MAX_STEPS and _unusable(kept) is None
    assert _unusable(LearnedState(profiles={"suite": LearnedFit.model_validate(FIT)})) is None


def test_a_document_the_core_cannot_compute_with_is_set_aside_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The second line: were a bound missed, reading computes what the core would, and a
    document it cannot compute with is set aside, the field named, as one out of range."""
    huge = LearnedState.model_construct(**{**dict(LearnedState()), "lengths": [10**400, 3]})
    why = _unusable(huge)
    assert why is not None and why.startswith("lengths: the scheduler cannot compute with it")
    assert "OverflowError" in why
    store = LearnedFile(tmp_path / "learned.json")
    store.write(b"{}")
    monkeypatch.setattr(LearnedState, "model_validate_json", lambda document: huge)
    caplog.set_level(logging.ERROR, "tangram.service")
    assert read_state(store) is None
    assert (tmp_path / "learned.json.bad").read_bytes() == b"{}" and not store.path.exists()
    assert "lengths: the scheduler cannot compute with it" in caplog.text
