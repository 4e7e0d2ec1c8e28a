"""The ``status`` of the custom resources: typed, written only by the operator.

The CRDs' status schemas are generated from these models (:mod:`tangram.api.crd`), so the
API server prunes anything else: kopf keeps its own bookkeeping in annotations instead.
Conditions follow the Kubernetes convention (``metav1.Condition``): one ``Ready`` condition
whose ``reason`` says in one CamelCase word why, and whose ``lastTransitionTime`` moves only
when ``status`` changes.

Pure: the clock is passed in as an RFC 3339 string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

READY = "Ready"
ConditionStatus = Literal["True", "False", "Unknown"]

_CONFIG = ConfigDict(
    alias_generator=to_camel, validate_by_name=True, validate_by_alias=True, frozen=True
)


class Condition(BaseModel):
    """One aspect of the object's state (``metav1.Condition``)."""

    model_config = _CONFIG

    type: Annotated[str, Field(min_length=1, max_length=316, description="e.g. Ready")]
    status: Annotated[ConditionStatus, Field(description="True, False or Unknown")]
    reason: Annotated[
        str,
        Field(
            min_length=1,
            max_length=1024,
            pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
            description="why, in one CamelCase word",
        ),
    ]
    message: Annotated[str, Field(max_length=32768, description="why, for people")] = ""
    last_transition_time: Annotated[
        str,
        Field(
            description="when status last changed (RFC 3339)",
            json_schema_extra={"format": "date-time"},
        ),
    ]
    observed_generation: Annotated[
        int, Field(ge=0, description="metadata.generation this condition was computed from")
    ] = 0


_Conditions = Annotated[
    list[Condition], Field(description="Ready (and reasons) as metav1.Condition entries")
]
_Generation = Annotated[
    int, Field(ge=0, description="the metadata.generation the operator last acted on")
]


class PoolStatus(BaseModel):
    """What the operator observed of an ActionPool and its scheduler."""

    model_config = _CONFIG

    observed_generation: _Generation = 0
    conditions: _Conditions = []
    endpoint: Annotated[
        str, Field(description="the action API inside the cluster (http://service.ns.svc:port)")
    ] = ""
    nodes: Annotated[int, Field(ge=0, description="node agents connected to the scheduler")] = 0
    cores: Annotated[int, Field(ge=0, description="CPU cores the pool hands to actions")] = 0
    cores_in_use: Annotated[int, Field(ge=0, description="cores held by running actions")] = 0
    gpus: Annotated[int, Field(ge=0, description="GPUs the pool hands to services")] = 0
    gpus_in_use: Annotated[int, Field(ge=0, description="GPUs held by running actions")] = 0
    queue_depth: Annotated[int, Field(ge=0, description="actions waiting for resources")] = 0
    running: Annotated[int, Field(ge=0, description="actions running")] = 0
    trajectories: Annotated[int, Field(ge=0, description="open trajectories")] = 0
    apis: Annotated[dict[str, int], Field(description="API quota name -> calls in flight")] = {}
    environments: Annotated[
        int, Field(ge=0, description="TrajectoryEnvs and RewardServices the scheduler serves")
    ] = 0


class MemberStatus(BaseModel):
    """What the operator observed of a TrajectoryEnv or RewardService."""

    model_config = _CONFIG

    observed_generation: _Generation = 0
    conditions: _Conditions = []
    pool: Annotated[str, Field(description="the ActionPool it resolved to, as namespace/name")] = ""


def condition(
    previous: Sequence[Condition],
    *,
    type: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> list[Condition]:
    """``previous`` with the condition ``type`` set, in its place (a new one last: an order
    that moved would make the status differ, and be patched, on every pass); its
    transition time moves only when its status changes (so watchers see when it became
    Ready, not when it was last checked)."""
    old = next((c for c in previous if c.type == type), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(
        type=type,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    if old is None:
        return [*previous, new]
    return [new if c.type == type else c for c in previous]


def ready(conditions: Sequence[Condition]) -> Condition | None:
    return next((c for c in conditions if c.type == READY), None)


def parse_conditions(raw: object) -> list[Condition]:
    """Conditions from a live object's status; entries that do not parse are dropped (the
    operator rewrites them)."""
    out: list[Condition] = []
    if isinstance(raw, list):
        for item in raw:
            try:
                out.append(Condition.model_validate(item))
            except ValueError:
                continue
    return out


STATUS_MODELS: dict[str, type[PoolStatus] | type[MemberStatus]] = {
    "ActionPool": PoolStatus,
    "TrajectoryEnv": MemberStatus,
    "RewardService": MemberStatus,
}

__all__ = [
    "READY",
    "STATUS_MODELS",
    "Condition",
    "MemberStatus",
    "PoolStatus",
    "condition",
    "parse_conditions",
    "ready",
]
