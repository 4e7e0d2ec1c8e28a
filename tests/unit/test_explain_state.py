"""``tangram explain``: a state the scheduler could not be in is refused naming the field,
and the decision shown accounts for every queued action (docs/scheduler.md)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tangram.cli.explain import _merged
from tangram.cli.main import main
from tangram.scheduler.core.decisions import Ahead, Round
from tangram.scheduler.core.gpu_pool import Chunk

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "explain" / "waiting.json"


def _example() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return data


def _explain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], state: dict[str, Any] | str, *flags: str
) -> tuple[int, str, str]:
    path = tmp_path / "state.json"
    path.write_text(state if isinstance(state, str) else json.dumps(state))
    code = main(["explain", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def _edited(path: str, value: Any) -> dict[str, Any]:
    """The example with the field at dotted ``path`` set to ``value``."""
    state = _example()
    *parents, last = path.split(".")
    node: Any = state
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    node[int(last) if last.isdigit() else last] = value
    return state


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("now", "10", "now: Input should be a valid number"),
        ("now", -1e9, "now: Input should be greater than or equal to 0"),
        ("running.0.started_s", 500, "running.0.started_s: 500.0 is after now (10.0)"),
        ("queue.1.submitted_s", 11, "queue.1.submitted_s: 11.0 is after now (10.0)"),
        ("trajectories.0.hint_steps", -5, "trajectories.0.hint_steps: Input should be greater"),
        ("trajectories.0.hint_steps", 0, "trajectories.0.hint_steps: Input should be greater"),
        ("cluster.nodes.0.cpus", "8", "cluster.nodes.0.cpus: Input should be a valid integer"),
    ],
)
def test_a_state_the_scheduler_cannot_be_in_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any, words: str
) -> None:
    code, out, err = _explain(tmp_path, capsys, _edited(field, value))
    assert code == 2 and out == "" and words in err and "Traceback" not in err


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ['"now": 10.0', '"started_s": 9.0'])
def test_nan_and_infinity_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], token: str, field: str
) -> None:
    text = json.dumps(_example())
    assert field in text
    key = field.split(":", maxsplit=1)[0]
    code, _, err = _explain(tmp_path, capsys, text.replace(field, f"{key}: {token}"))
    assert code == 2 and f"{token} is not a JSON number" in err


def test_a_key_given_twice_and_a_top_level_array_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = json.dumps(_example()).replace('"now": 10.0', '"now": 10.0, "now": 1.0')
    code, _, err = _explain(tmp_path, capsys, text)
    assert code == 2 and "now: key given twice" in err
    code, _, err = _explain(tmp_path, capsys, "[1]")
    assert code == 2 and "state.json: (top level): Input should be" in err


def _accounted(decision: dict[str, Any]) -> list[str]:
    return [a["action"] for a in decision["assignments"]] + [
        w["action"] for w in decision["waiting"]
    ]


@pytest.mark.parametrize("config", [{"fixed_dop": 4}, {"max_candidates": 1}])
def test_every_queued_action_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any]
) -> None:
    state = _example()
    state["config"] = config
    code, out, _ = _explain(tmp_path, capsys, state, "--json")
    assert code == 0
    decision = json.loads(out)
    assert sorted(_accounted(decision)) == ["ls-t3", "reward-t2"]
    because = {w["action"]: w["because"] for w in decision["waiting"]}
    assert because["ls-t3"]  # a reason, in words
    if "fixed_dop" in config:
        assert "held for reward-t2" in because["ls-t3"]
        assert "not enough free cores on n0" in because["reward-t2"]
    else:
        assert "max_candidates (1)" in because["ls-t3"]
    code, out, _ = _explain(tmp_path, capsys, state)
    assert code == 0 and "ls-t3" in out


API_STATE: dict[str, Any] = {
    "cluster": {
        "nodes": [{"name": "n0", "cpus": 8, "memory_gb": 64, "gpus": 8}],
        "apis": [{"name": "search", "concurrency": 1}],
        "services": [{"name": "judge", "gpu_memory_gb": 20, "restore_s": 4, "dop_choices": [1, 2]}],
    },
    "now": 10,
    "trajectories": [{"id": "t1"}, {"id": "t2"}, {"id": "t3"}],
    "queue": [
        {
            "id": "e#0",
            "trajectory": "t1",
            "submitted_s": 9,
            "action": {"kind": "api", "api": "search", "t1_s": 1},
        },
        {
            "id": "f#0",
            "trajectory": "t2",
            "submitted_s": 9,
            "action": {"kind": "api", "api": "search", "t1_s": 1},
        },
        {
            "id": "g#0",
            "trajectory": "t3",
            "submitted_s": 9,
            "action": {"kind": "service", "service": "judge", "gpu": 1, "t1_s": 1},
        },
    ],
}


def test_api_calls_and_restores_ahead_are_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _explain(tmp_path, capsys, copy.deepcopy(API_STATE))
    assert code == 0 and "None" not in out
    assert "e#0: under quota search x1, expected 1.00 s" in out
    assert "f#0: api:search: quota search has no room now" in out
    assert "\nrestored ahead (for the next calls of their service)\n" in out  # (no tags)
    assert "judge: GPUs 2-3 of n0" in out
    code, out, _ = _explain(tmp_path, capsys, copy.deepcopy(API_STATE), "--json")
    decision = json.loads(out)
    assert decision["ahead"] == [
        {"service": "judge", "gpus": ["n0", 2, 2], "expected_s": 2.0, "ready_at": 12.0}
    ]


def test_a_second_round_at_once_keeps_the_firsts_waiting_and_ahead() -> None:
    chunk = Chunk("n0", 0, 2)
    first = Round(
        assignments=(),
        wake_at=None,
        blocked=(("a", "cpu:n0"), ("b", "gpu")),
        again=True,
        ahead=(Ahead(service="s", chunk=chunk, expected_s=1.0, ready_at=2.0),),
    )
    more = Round(assignments=(), wake_at=None, blocked=(("b", "gpu (held for an earlier call)"),))
    merged = _merged(first, more)
    assert merged.blocked == (("a", "cpu:n0"), ("b", "gpu (held for an earlier call)"))
    assert merged.ahead == first.ahead and not merged.again
