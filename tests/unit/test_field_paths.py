"""A 400 names the field by the path the caller sent: pydantic's locations also hold the
tags of tagged unions (a Demand's ``range``, an Efficiency's ``amdahl``), no key of the
input, which are left out."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tangram.api.field_errors import described, field_path
from tangram.api.trace import TraceError, load_trace
from tangram.api.wire import BatchRequest, ExecRequest, OpenTrajectory, ServiceCallRequest
from tangram.service.answers import invalid


@pytest.mark.parametrize(
    ("loc", "path"),
    [
        (("cpu", "range"), "cpu"),
        (("cpu", "range", "min"), "cpu.min"),
        (("cpu", "fixed"), "cpu"),
        (("cpu", "choices", "choices"), "cpu.choices"),
        (("cpu", "choices", "choices", 0), "cpu.choices.0"),
        (("gpu", "choices", "choices"), "gpu.choices"),
        (("efficiency", "amdahl", "amdahl"), "efficiency.amdahl"),
        (("efficiency", "amdahl"), "efficiency"),
        (("efficiency", "table", "table", "2"), "efficiency.table.2"),
        (("actions", 3, "exec", "cpu", "range", "max"), "actions.3.exec.cpu.max"),
        # Keys of a map are what the caller sent, whatever they spell.
        (("labels", "range"), "labels.range"),
        (("env", "table"), "env.table"),
        (("choices",), "choices"),
        ((), ""),
    ],
)
def test_union_tags_are_left_out_of_a_path(loc: tuple[int | str, ...], path: str) -> None:
    assert field_path(loc) == path


def _fields(model: type[ExecRequest | BatchRequest | OpenTrajectory | ServiceCallRequest],
            body: dict[str, Any]) -> list[str]:  # fmt: skip
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    return [d["field"] for d in invalid(errors, skip=1)["error"]["details"]]


ARGV = {"argv": ["true"]}


@pytest.mark.parametrize(
    ("model", "body", "fields"),
    [  # (what a probe of the service found named wrong)
        (ExecRequest, {**ARGV, "efficiency": {"amdahl": 2}}, ["efficiency.amdahl"]),
        (ExecRequest, {**ARGV, "cpu": {"min": 3, "max": 2}}, ["cpu"]),
        (ExecRequest, {**ARGV, "cpu": {"choices": []}}, ["cpu.choices"]),
        (ExecRequest, {**ARGV, "cpu": {"choices": [1, 1]}}, ["cpu.choices"]),
        (ExecRequest, {**ARGV, "cpu": {"min": 1, "max": 5000}}, ["cpu.max"]),
        (ExecRequest, {**ARGV, "cpu": {"min": 1}}, ["cpu.max"]),
        (ExecRequest, {**ARGV, "cpu": {"choices": [1], "max": 2}}, ["cpu.max"]),
        (ExecRequest, {**ARGV, "efficiency": {}}, ["efficiency.amdahl"]),
        (ExecRequest, {**ARGV, "efficiency": {"table": {"2": 1.5}}}, ["efficiency.table"]),
        (ServiceCallRequest, {"inputs": [1], "gpu": {"choices": [0, 0]}}, ["gpu.choices"]),
        (BatchRequest, {"actions": [{"trajectory": "t", "exec": {**ARGV, "cpu": {"min": 2,
                                                                                 "max": 1}}}]},
         ["actions.0.exec.cpu"]),
        (OpenTrajectory, {"env": "e", "labels": {"range": 1}}, ["labels.range"]),
    ],
)  # fmt: skip
def test_a_400_names_the_path_the_caller_sent(
    model: type[ExecRequest | BatchRequest | OpenTrajectory | ServiceCallRequest],
    body: dict[str, Any],
    fields: list[str],
) -> None:
    assert _fields(model, body) == fields


def test_described_errors_name_the_path_too() -> None:
    """The CLI's and the E2B layer's one-line errors (``described``) say it alike."""
    with pytest.raises(ValidationError) as e:
        ExecRequest.model_validate({**ARGV, "cpu": {"choices": []}})
    assert described(e.value, "process").startswith("cpu.choices: List should have")
    line = '{"version":1,"id":"x","steps":[{"action":{"kind":"exec","cpu":{"min":2,"max":1}}}]}'
    with pytest.raises(TraceError, match=r"steps\.0\.action\.cpu: min \(2\)"):
        load_trace([line])
