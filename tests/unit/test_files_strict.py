"""Trace and cluster files are read strictly (docs/simulator.md, "Trace and cluster files"):
no value of the wrong JSON type is coerced, no key counts twice, no time is too large to
replay exactly, and a trace with nothing to replay is refused, each naming the file and
the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tangram.cli.files import InputError, load_cluster, load_trace_file, read_json

EXEC: dict[str, Any] = {"kind": "exec", "t1_s": 2.0}


def _line(**fields: Any) -> dict[str, Any]:
    return {"version": 1, "id": "a", "steps": [{"think_s": 1.0, "action": EXEC}], **fields}


def _trace(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(InputError) as e:
        load_trace_file(path) if path.suffix == ".jsonl" else load_cluster(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ") and all(w in text for w in words), text
    return text


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (_line(arrival_s="5"), "arrival_s"),
        (_line(memory_gb="4"), "memory_gb"),
        (_line(steps=[{"think_s": "1", "action": EXEC}]), "steps.0.think_s"),
        (_line(steps=[{"action": {**EXEC, "t1_s": "30"}}]), "steps.0.action.t1_s"),
        (_line(steps=[{"action": {**EXEC, "t1_s": True}}]), "steps.0.action.t1_s"),
        (_line(steps=[{"action": {**EXEC, "cpu": "4"}}]), "steps.0.action.cpu"),
        (
            _line(steps=[{"action": {"kind": "api", "api": "s", "quotas": {"pdf_parse": "1"}}}]),
            "steps.0.action.quotas.pdf_parse",
        ),
    ],
)
def test_a_trace_value_of_the_wrong_json_type_is_refused(
    tmp_path: Path, line: dict[str, Any], field: str
) -> None:
    _refused(_trace(tmp_path, json.dumps(line)), "line 1", f"{field}:")


def test_an_integer_still_takes_a_float_field(tmp_path: Path) -> None:
    line = _line(arrival_s=5, memory_gb=4, steps=[{"think_s": 1, "action": {**EXEC, "t1_s": 3}}])
    (traj,) = load_trace_file(_trace(tmp_path, json.dumps(line)))
    assert traj.arrival_s == 5.0 and traj.steps[0].action.t1_s == 3.0


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (_line(arrival_s=1e20), "arrival_s"),
        (_line(arrival_s=1.7e9), "arrival_s"),  # a Unix time, not one from the replay's start
        (_line(steps=[{"think_s": 1e300, "action": EXEC}]), "steps.0.think_s"),
    ],
)
def test_a_time_too_large_to_replay_exactly_is_refused(
    tmp_path: Path, line: dict[str, Any], field: str
) -> None:
    _refused(_trace(tmp_path, json.dumps(line)), f"{field}:", "less than or equal to 10000000")


def test_a_key_given_twice_in_a_trace_line_is_refused(tmp_path: Path) -> None:
    line = (
        '{"version": 1, "id": "a", "steps": [{"action": {"kind": "exec", "t1_s": 1, "t1_s": 500}}]}'
    )
    _refused(_trace(tmp_path, line), "line 1", "t1_s", "twice")


def test_nan_and_bad_json_in_a_trace_line_are_named(tmp_path: Path) -> None:
    nan = '{"version": 1, "id": "a", "steps": [{"action": {"kind": "exec", "t1_s": NaN}}]}'
    _refused(_trace(tmp_path, nan), "line 1", "NaN")
    text = _refused(_trace(tmp_path, '{"version": 1,'), "line 1: not valid JSON")
    assert "(line)" not in text


@pytest.mark.parametrize(
    "lines",
    [
        ['{"version": 1, "id": "a"}'],
        ['{"version": 1, "id": "a", "steps": []}', '{"version": 1, "id": "b"}'],
    ],
)
def test_a_trace_without_any_action_is_refused(tmp_path: Path, lines: list[str]) -> None:
    _refused(_trace(tmp_path, *lines), "no actions")


def test_a_trajectory_without_steps_among_others_is_kept(tmp_path: Path) -> None:
    trace = load_trace_file(_trace(tmp_path, json.dumps(_line()), '{"version": 1, "id": "b"}'))
    assert [len(t.steps) for t in trace] == [1, 0]


def test_a_byte_order_mark_is_named(tmp_path: Path) -> None:
    path = _trace(tmp_path, json.dumps(_line()))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    _refused(path, "byte-order mark")
    state = tmp_path / "s.json"
    state.write_bytes(b"\xef\xbb\xbf{}")
    with pytest.raises(InputError, match="byte-order mark"):
        read_json(state)


def _cluster(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('nodes: [{name: a, cpus: "8"}]', "nodes.0.cpus"),
        ("nodes: [{name: a, cpus: true}]", "nodes.0.cpus"),
        ('nodes: [{name: a, cpus: 8, memory_gb: "4"}]', "nodes.0.memory_gb"),
        ('nodes: [{name: a}]\napis: [{name: s, concurrency: "2"}]', "apis.0.concurrency"),
    ],
)
def test_a_cluster_value_of_the_wrong_type_is_refused(
    tmp_path: Path, text: str, field: str
) -> None:
    _refused(_cluster(tmp_path, text), f"{field}:")


def test_cluster_numbers_as_written_still_load(tmp_path: Path) -> None:
    # An integer for a float field, and a whole float for an integer one (as kubectl and
    # the custom-resource reader take it).
    cluster = load_cluster(_cluster(tmp_path, "nodes: [{name: a, cpus: 8.0, memory_gb: 64}]"))
    assert cluster.nodes[0].cpus == 8 and cluster.nodes[0].memory_gb == 64.0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("nodes:\n  - name: a\n    cpus: 8\n    cpus: 4\n", "'cpus'"),
        ("nodes: [{name: a, cpus: 8}]\nnodes: [{name: b, cpus: 8}]\n", "'nodes'"),
    ],
)
def test_a_cluster_key_given_twice_is_refused(tmp_path: Path, text: str, key: str) -> None:
    _refused(_cluster(tmp_path, text), f"found key {key} twice")
