"""Wire models: validation errors name the field; Eq. 1 of seed 000."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tangram.api import (
    ActionSpec,
    AmdahlEfficiency,
    ClusterSpec,
    TableEfficiency,
    allowed_units,
    load_trace,
)
from tangram.api.demand import ChoicesDemand, RangeDemand, duration
from tangram.api.trace import TraceError


def _error(data: dict[str, object]) -> str:
    with pytest.raises(ValidationError) as e:
        ActionSpec.model_validate(data)
    return str(e.value)


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"kind": "exec", "cpu": {"min": 3, "max": 2}}, "cpu.range", "min (3) is greater than max"),
        ({"kind": "exec", "cpu": {"choices": []}}, "cpu.choices.choices", "at least 1 item"),
        ({"kind": "exec", "cpu": {"choices": [2, 2]}}, "cpu.choices.choices", "must not repeat"),
        ({"kind": "exec", "cpux": 3}, "cpux", "Extra inputs"),
        ({"kind": "exec", "cpu": 0}, "cpu", "at least one unit"),
        (
            {"kind": "exec", "cpu": {"min": 1, "max": 4}, "efficiency": {"table": {"2": 1.5}}},
            "efficiency.table.table",
            "must be in (0, 1]",
        ),
        (
            {"kind": "exec", "cpu": {"min": 1, "max": 4}, "efficiency": {"amdahl": 1.2}},
            "efficiency.amdahl.amdahl",
            "less than or equal to 1",
        ),
        ({"kind": "exec", "cpu": 2, "efficiency": {"amdahl": 0.5}}, "efficiency", "no resource"),
        ({"kind": "service"}, "service", "must name its RewardService"),
        ({"kind": "api"}, "api", "must name its quota"),
        ({"kind": "api", "api": "Bad Name"}, "api", "lower-case"),
        ({"kind": "exec", "gpu": 2}, "gpu", "only service actions"),
        ({"kind": "teleport"}, "kind", "Input should be"),
        ({"kind": "exec", "t1_s": 0}, "t1_s", "greater than 0"),
        ({"kind": "exec", "t1_s": "inf"}, "t1_s", "finite number"),
        ({"kind": "exec", "cpu": {"min": 1, "max": 100000000}}, "cpu.range.max", "less than"),
        ({"kind": "exec", "memory_gb": 4}, "memory_gb", "Extra inputs"),
        ({"kind": "api", "api": "search", "cpu": 2}, "cpu", "only exec actions"),
    ],
)
def test_bad_action_specs_name_the_field(data: dict[str, object], field: str, words: str) -> None:
    message = _error(data)
    assert field in message
    assert words in message


def test_allowed_units_of_each_demand_form() -> None:
    assert allowed_units(3) == (3,)
    assert allowed_units(RangeDemand(min=2, max=5)) == (2, 3, 4, 5)
    assert allowed_units(ChoicesDemand(choices=[8, 1, 4])) == (1, 4, 8)


def test_amdahl_duration_is_t1_over_speedup() -> None:
    eff = AmdahlEfficiency(amdahl=0.9)
    # speed-up(4) = 1 / (0.1 + 0.9/4) = 3.0769...
    assert duration(100.0, eff, 4) == pytest.approx(100.0 * (0.1 + 0.9 / 4))
    assert duration(100.0, eff, 1) == pytest.approx(100.0)
    assert duration(100.0, None, 16) == 100.0  # not elastic
    with pytest.raises(ValueError, match="positive"):
        duration(1.0, eff, 0)


def test_table_efficiency_interpolates_and_flattens_beyond_the_table() -> None:
    eff = TableEfficiency(table={1: 1.0, 4: 0.7})
    assert eff.efficiency(4) == 0.7
    assert eff.efficiency(2) == pytest.approx(1.0 - (1 / 3) * 0.3)
    # Past the last entry the speed-up stays at 4 * 0.7 = 2.8.
    assert eff.efficiency(8) * 8 == pytest.approx(2.8)


def test_elastic_key_is_inferred_and_checked() -> None:
    assert (
        ActionSpec.model_validate({"kind": "exec", "cpu": {"min": 1, "max": 8}}).elastic_key()
        == "cpu"
    )
    assert ActionSpec.model_validate({"kind": "service", "service": "rm"}).elastic_key() == "gpu"
    assert ActionSpec.model_validate({"kind": "exec", "cpu": 1}).elastic_key() is None
    assert "key" in _error({"kind": "exec", "cpu": 1, "key": "gpu"})


def test_action_type_defaults_to_kind_and_target() -> None:
    assert ActionSpec.model_validate({"kind": "api", "api": "search"}).action_type() == "api:search"
    assert ActionSpec.model_validate({"kind": "exec", "type": "pytest"}).action_type() == "pytest"
    # Shell commands and test suites never share a learned profile by default.
    assert ActionSpec.model_validate({"kind": "exec"}).action_type() == "exec:cpu1"
    ranged = ActionSpec.model_validate({"kind": "exec", "cpu": {"min": 1, "max": 32}})
    assert ranged.action_type() == "exec:cpu1-32"


def test_cluster_validation() -> None:
    with pytest.raises(ValidationError, match="split evenly"):
        ClusterSpec.model_validate({"nodes": [{"name": "a", "cpus": 5, "numa_nodes": 2}]})
    with pytest.raises(ValidationError, match="1, 2, 4 or 8"):
        ClusterSpec.model_validate({"nodes": [{"name": "a", "gpus": 3}]})
    with pytest.raises(ValidationError, match="duplicate names"):
        ClusterSpec.model_validate({"nodes": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValidationError, match="powers of two"):
        ClusterSpec.model_validate(
            {
                "nodes": [{"name": "a"}],
                "services": [{"name": "s", "gpu_memory_gb": 1, "dop_choices": [3]}],
            }
        )


def test_trace_errors_carry_line_and_field() -> None:
    good = '{"version":1,"id":"t1","steps":[{"think_s":1,"action":{"kind":"exec","t1_s":2}}]}'
    assert load_trace([good, ""])[0].steps[0].action.t1_s == 2
    with pytest.raises(TraceError) as e:
        load_trace(
            [good, '{"version":1,"id":"t2","steps":[{"think_s":-1,"action":{"kind":"exec"}}]}']
        )
    assert e.value.line == 2
    assert "steps.0.think_s" in str(e.value)
    with pytest.raises(TraceError, match="duplicate trajectory id"):
        load_trace([good, good])
    with pytest.raises(TraceError, match="version"):
        load_trace(['{"version":2,"id":"x"}'])


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"trajectory": "t", "exec": {"argv": ["true"]}, "score": {"inputs": [1]}}, "exactly one"),
        ({"exec": {"argv": ["true"]}}, "trajectory: an exec item"),
        ({"lease": {}}, "api: a lease or call item"),
        ({"score": {"inputs": [1]}}, "service: a score item"),
        ({"service": "judge", "api": "search", "lease": {}}, "service: only a score item"),
        ({"service": "judge", "api": "search", "score": {"inputs": [1]}}, "api: only a lease"),
        ({"service": "judge", "score": {"inputs": []}}, "score.inputs"),
    ],
)
def test_batch_items_name_what_is_wrong(item: dict[str, object], words: str) -> None:
    from tangram.api.wire import BatchItem

    with pytest.raises(ValidationError, match=words):
        BatchItem.model_validate(item)


def test_a_score_item_is_a_service_call() -> None:
    from tangram.api.wire import BatchItem

    item = BatchItem.model_validate({"service": "judge", "score": {"inputs": [[0.1]]}})
    assert item.score is not None and item.score.inputs == [[0.1]] and item.exec is None


def test_only_an_exec_item_names_a_trajectory() -> None:
    from tangram.api.wire import BatchItem

    with pytest.raises(ValidationError, match="only an exec item names a trajectory"):
        BatchItem.model_validate({"trajectory": "t", "service": "j", "score": {"inputs": [1]}})


def test_answers_from_a_later_scheduler_are_read_ignoring_fields_added_since() -> None:
    """A client of this release keeps working against a scheduler that adds a field to
    what it answers; what it sends is still refused with a misspelt field."""
    from tangram.api.wire import ActionResult, ExecRequest, StreamAnswer

    later = {"id": "a-1", "kind": "exec", "status": "ok", "started_at": 1.0,
             "allocation": {"cores": [0], "numa": 0}, "timings": {"exec_s": 1, "net_s": 0},
             "error": {"code": "x", "message": "y", "hint": "z"}}  # fmt: skip
    result = ActionResult.model_validate(later)
    assert result.allocation.cores == [0] and result.timings.exec_s == 1
    answer = StreamAnswer.model_validate_json(
        json.dumps({"id": 1, "status": 200, "result": later, "trace": "t"})
    )
    assert answer.result == result
    with pytest.raises(ValidationError, match="argvv"):
        ExecRequest.model_validate({"argv": ["true"], "argvv": ["x"]})
