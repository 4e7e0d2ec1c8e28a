"""A request's values are taken as the JSON types they are, never converted: a wrong one is
a 400 naming its field, whether the route reads the body as JSON (an exec, the action
stream) or FastAPI hands it over as Python objects (a batch, a lease, an open). What the
project's own clients send is still taken."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from tangram.api.demand import RangeDemand, TableEfficiency
from tangram.api.wire import (
    ApiCallRequest,
    ApiLeaseRequest,
    BatchRequest,
    ExecRequest,
    OpenTrajectory,
    ServiceCallRequest,
    StreamExec,
)
from tangram.client.common import exec_body, open_body
from tangram.service.answers import invalid

MODES = ["json", "python"]  # model_validate_json (exec, stream) and model_validate (FastAPI)


def _refused(model: type[BaseModel], body: dict[str, Any], mode: str) -> list[str]:
    """The fields the 400 names, as the HTTP routes build it."""
    with pytest.raises(ValidationError) as e:
        _read(model, body, mode)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    answer = invalid(errors, skip=1)["error"]
    fields = [d["field"] for d in answer["details"]]
    assert answer["message"].startswith(f"{fields[0]}: ")
    return fields


def _read(model: type[BaseModel], body: dict[str, Any], mode: str) -> Any:
    if mode == "json":
        return model.model_validate_json(json.dumps(body))
    return model.model_validate(json.loads(json.dumps(body)))


ARGV = {"argv": ["true"]}
WRONG = [  # (what a probe of the service found accepted)
    (ExecRequest, {**ARGV, "pty": "yes"}, ["pty"]),
    (ExecRequest, {**ARGV, "pty": "on"}, ["pty"]),
    (ExecRequest, {**ARGV, "pty": "1"}, ["pty"]),
    (ExecRequest, {**ARGV, "pty": "true"}, ["pty"]),
    (ExecRequest, {**ARGV, "pty": 1}, ["pty"]),
    (ExecRequest, {**ARGV, "cpu": True}, ["cpu"]),
    (ExecRequest, {**ARGV, "cpu": "1"}, ["cpu"]),
    (ExecRequest, {**ARGV, "cpu": 2.0}, ["cpu"]),
    (ExecRequest, {**ARGV, "cpu": {"min": "1", "max": 2}}, ["cpu.min"]),
    (ExecRequest, {**ARGV, "cpu": {"choices": [1, True]}}, ["cpu.choices.1"]),
    (ExecRequest, {**ARGV, "timeout_s": "5"}, ["timeout_s"]),
    (ExecRequest, {**ARGV, "timeout_s": True}, ["timeout_s"]),
    (ExecRequest, {**ARGV, "t1_s": "1"}, ["t1_s"]),
    (ExecRequest, {**ARGV, "output_cap": "100"}, ["output_cap"]),
    (ExecRequest, {**ARGV, "output_cap": 100.0}, ["output_cap"]),
    (ExecRequest, {**ARGV, "cpu": {"min": 1, "max": 2}, "efficiency": {"amdahl": "0.9"}},
     ["efficiency.amdahl"]),
    (ExecRequest, {**ARGV, "cpu": {"min": 1, "max": 2}, "efficiency": {"table": {"2": "1"}}},
     ["efficiency.table.2"]),
    (ExecRequest, {**ARGV, "cpu": {"min": 1, "max": 2}, "efficiency": {"table": {"x": 1}}},
     ["efficiency.table.x.[key]"]),
    (OpenTrajectory, {"env": "e", "expected_steps": "5"}, ["expected_steps"]),
    (OpenTrajectory, {"env": "e", "expected_steps": True}, ["expected_steps"]),
    (ApiLeaseRequest, {"units": True, "hold_s": "1"}, ["units", "hold_s"]),
    (ApiLeaseRequest, {"queue_timeout_s": "2"}, ["queue_timeout_s"]),
    (ApiCallRequest, {"timeout_s": "3"}, ["timeout_s"]),
    (ServiceCallRequest, {"inputs": [1], "input_size": "10"}, ["input_size"]),
    (ServiceCallRequest, {"inputs": [1], "gpu": {"choices": ["1"]}}, ["gpu.choices.0"]),
    (BatchRequest, {"actions": [{"trajectory": "t", "exec": {**ARGV, "pty": "yes"}}]},
     ["actions.0.exec.pty"]),
    (StreamExec, {"id": "1", "trajectory": "t", "exec": ARGV}, ["id"]),
    (StreamExec, {"id": 1, "trajectory": "t", "exec": ARGV, "stream": "yes"}, ["stream"]),
]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("model", "body", "fields"), WRONG)
def test_a_value_of_the_wrong_json_type_is_refused_naming_its_field(
    model: type[BaseModel], body: dict[str, Any], fields: list[str], mode: str
) -> None:
    assert _refused(model, body, mode) == fields


RIGHT = [
    # A JSON integer is a number (of seconds, a fraction): what a caller writes for 5 s.
    (ExecRequest, {**ARGV, "timeout_s": 5, "queue_timeout_s": 1, "t1_s": 2}),
    (ExecRequest, {**ARGV, "cpu": {"min": 1, "max": 4}, "efficiency": {"amdahl": 1}}),
    # JSON's keys are strings: a table's unit counts are given as "2".
    (ExecRequest, {**ARGV, "cpu": {"choices": [1, 2]},
                   "efficiency": {"table": {"1": 1, "2": 0.9}}}),
    (ExecRequest, {"session": {"kind": "python", "name": "s"}, "code": "1"}),  # literals
    (ApiLeaseRequest, {"units": 2, "hold_s": 30, "queue_timeout_s": 1}),
    (ApiCallRequest, {"method": "POST", "timeout_s": 10, "body": {"any": ["json", 1, True]}}),
    (ServiceCallRequest, {"inputs": ["x", 1], "gpu": {"choices": [1, 2]}, "timeout_s": 60}),
    (BatchRequest, {"actions": [
        {"trajectory": "t", "exec": {**ARGV, "cpu": {"choices": [1, 2]},
                                     "efficiency": {"table": {"1": 1, "2": 0.9}}}},
        {"api": "search", "lease": {"units": 1, "hold_s": 5}},
    ]}),
]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("model", "body"), RIGHT)
def test_values_of_the_right_json_type_are_taken(
    model: type[BaseModel], body: dict[str, Any], mode: str
) -> None:
    _read(model, body, mode)


def test_a_tables_unit_counts_are_read_from_json_keys_and_nothing_looser() -> None:
    assert TableEfficiency.model_validate({"table": {"2": 0.9, 1: 1.0}}).table == {1: 1.0, 2: 0.9}
    for key in ("02", "2.0", " 2", "+2", "two"):
        with pytest.raises(ValidationError, match="valid integer"):
            TableEfficiency.model_validate({"table": {key: 0.9}})
    with pytest.raises(ValidationError, match="must be >= 1"):
        TableEfficiency.model_validate_json('{"table": {"0": 0.9}}')  # (its own message)


def test_a_demand_is_strict_wherever_it_is_read() -> None:
    """A range inside a lax model (a trace's action) is no less strict: the demand's own."""
    with pytest.raises(ValidationError):
        RangeDemand.model_validate({"min": "1", "max": 2})
    with pytest.raises(ValidationError):
        RangeDemand.model_validate({"min": True, "max": 2})


@pytest.mark.parametrize("mode", MODES)
def test_what_the_client_sends_is_taken(mode: str) -> None:
    """The Python client's bodies, every option given (its ints for seconds included)."""
    body = exec_body(
        ["echo", "{dop}"], cores=None, elastic=(1, 4), t1_s=2, amdahl=0.9, timeout_s=30,
        queue_timeout_s=5, env={"A": "1"}, output_cap=1 << 24, stdin="x", pty=True,
        action_type="t",
    )  # fmt: skip
    _read(ExecRequest, body, mode)
    _read(ExecRequest, exec_body(["true"], cores=2), mode)
    _read(ExecRequest, exec_body(["true"], choices=[1, 2, 4]), mode)
    _read(ExecRequest, exec_body(None, session={"kind": "bash", "name": "main"}, code="ls"), mode)
    _read(ExecRequest, exec_body(None, profile="tests", args=["-x"]), mode)
    _read(OpenTrajectory, open_body("e", "t-1", {"a": "b"}, 5, {"A": "1"}), mode)
    item = {"trajectory": "t", "exec": exec_body(["true"], cores=1, timeout_s=1.5)}
    _read(StreamExec, {"id": 7, "stream": True, "interactive": True, **item}, mode)
    _read(BatchRequest, {"actions": [item]}, mode)


def test_what_the_e2b_layer_builds_is_taken() -> None:
    """The E2B routes build their requests in Python (e2b.process, e2b.sandboxes)."""
    ExecRequest(argv=["sh", "-c", "x"], env={"A": "1"}, timeout_s=None, queue_timeout_s=None,
                pty=False, output_cap=0)  # fmt: skip
    ExecRequest(argv=["true"], env={}, timeout_s=0.5, queue_timeout_s=0.5, pty=True,
                output_cap=0)  # fmt: skip
    OpenTrajectory(env="shell", labels={"e2b.timeout": "300"}, env_vars={"A": "1"})
