"""The trace format (docs/architecture.md): JSON Lines, one trajectory a line, ``"version": 1``.

``think_s`` is the LLM generation time before the action is submitted; replay is
closed-loop, so a step starts when the previous action completes.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tangram.api.action import ActionSpec
from tangram.api.field_errors import described


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    think_s: Annotated[float, Field(ge=0)] = 0.0
    action: ActionSpec


class TrajectoryTrace(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    version: Literal[1]
    id: Annotated[str, Field(min_length=1)]
    task: str = "coding"
    arrival_s: Annotated[float, Field(ge=0)] = 0.0
    memory_gb: Annotated[float, Field(ge=0)] = 0.0
    steps: list[Step] = Field(default_factory=list)


class TraceError(ValueError):
    """A trace line failed validation; ``line`` is 1-based."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


def load_trace(lines: list[str]) -> list[TrajectoryTrace]:
    """Parse trace lines; the first bad line raises ``TraceError`` naming its field."""
    from pydantic import ValidationError

    out: list[TrajectoryTrace] = []
    seen: set[str] = set()
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            traj = TrajectoryTrace.model_validate_json(raw)
        except ValidationError as e:
            raise TraceError(no, described(e, "(line)")) from None
        if traj.id in seen:
            raise TraceError(no, f"id: duplicate trajectory id {traj.id!r}")
        seen.add(traj.id)
        out.append(traj)
    return out
