"""A RewardService call's outputs must be plain JSON, exactly what the agent's reply can
carry: anything else fails the call with the type and where it is (no torch needed)."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from tangram.api.wire import AgentReply, ServiceOutcome, ServiceStats, json_bytes
from tangram.node_agent.gpu_service import json_size


class Level(enum.IntEnum):
    HIGH = 2


class Opaque:
    pass


def _reply(outputs: list[Any]) -> bytes:
    call = ServiceOutcome(
        outputs=outputs, stats=ServiceStats(service="s", resident=True), exec_s=0.0
    )
    return json_bytes(AgentReply(rid=1, ok=True, call=call))


@pytest.mark.parametrize(
    "outputs",
    [
        [],
        [0.5, -1, True, None, "fine"],
        [[0.1, 0.2], {"score": 1.0, "why": ["a", "b"]}],
        [(1, 2), Level.HIGH, 1e308, 2**70],
    ],
)
def test_plain_json_passes_and_is_measured_as_the_reply_encodes_it(outputs: list[Any]) -> None:
    size = json_size(outputs)
    reply = _reply(outputs)  # the reply carries them
    assert size == len(_reply_outputs(reply))


def _reply_outputs(reply: bytes) -> bytes:
    start = reply.index(b'"outputs":') + len(b'"outputs":')
    end = reply.index(b',"stats":', start)
    return reply[start:end]


def _cycle() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return [loop]


@pytest.mark.parametrize(
    ("outputs", "says"),
    [
        (
            [1.0, Opaque()],
            "a tests.unit.test_gpu_outputs.Opaque at outputs[1]: return plain numbers",
        ),
        ([{"a": [0, {1, 2}]}], "a set at outputs[0]['a'][1]"),
        ([b"raw"], "a bytes at outputs[0]"),
        ([float("nan")], "nan at outputs[0]: JSON has no NaN or Infinity"),
        ([[1.0, float("-inf")]], "-inf at outputs[0][1]"),
        ([{1: 0.5}], "a dict key 1 (int) at outputs[0]: JSON object keys are strings"),
        (_cycle(), "nested too deeply"),
        ({"not": "a list"}, "a dict, not a list with one output per input"),
    ],
)
def test_anything_else_is_named_with_where_it_is(outputs: Any, says: str) -> None:
    with pytest.raises(ValueError, match=r"^score returned ") as e:
        json_size(outputs)
    assert says in str(e.value)
