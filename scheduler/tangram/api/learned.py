"""What a scheduler has learned from the actions it ran, as it outlives a restart.

The elastic policy sizes an action by its type's learned profile (seed 000 §4.1: t1 and
E(m), fitted online), the core price by the learned think time and mean exec action, and
the ``shortest-remaining`` ordering by the lengths of finished trajectories and the recent
queueing time. All of it is learned from completed runs; a scheduler that restarts with
nothing sizes every untrusted type at its minimum until it has seen enough runs again. The
scheduler saves this document now and then and reads it back when it starts
(docs/scheduler.md, "What a restart keeps").
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CLOSING = 65_536  # environments to close kept at most (a bound on the document)
MAX_LENGTHS = 4096  # finished trajectory lengths kept: the most recent (the model's window)
# Action types kept: the most observed, with names of a sane length. A document stays well
# under a ConfigMap's 1 MiB however many types clients invent.
MAX_PROFILES = 1024
MAX_TYPE_CHARS = 256

Sum = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LearnedFit(_Strict):
    """The running sums of one action type's least-squares fit of duration against 1/m
    (``core.profiles``), and how many of its submissions were counted for probing."""

    n: Count
    sx: Sum
    sy: Sum
    sxx: Sum
    sxy: Sum
    syy: Sum
    counts: list[Annotated[int, Field(ge=1)]] = Field(description="unit counts it ran with")
    submitted: Count = 0


class LearnedMean(_Strict):
    """A running mean (``core.returns.RunningMean``): its value and how many samples."""

    mean: Annotated[float, Field(ge=0)] = 0.0
    seen: Count = 0


class LearnedState(_Strict):
    version: Literal[1] = 1
    profiles: Annotated[
        dict[Annotated[str, Field(max_length=MAX_TYPE_CHARS)], LearnedFit],
        Field(max_length=MAX_PROFILES, description="by action type"),
    ] = Field(default_factory=dict)
    lengths: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_LENGTHS)] = Field(
        default_factory=list, description="steps of finished trajectories, sorted"
    )
    recent_wait_s: LearnedMean = LearnedMean()
    think_s: LearnedMean = LearnedMean()
    exec_core_s: LearnedMean = LearnedMean()
    exec_run_s: LearnedMean = LearnedMean()
    # Not learned, but kept with it, the one document a scheduler leaves its successor.
    closing: Annotated[
        dict[Annotated[str, Field(max_length=253)], list[Annotated[str, Field(max_length=256)]]],
        Field(
            description="node -> environments whose trajectory was closed while the node's "
            "agent was away: closed when it is back, though this scheduler has gone"
        ),
    ] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounded(self) -> Self:
        if sum(len(keys) for keys in self.closing.values()) > MAX_CLOSING:
            raise ValueError(f"closing: more than {MAX_CLOSING} environments")
        return self


__all__ = [
    "MAX_CLOSING",
    "MAX_LENGTHS",
    "MAX_PROFILES",
    "MAX_TYPE_CHARS",
    "LearnedFit",
    "LearnedMean",
    "LearnedState",
]
