"""What a scheduler has learned from the actions it ran, as it outlives a restart.

The elastic policy sizes an action by its type's learned profile (seed 000 §4.1: t1 and
E(m), fitted online), the core price by the learned think time and mean exec action, and
the ``shortest-remaining`` ordering by the lengths of finished trajectories and the recent
queueing time. All of it is learned from completed runs; a scheduler that restarts with
nothing sizes every untrusted type at its minimum until it has seen enough runs again. The
scheduler saves this document now and then and reads it back when it starts
(docs/scheduler.md, "What a restart keeps"). With it go a few things that are not learned
but must outlive the scheduler too: environments still to close, API leases held, and the
starts the quotas' rate windows count (docs/service.md, "What a restart keeps").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from tangram.api.demand import MAX_UNITS

MAX_CLOSING = 65_536  # environments to close kept at most (a bound on the document)
MAX_LEASES = 4096  # API leases held kept at most: the newest
MAX_STARTS = 16_384  # starts in the quotas' rate windows kept at most: the newest
# Open trajectories whose progress is kept at most (those furthest along): about 130
# bytes each, so the document stays within a ConfigMap's 1 MiB with the rest; one left
# out starts from 0 after a restart and teaches no length.
MAX_PROGRESS = 1024
MAX_LENGTHS = 4096  # finished trajectory lengths kept: the most recent (the model's window)
# Action types kept: the most observed, with names of a sane length. A document stays well
# under a ConfigMap's 1 MiB however many types clients invent.
MAX_PROFILES = 1024
MAX_TYPE_CHARS = 256
# A kind of action whose recent work is kept ("exec", "service:NAME", "api:NAME"; a name of
# a Kubernetes object has at most 253 characters).
MAX_KIND_CHARS = 8 + 253

# What a real scheduler can have learned, so that what the core computes from it stays a
# finite float (a length of 10**400 steps validates as an int and breaks every estimate):
MAX_STEPS = 10**6  # steps of a finished trajectory (longer ones are counted as this many)
MAX_SECONDS = 1e9  # any duration or mean time learned (~32 years of a monotonic clock)
MAX_COUNT = 2**53  # runs or samples counted (exact as a float, which the core divides by)

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
# The running sums of a fit over n runs of x = 1/units in (0, 1] and a duration d in
# [0, MAX_SECONDS]: sums of x and x² are at most n, of d and x·d at most n·MAX_SECONDS,
# of d² at most n·MAX_SECONDS²; bounded here with n = MAX_COUNT.
SumX = Annotated[float, Field(ge=0, le=MAX_COUNT, allow_inf_nan=False)]
SumD = Annotated[float, Field(ge=0, le=MAX_COUNT * MAX_SECONDS, allow_inf_nan=False)]
SumDD = Annotated[float, Field(ge=0, le=MAX_COUNT * MAX_SECONDS**2, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LearnedFit(_Strict):
    """The running sums of one action type's least-squares fit of duration against 1/m
    (``core.profiles``), and how many of its submissions were counted for probing."""

    n: Count
    sx: SumX
    sy: SumD
    sxx: SumX
    sxy: SumD
    syy: SumDD
    counts: Annotated[
        list[Annotated[int, Field(ge=1, le=MAX_UNITS)]], Field(max_length=MAX_UNITS)
    ] = Field(description="unit counts it ran with")
    submitted: Count = 0


class LearnedMean(_Strict):
    """A running mean (``core.returns.RunningMean``): its value and how many samples. A
    value is seconds, or core-seconds of an action at up to ``MAX_UNITS`` cores."""

    mean: Annotated[float, Field(ge=0, le=MAX_UNITS * MAX_SECONDS)] = 0.0
    seen: Count = 0


class LearnedLease(_Strict):
    """An API lease that was held when the state was saved: its units stay held by the
    next scheduler until it is released (by its id) or its hold ends."""

    lease: Annotated[str, Field(min_length=1, max_length=64)]
    tenant: Annotated[str, Field(max_length=1024)]
    api: Annotated[str, Field(min_length=1, max_length=253)]
    units: Annotated[int, Field(ge=1, le=1024)]
    started_at: Annotated[float, Field(ge=0, description="granted at, in unix seconds")]
    hold_s: Annotated[float, Field(gt=0, le=3600, description="it ends at started_at + hold_s")]
    key: Annotated[
        str | None, Field(min_length=1, max_length=200, description="its idempotency key")
    ] = None
    digest: Annotated[
        str | None, Field(max_length=64, description="its request's, which a retry must match")
    ] = None
    quotas: Annotated[
        dict[
            Annotated[str, Field(min_length=1, max_length=253)],
            Annotated[int, Field(ge=1, le=1024)],
        ],
        Field(max_length=16, description="units of other quotas held with it"),
    ] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _quotas_when_held(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A scheduler of an earlier release refuses the field: left out when there are none.
        data: dict[str, Any] = dump(self)
        if not self.quotas:
            data.pop("quotas", None)
        return data


class LearnedProgress(_Strict):
    """What an open trajectory had done when the state was saved: a restarted scheduler
    that takes it back from its agent goes on counting from there, and learns its length
    whole when it ends (not the part after the restart)."""

    actions: Count = 0  # submitted
    steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0  # ended ok
    busy_s: Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)] = 0.0
    hint_steps: Annotated[int | None, Field(ge=0, le=MAX_STEPS)] = None  # its client's hint
    hint_at: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0  # steps when it was given


class LearnedState(_Strict):
    version: Literal[1] = 1
    profiles: Annotated[
        dict[Annotated[str, Field(max_length=MAX_TYPE_CHARS)], LearnedFit],
        Field(max_length=MAX_PROFILES, description="by action type"),
    ] = Field(default_factory=dict)
    lengths: Annotated[
        list[Annotated[int, Field(ge=0, le=MAX_STEPS)]], Field(max_length=MAX_LENGTHS)
    ] = Field(default_factory=list, description="steps of finished trajectories, sorted")
    recent_wait_s: LearnedMean = LearnedMean()
    think_s: LearnedMean = LearnedMean()
    exec_core_s: LearnedMean = LearnedMean()
    exec_run_s: LearnedMean = LearnedMean()
    recent_work: Annotated[
        dict[Annotated[str, Field(min_length=1, max_length=MAX_KIND_CHARS)], LearnedMean],
        Field(
            max_length=MAX_PROFILES,
            description="kind of action -> the mean work (units x seconds) of its recent "
            "runs: fair queuing's length of an action of a type not known yet",
        ),
    ] = Field(default_factory=dict)
    # Not learned, but kept with it, the one document a scheduler leaves its successor.
    closing: Annotated[
        dict[Annotated[str, Field(max_length=253)], list[Annotated[str, Field(max_length=256)]]],
        Field(
            description="node -> environments whose trajectory was closed while the node's "
            "agent was away: closed when it is back, though this scheduler has gone"
        ),
    ] = Field(default_factory=dict)

    leases: Annotated[list[LearnedLease], Field(max_length=MAX_LEASES)] = Field(
        default_factory=list,
        description="API leases held: still held after a restart, until released or ended",
    )
    windows: dict[
        Annotated[str, Field(max_length=253)],
        list[Annotated[float, Field(ge=0)]],
    ] = Field(
        default_factory=dict,
        description="API quota -> the starts its rate window counted, in unix seconds: a "
        "restart does not reopen the window",
    )

    progress: Annotated[
        dict[Annotated[str, Field(max_length=256)], LearnedProgress],
        Field(max_length=MAX_PROGRESS),
    ] = Field(
        default_factory=dict,
        description="open trajectory (its pool-wide key) -> what it had done: a restart "
        "goes on from there",
    )

    @model_validator(mode="after")
    def _bounded(self) -> Self:
        if sum(len(keys) for keys in self.closing.values()) > MAX_CLOSING:
            raise ValueError(f"closing: more than {MAX_CLOSING} environments")
        if sum(len(starts) for starts in self.windows.values()) > MAX_STARTS:
            raise ValueError(f"windows: more than {MAX_STARTS} starts")
        return self


__all__ = [
    "MAX_CLOSING",
    "MAX_COUNT",
    "MAX_KIND_CHARS",
    "MAX_LEASES",
    "MAX_LENGTHS",
    "MAX_PROFILES",
    "MAX_PROGRESS",
    "MAX_SECONDS",
    "MAX_STARTS",
    "MAX_STEPS",
    "MAX_TYPE_CHARS",
    "LearnedFit",
    "LearnedLease",
    "LearnedMean",
    "LearnedProgress",
    "LearnedState",
]
