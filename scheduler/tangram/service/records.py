"""What the engine keeps of each trajectory and action, and how it says no.

Errors carry the field they are about (``EngineError.field``) and an HTTP-ish kind, so
the handlers only translate.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tangram.api.wire import (
    AGENT_BACKOFF_MAX_S,
    ActionResult,
    ActionStatus,
    AgentReply,
    ApiCallRequest,
    ApiLeaseRequest,
    ErrorInfo,
    ExecRequest,
    ServiceCallRequest,
    TrajectoryInfo,
    TrajectoryMeta,
    TrajectoryState,
)
from tangram.scheduler.core.scheduler import Assignment
from tangram.service.config import EnvConfig

if TYPE_CHECKING:  # (live.py raises this module's errors)
    from tangram.service.live import LiveExec

KEY_SEP = "\x1f"  # joins tenant and idempotency key into the agent's key
# After a (re)start, the trajectories live in the agents, which reconnect within their
# backoff cap: until they are back, an unknown trajectory may be one of theirs.
RECONNECT_WINDOW_S = 3 * AGENT_BACKOFF_MAX_S

# "failed": the work was tried and cannot succeed as configured (a sandbox whose image is
# not on the node); retrying the same request will not help.
ErrorKind = Literal[
    "invalid", "not_found", "conflict", "overloaded", "unavailable", "failed", "forbidden",
    "too_large",
]  # fmt: skip
ActionKind = Literal["exec", "service", "api"]
Request = ExecRequest | ApiLeaseRequest | ApiCallRequest | ServiceCallRequest


class EngineError(Exception):
    def __init__(self, kind: ErrorKind, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.kind = kind
        self.field = field
        self.message = message


class NoAgentError(EngineError):
    """A node with no agent connected, or whose link is ending: nothing was sent to it."""

    def __init__(self, node: str | None, why: str | None = None) -> None:
        super().__init__("unavailable", "node", why or f"node {node} has no agent connected")


class NotTakenError(NoAgentError):
    """A request its node's agent did not take, its stop begun (``why`` names the node):
    nothing of it ran there, as for a node with no agent."""


@dataclass(slots=True)
class TrajectoryRecord:
    id: str  # the tenant's name for it: ids are per tenant
    tenant: str
    env: str
    node: str | None
    labels: dict[str, str]
    opened_at: float  # unix seconds
    env_config: EnvConfig
    state: TrajectoryState = TrajectoryState.OPEN
    actions: int = 0
    open_s: float | None = None
    warm: bool | None = None
    running: set[str] = field(default_factory=set)
    ended: str = ""  # why it is lost
    away_since: float = 0.0  # engine clock when its agent last left (AWAY)
    # Engine clock when it was last in use: opened or taken back, an action or a files
    # request asked, an action ended (its env's idle timeout counts from there).
    active_at: float = 0.0
    # It ends at a timeout of its own (an E2B sandbox's, which its client sets and
    # extends), not at its env's idle timeout.
    timed: bool = False
    transfers: int = 0  # files requests under way (it is not idle meanwhile)
    # What the core and the agent know it by, unique in the pool: its id, unless another
    # tenant held that id when it opened.
    key: str = ""
    # While its agent makes its environment: done with whether it did. A close that comes
    # meanwhile waits for it, so that what the agent makes is closed too.
    opening: asyncio.Future[bool] | None = None
    # While it closes: done once it is closed. Another close meanwhile (embedded mode's
    # at its stop, behind an idle timeout's) waits for it rather than answer at once.
    closing: asyncio.Future[None] | None = None
    # The open's idempotency key and its request's digest (OpenTrajectory.digest), kept by
    # the agent too: a restarted scheduler answers the open's retry with this record.
    open_key: tuple[str, str] | None = None
    env_vars: dict[str, str] = field(default_factory=dict)  # OpenTrajectory.env_vars
    # The idempotency keys of its actions: forgotten when it ends, as its agent forgets
    # them, since a trajectory opened again under its id is another environment.
    action_keys: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.key = self.key or self.id

    def info(self) -> TrajectoryInfo:
        return TrajectoryInfo.model_validate(self, from_attributes=True)

    def meta(self, open_key: bool = False) -> TrajectoryMeta:
        """What its agent keeps of it: the key it is known by, the tenant's id when that
        differs, and with ``open_key`` (an agent that keeps it) the open's key."""
        key, digest = self.open_key if open_key and self.open_key else (None, None)
        return TrajectoryMeta(
            id=self.key, name=self.id if self.id != self.key else None, tenant=self.tenant,
            env=self.env, labels=dict(self.labels), opened_at=self.opened_at,
            open_key=key, open_digest=digest, env_vars=dict(self.env_vars),
        )  # fmt: skip


@dataclass(slots=True)
class ActionRecord:
    id: str
    tenant: str
    trajectory: str | None  # its trajectory's key (TrajectoryRecord.key)
    kind: ActionKind
    # None only on the stand-in answering a retry of a key whose action already ended
    request: Request | None
    argv: list[str] | None
    target: str  # what its idempotency key is for: "exec on t-1", "lease of search"
    submitted: float  # engine clock
    done: asyncio.Future[ActionResult]
    started: float | None = None
    assignment: Assignment | None = None
    task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None  # queue timeout, or a lease's hold limit
    cancelled: bool = False
    lease: str | None = None  # an API lease's id while held
    answer: bytes | None = None  # ``done``'s result as JSON, once kept for its key's retries
    trajectory_id: str | None = None  # the tenant's id of its trajectory
    live: LiveExec | None = None  # a streamed exec: its output out, its input in, as it runs
    # A keyed request's digest (keys.request_digest), which a retry must match; an adopted
    # run's is its agent's copy. None for the stand-ins of runs answered while nobody asked
    # or adopted from an agent that kept none (their request unknown)
    digest: str | None = None
    # An exec's time limit: its request's, else its profile's, else its environment's
    # maxCommandSeconds, taken when it was admitted with the profile's command (a reload
    # may change or drop the profile meanwhile); and whose limit it is, which a timeout says
    timeout_s: float | None = None
    timeout_from: str = ""
    # Its request went to its node's agent (an exec, a service call; an adopted run): from
    # then on it may have run, whatever becomes of the link. A node lost before is safe to
    # retry; after, its outcome is the agent's to tell (``outcomes.lost_error``).
    sent: bool = False

    @property
    def shown_trajectory(self) -> str | None:
        """Its trajectory as its tenant names it."""
        return self.trajectory_id or self.trajectory

    @property
    def key(self) -> str | None:
        """The idempotency key it was submitted with."""
        return self.request.idempotency_key if self.request is not None else None

    @property
    def agent_key(self) -> str | None:
        """The key its agent runs it under: its key, scoped by its tenant."""
        key = self.key
        return None if key is None else f"{self.tenant}{KEY_SEP}{key}"


def ran_status(reply: AgentReply) -> ActionStatus | None:
    """How an exec that ran ended, by its agent's reply: killed by a cancel that kept its
    output, killed at its time limit, or run to its end; None when it did not run."""
    if not reply.ok or reply.result is None:
        return None
    if reply.cancelled:
        return ActionStatus.CANCELLED
    return ActionStatus.TIMEOUT if reply.result.timed_out else ActionStatus.OK


def err(code: str, message: str, retryable: bool = False) -> ErrorInfo:
    return ErrorInfo(code=code, message=message, retryable=retryable)
