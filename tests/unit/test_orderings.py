"""One table of queue orderings: the scheduler's configuration, the ActionPool CRD and
``tangram explain`` accept exactly its names, and each name has an implementation."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tangram.api.crd import crd
from tangram.api.orderings import DEFAULT_ORDERING, ORDERINGS, expected_orderings
from tangram.api.resources import Scheduling
from tangram.cli.explain import ConfigState
from tangram.scheduler import Scheduler, SchedulerConfig, SchedulingError
from tangram.scheduler.core.fair import FairQueue
from tangram.scheduler.core.ordering import POLICIES

from .helpers import cluster


def _all(schema: Any, key: str) -> list[Any]:
    """Every value of ``key`` anywhere in a nested schema."""
    if isinstance(schema, dict):
        return ([schema[key]] if key in schema else []) + _all(list(schema.values()), key)
    if isinstance(schema, list):
        return [v for item in schema for v in _all(item, key)]
    return []


def test_every_name_has_an_implementation_and_nothing_else_does() -> None:
    assert list(POLICIES) == list(ORDERINGS)
    assert DEFAULT_ORDERING in ORDERINGS
    assert all(ORDERINGS.values()), "each ordering has a one-line description"
    assert SchedulerConfig().ordering == Scheduling().ordering == ConfigState().ordering
    assert ConfigState().ordering == DEFAULT_ORDERING


@pytest.mark.parametrize("name", list(ORDERINGS))
def test_each_name_is_accepted_everywhere(name: str) -> None:
    s = Scheduler(cluster(nodes=[{"name": "n", "cpus": 1}]), SchedulerConfig(ordering=name))
    policy_queue = type(POLICIES[name].new_queue())
    assert isinstance(s.queue, FairQueue) and type(s.queue.inner()) is policy_queue
    alone = SchedulerConfig(ordering=name, tenant_fairness=False)
    assert type(Scheduler(cluster(nodes=[{"name": "n", "cpus": 1}]), alone).queue) is policy_queue
    assert Scheduling(ordering=name).ordering == name
    assert ConfigState(ordering=name).ordering == name


def test_an_unknown_name_is_refused_everywhere() -> None:
    with pytest.raises(SchedulingError, match="unknown policy 'lifo'"):
        SchedulerConfig(ordering="lifo")
    for model in (Scheduling, ConfigState):
        with pytest.raises(ValidationError) as e:
            model(ordering="lifo")
        assert e.value.errors()[0]["msg"] == (
            "Input should be 'fcfs', 'trajectory-priority' or 'shortest-remaining'"
        )
        assert e.value.errors()[0]["msg"] == f"Input should be {expected_orderings()}"


def test_the_crd_and_explain_schemas_list_the_table() -> None:
    (field,) = [v for v in _all(crd("ActionPool"), "ordering") if isinstance(v, dict)]
    assert field["enum"] == list(ORDERINGS)
    assert field["default"] == DEFAULT_ORDERING
    schema = ConfigState.model_json_schema()["properties"]["ordering"]
    assert schema["enum"] == list(ORDERINGS)
