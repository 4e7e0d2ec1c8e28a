"""The two rules for a call waiting for one quota while another it needs has room:
``hold`` (the default) closes that one too; ``pass`` lets calls that need only it pass,
the first waiter keeping just its own units of it."""

from __future__ import annotations

from typing import Literal

from tangram.api.action import ActionSpec
from tangram.scheduler import Scheduler, SchedulerConfig

from .helpers import api_call, cluster, started


def _both() -> ActionSpec:
    """A search call that also parses a PDF: one unit of each quota."""
    return ActionSpec.model_validate({"kind": "api", "api": "search", "quotas": {"pdf": 1}})


def _pool(search: int, pdf: int, rule: Literal["hold", "pass"] = "pass") -> Scheduler:
    apis = [{"name": "search", "concurrency": search}, {"name": "pdf", "concurrency": pdf}]
    return Scheduler(
        cluster(nodes=[{"name": "n1", "cpus": 1}], apis=apis),
        SchedulerConfig(quota_waiting=rule),
    )


def test_by_default_a_call_waiting_for_one_quota_holds_the_others_too() -> None:
    s = _pool(search=4, pdf=1, rule="hold")
    s.open_trajectory("t1")
    s.submit("parse", "t1", api_call("pdf"), now=0.0)
    assert started(s, 0.0) == ["parse"]
    s.submit("both", "t1", _both(), now=1.0)
    s.submit("search-0", "t1", api_call("search"), now=1.0)
    assert started(s, 1.0) == []  # behind "both" on search, which has room
    s.complete("parse", now=2.0)
    assert started(s, 2.0) == ["both", "search-0"]


def test_calls_on_another_quota_pass_a_call_waiting_for_one_but_leave_it_its_units() -> None:
    s = _pool(search=4, pdf=1)
    s.open_trajectory("t1")
    s.submit("parse", "t1", api_call("pdf"), now=0.0)
    assert started(s, 0.0) == ["parse"]  # holds the only pdf unit
    s.submit("both", "t1", _both(), now=1.0)
    for i in range(4):
        s.submit(f"search-{i}", "t1", api_call("search"), now=1.0)
    # "both" waits for pdf and keeps one search unit: three of the four searches pass it.
    assert started(s, 1.0) == ["search-0", "search-1", "search-2"]
    assert s.quotas["search"].free(1.0) == 1
    s.complete("parse", now=2.0)
    assert started(s, 2.0) == ["both"]  # its search unit was there
    s.complete("search-0", now=3.0)
    assert started(s, 3.0) == ["search-3"]


def test_a_call_short_of_every_quota_it_needs_holds_them_all_in_order() -> None:
    """Passing or not, what it is short of closes to everything behind it."""
    s = _pool(search=1, pdf=1)
    s.open_trajectory("t1")
    s.submit("search-0", "t1", api_call("search"), now=0.0)
    s.submit("parse", "t1", api_call("pdf"), now=0.0)
    assert started(s, 0.0) == ["search-0", "parse"]
    s.submit("both", "t1", _both(), now=1.0)
    s.submit("search-1", "t1", api_call("search"), now=1.0)
    s.submit("parse-1", "t1", api_call("pdf"), now=1.0)
    assert started(s, 1.0) == []
    s.complete("search-0", now=2.0)
    assert started(s, 2.0) == []  # search is free, but "both" still waits for pdf
    s.complete("parse", now=3.0)
    assert started(s, 3.0) == ["both"]
