"""What the scheduler decides, as plain records: a round's plan, the assignments it started,
how each key resource's candidates were arranged (for ``tangram explain``), the actions it
refused, and what a drained node took with it."""

from __future__ import annotations

from dataclasses import dataclass

from tangram.scheduler.core.elastic import EvictionStep
from tangram.scheduler.core.gpu_pool import Chunk
from tangram.scheduler.core.pricing import NodePrice
from tangram.scheduler.core.resource import Resource


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    action_id: str
    trajectory: str
    node: str | None
    cores: tuple[int, ...] = ()
    chunk: Chunk | None = None
    restore: bool = False  # the service instance must be restored into the chunk
    evicted: tuple[str, ...] = ()  # "service@node:start+size" instances evicted for it
    sharing: int = 0  # calls already running on the instance it joined (0: it has it alone)
    # The instance it landed on was still being restored ahead: it waits this long first.
    ready_in_s: float = 0.0
    quotas: tuple[tuple[str, int], ...] = ()
    units: int = 1  # units of the key resource (DoP)
    expected_s: float = 0.0
    started_at: float = 0.0
    queued_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupDecision:
    """How one key resource's candidates were arranged (for ``tangram explain``)."""

    resource: Resource
    candidates: tuple[str, ...]
    elastic: bool
    kept: int
    steps: tuple[EvictionStep, ...]
    # The node's core price this round and its terms (core.pricing), when it was used,
    # and each candidate it capped: (action id, largest size kept, largest size allowed).
    price: NodePrice | None = None
    capped: tuple[tuple[str, int, int], ...] = ()

    @property
    def core_price(self) -> float | None:
        return None if self.price is None else self.price.total


# Not frozen: a round makes one per action it starts, and a frozen dataclass takes several
# times as long to build (each field goes through object.__setattr__).
@dataclass(slots=True, kw_only=True)
class Start:
    """A queued action a round starts: on which resource and node, with how many units."""

    action_id: str
    resource: Resource  # its key resource
    node: str | None  # the node of its cores (exec actions)
    units: int  # of the key resource
    # Expected duration at ``units``, before any restore; a joiner's holds its slowdown
    # and its wait for the instance's restore.
    expected_s: float
    join: Chunk | None = None  # the chunk of the running instance a service call joins


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A round's decisions before any is applied (``Scheduler.plan``)."""

    placements: tuple[tuple[str, str], ...]  # (trajectory, node), in the order decided
    starts: tuple[Start, ...]  # in queue order
    groups: tuple[GroupDecision, ...]
    blocked: tuple[tuple[str, str], ...]  # (action id, resource it waits for)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ahead:
    """An instance a round restores ahead, into free GPU memory, for its service's next
    call (``Scheduler.ahead_done`` when the restore ended)."""

    service: str
    chunk: Chunk
    expected_s: float  # the restore, after those ahead of it on the same GPUs
    ready_at: float  # when it is expected to be in GPU memory


@dataclass(frozen=True, slots=True, kw_only=True)
class Invalid:
    """A queued action refused because it can never run where it must: its trajectory was
    placed on a node with fewer cores than its minimum. It left the queue; the caller
    fails it as it would have been refused at submit (``SchedulingError(field, message)``)."""

    action_id: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    """A committed round: the actions it started."""

    assignments: tuple[Assignment, ...]
    wake_at: float | None  # earliest time a rate window frees a blocked action
    groups: tuple[GroupDecision, ...] = ()
    blocked: tuple[tuple[str, str], ...] = ()  # (action id, resource it waits for)
    # It opened a service instance that queued calls could join: run another round now.
    again: bool = False
    ahead: tuple[Ahead, ...] = ()  # instances it started restoring ahead
    # Planned, but no free chunk could host its service when its turn came (the plan
    # counts free chunks; which service fits on which is the allocator's): still queued,
    # and in ``blocked`` with why.
    refused: tuple[str, ...] = ()
    # Taken out of the queue for good: they can never run (``Invalid``). Those refused by a
    # placement made outside a round (``place_trajectory``, ``adopt``) come with the next.
    invalid: tuple[Invalid, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained:
    """What a node took with it when it left (its agent stopped answering)."""

    # Actions that ran on its cores or GPUs: they end in error. Other runs of its
    # trajectories (a service call on another node's GPUs, an API call) go on.
    running: tuple[str, ...]
    trajectories: tuple[str, ...]  # trajectories placed there: their environments are lost
    dropped: tuple[str, ...]  # queued actions of those trajectories
