"""The Resource value type of the scheduler core: what it equals and the text it shows."""

from __future__ import annotations

import pytest

from tangram.scheduler import Scheduler
from tangram.scheduler.core.resource import GPU, PLACE, Resource

from .helpers import api_call, cluster, exec_action


def test_text_is_what_explain_and_waiting_reasons_show() -> None:
    assert [str(r) for r in (Resource.cpu("n0"), GPU, Resource.api("search"), PLACE)] == [
        "cpu:n0",
        "gpu",
        "api:search",
        "place",
    ]
    assert f"{Resource.cpu('n0')} (evicted)" == "cpu:n0 (evicted)"


def test_a_value_equal_by_kind_and_name() -> None:
    assert Resource.cpu("n0") == Resource("cpu", "n0")
    assert hash(Resource.cpu("n0")) == hash(Resource("cpu", "n0"))
    assert Resource.cpu("q") != Resource.api("q")  # same name, other kind
    assert {Resource.cpu("n0"), Resource.cpu("n0"), GPU} == {GPU, Resource.cpu("n0")}
    with pytest.raises(AttributeError):
        Resource.cpu("n0").name = "n1"  # type: ignore[misc]


def test_rounds_report_resources_as_values_with_the_same_text() -> None:
    s = Scheduler(
        cluster(
            nodes=[{"name": "n0", "cpus": 1, "memory_gb": 8}],
            apis=[{"name": "search", "concurrency": 1}],
        )
    )
    for tid in ("t1", "t2", "t3"):
        s.open_trajectory(tid)
    s.submit("a1", "t1", exec_action(1), 0.0)
    s.submit("a2", "t2", exec_action(1), 0.0)  # waits for n0's only core
    s.submit("q1", "t3", api_call("search"), 0.0)
    rnd = s.schedule(0.0)
    assert {g.resource for g in rnd.groups} == {Resource.cpu("n0"), Resource.api("search")}
    assert dict(rnd.blocked) == {"a2": "cpu:n0,place"}
