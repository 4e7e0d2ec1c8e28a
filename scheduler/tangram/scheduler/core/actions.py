"""The scheduler's bookkeeping of trajectories and actions, queued and running, and what
each action competes on."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from tangram.api.action import ActionKind
from tangram.scheduler.core.decisions import Assignment
from tangram.scheduler.core.objective import Pending
from tangram.scheduler.core.profiles import Profile
from tangram.scheduler.core.resource import PLACE, Resource


@dataclass(slots=True, kw_only=True)
class Trajectory:
    id: str
    memory_gb: float
    hint_steps: int | None = None  # remaining steps the client announced ...
    hint_at: int = 0  # ... when it had taken this many
    steps_done: int = 0
    busy_s: float = 0.0
    # False for one taken back after a restart with its steps before it unknown: its
    # length, when it ends, is not learned (it would be counted short).
    length_known: bool = True
    queued_exec: int = 0  # queued exec actions (their key resource moves when it is placed)
    tenant: str = ""  # whose: queued fairly between tenants, and held to its share
    in_flight: int = 0  # its actions queued or running: none, and it is thinking
    idle_since: float | None = None  # when its last action ended (its think time starts)
    queued_work: float = 0.0  # core-seconds of its queued exec actions (their ``work``)
    # At least the largest minimum core count of its queued exec actions (not lowered as
    # they leave the queue, only once none is left): a placement on a smaller node looks
    # for the ones it must refuse only when this says there may be some.
    widest: int = 0


@dataclass(slots=True, kw_only=True)
class Action:
    id: str
    trajectory: str
    kind: ActionKind
    type: str
    seq: int
    submitted_at: float
    cpu: tuple[int, ...]
    gpu: tuple[int, ...]
    service: str | None
    quotas: tuple[tuple[str, int], ...]
    profile: Profile | None
    elastic_capable: bool
    probe: bool = False
    work: float = 0.0  # core-seconds at its smallest size, as expected when it was queued
    # Cache of Sizing.choices: (book version of the type, units, durations, pending view).
    cache: tuple[int, tuple[int, ...], dict[int, float], Pending] | None = None
    needs: tuple[Resource, ...] | None = None  # cached once the resources it needs are settled
    # What it needs wherever it runs: the GPUs, then its quotas (``needs`` puts its node's
    # cores first; a round counts these down).
    pool_wide: tuple[Resource, ...] = ()


@dataclass(slots=True)
class Running:
    assignment: Assignment
    action: Action
    expected_end: float
    resource: Resource  # its key resource


def needs(a: Action, node: str | None, placed: Container[str]) -> tuple[Resource, ...]:
    """Resources an action competes on; the first is its key resource.

    ``node``: its trajectory's node, placed or planned; ``placed``: the trajectories placed
    for good. An exec action's needs are cached only once its trajectory is placed: until
    then they change with placement.
    """
    if a.needs is not None:
        return a.needs
    if not a.cpu:
        a.needs = a.pool_wide
        return a.pool_wide
    result = (Resource.cpu(node) if node is not None else PLACE, *a.pool_wide)
    if a.trajectory in placed:
        a.needs = result
    return result
