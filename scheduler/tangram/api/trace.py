"""The trace format (docs/architecture.md): JSON Lines, one trajectory a line, ``"version": 1``.

``think_s`` is the LLM generation time before the action is submitted; replay is
closed-loop, so a step starts when the previous action completes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tangram.api.action import MAX_T1_S, ActionSpec
from tangram.api.field_errors import described

# The latest time a trace may give (``arrival_s``) and the longest think time: t1_s's cap,
# ~4 months. A replay's clock is a float in seconds: up to this bound one ulp is ~2 ns, so
# a 1 ms action still takes 1 ms; past 2**53 s (~9e15) it would take 0 s, or several
# seconds, and ACTs read as zeros (an arrival of 1e20, Unix epoch times as arrivals).
MAX_TIME_S = MAX_T1_S


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    think_s: Annotated[float, Field(ge=0, le=MAX_TIME_S)] = 0.0
    action: ActionSpec


class TrajectoryTrace(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    version: Literal[1]
    id: Annotated[str, Field(min_length=1)]
    task: str = "coding"
    arrival_s: Annotated[float, Field(ge=0, le=MAX_TIME_S)] = 0.0
    memory_gb: Annotated[float, Field(ge=0)] = 0.0
    steps: list[Step] = Field(default_factory=list)


class TraceError(ValueError):
    """A trace line failed validation; ``line`` is 1-based."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


class JsonKeyError(ValueError):
    """A JSON text gives a key twice in one object, or a number JSON has not (NaN)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # JSON parsers let the last one win, unseen
            raise JsonKeyError(f"{key}: key given twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise JsonKeyError(f"{name} is not a JSON number")


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses a key given twice in an object (``JsonKeyError`` naming
    it) and ``NaN``/``Infinity`` (Python's extension, not JSON)."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def load_trace(lines: list[str]) -> list[TrajectoryTrace]:
    """Parse trace lines; the first bad line raises ``TraceError`` naming its field.

    Strict, as docs/simulator.md says: a value of the wrong JSON type (``"t1_s": "30"``,
    ``"cpu": true``) is refused, not coerced; an integer still takes a float field."""
    from pydantic import ValidationError

    out: list[TrajectoryTrace] = []
    seen: set[str] = set()
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            strict_json(raw)  # (pydantic's own parser lets a repeated key's last one win)
        except json.JSONDecodeError as e:
            raise TraceError(no, f"not valid JSON: {e.msg} (column {e.pos + 1})") from None
        except JsonKeyError as e:
            raise TraceError(no, str(e)) from None
        try:
            traj = TrajectoryTrace.model_validate_json(raw, strict=True)
        except ValidationError as e:
            raise TraceError(no, described(e, "(line)")) from None
        if traj.id in seen:
            raise TraceError(no, f"id: duplicate trajectory id {traj.id!r}")
        seen.add(traj.id)
        out.append(traj)
    return out
