"""The status the operator writes: pure functions from observations to status objects.

The handlers gather what they saw (the scheduler's figures, its Deployment, the pool's
members) and hand it here; what comes back is patched onto the object as is. The clock is
an argument, so the same observations always give the same status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tangram.api.reasons import Reason
from tangram.api.resources import ActionPool, RewardService, TrajectoryEnv, reference_problem
from tangram.api.status import (
    READY,
    Condition,
    ConditionStatus,
    MemberStatus,
    PoolStatus,
    condition,
)
from tangram.api.wire import PoolFigures, ProblemFigure
from tangram.operator.builders import child_name


@dataclass(frozen=True)
class PoolObservation:
    """What the operator saw of one pool in one pass."""

    generation: int
    previous: Sequence[Condition]
    endpoint: str
    invalid: str | None = None  # the spec does not validate (what is wrong)
    scheduler_available: bool = False  # the Deployment has an available replica
    figures: PoolFigures | None = None  # the scheduler's own, None when unreachable
    unreachable: str | None = None  # why the figures are missing
    refused: str | None = None  # why the scheduler refused the spec pushed to it
    push_failed: str | None = None  # why the push failed otherwise (413, 5xx, no answer)
    denied: str | None = None  # the API server denied a child of this generation's spec
    apply_failed: str | None = None  # the API server failed to take a child (5xx, ...)
    # The generation whose spec the children and the scheduler run (status
    # ``observedGeneration``) when it is not ``generation``: a denied or failed apply.
    applied_generation: int | None = None
    # role ("cpu", "gpu") -> its agent DaemonSet's status, read when agents are missing
    # (None: no such DaemonSet); roles not in it were not read.
    agents: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    deleting: bool = False
    drain_left_s: float = 0.0
    # The figures the status last showed (``last_figures``): they stand while the scheduler
    # does not answer (a drain waits on the trajectories they count; zeros would end it).
    last: Mapping[str, Any] = field(default_factory=dict)


SANDBOXES_HEALTHY = "SandboxesHealthy"
SHOWN_PROBLEMS = 3  # causes a condition's message names

# The scheduler's figures (PoolFigures) that a pool's status shows under the same names.
LIVE_FIGURES = frozenset(PoolFigures.model_fields) & frozenset(PoolStatus.model_fields)


def pool_status(pool: ActionPool | None, seen: PoolObservation, now: str) -> PoolStatus:
    """``pool`` is None when its spec did not validate (``seen.invalid`` says why)."""
    status, reason, message = _pool_ready(pool, seen)
    conditions = condition(
        seen.previous,
        type=READY,
        status=status,
        reason=reason,
        message=message,
        generation=seen.generation,
        now=now,
    )
    if seen.figures is not None:  # unknown without them: the previous one stands
        healthy, cause, why = _sandboxes_healthy(seen.figures.problems)
        conditions = condition(conditions, type=SANDBOXES_HEALTHY, status=healthy, reason=cause,
                               message=why, generation=seen.generation, now=now)  # fmt: skip
    live = (
        seen.figures.model_dump(include=set(LIVE_FIGURES))
        if seen.figures is not None
        else seen.last
    )
    return PoolStatus(
        observed_generation=(
            seen.generation if seen.applied_generation is None else seen.applied_generation
        ),
        conditions=conditions,
        endpoint=seen.endpoint,
        **live,
    )


def last_figures(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The scheduler's figures a pool's status (as stored) shows; none if it cannot be
    read."""
    try:
        shown = PoolStatus.model_validate(status or {})
    except ValueError:
        return {}
    return shown.model_dump(include=set(LIVE_FIGURES))


def _sandboxes_healthy(
    problems: Sequence[ProblemFigure], quiet: str = "no sandbox or node failed recently"
) -> tuple[ConditionStatus, str, str]:
    """False while sandboxes or nodes failed within the scheduler's window, with the
    latest cause as the reason and the latest few as the message."""
    if not problems:
        return "True", Reason.NO_RECENT_FAILURES, quiet
    shown = "; ".join(
        f"{p.reason} ({p.subject}, {p.count}×): {p.message}" for p in problems[:SHOWN_PROBLEMS]
    )
    more = len(problems) - SHOWN_PROBLEMS
    return "False", problems[0].reason, shown + (f"; and {more} more" if more > 0 else "")


def _pool_ready(
    pool: ActionPool | None, seen: PoolObservation
) -> tuple[ConditionStatus, Reason, str]:
    if pool is None or seen.invalid is not None:
        return "False", Reason.INVALID_SPEC, seen.invalid or "the spec does not validate"
    f = seen.figures
    silent = seen.unreachable or f"{seen.endpoint} not answering"  # when f is None
    if seen.deleting:
        left = f"removed in at most {max(0, round(seen.drain_left_s))} s"
        if f is None:  # restarting, say: it comes back with what its agents hold
            return (
                "False",
                Reason.DRAINING,
                f"being deleted: waiting for its scheduler ({silent}); {left}",
            )
        return (
            "False",
            Reason.DRAINING,
            f"being deleted: {f.trajectories} trajectories still open, {left}",
        )
    if seen.denied is not None:
        return (
            "False",
            Reason.CHILD_DENIED,
            f"the API server denied the spec's {seen.denied}; what the spec before made "
            "runs on (tried again on each edit of the spec and every 5 minutes)",
        )
    if seen.apply_failed is not None:
        return (
            "False",
            Reason.APPLY_FAILED,
            f"applying the spec failed: {seen.apply_failed}; what the spec before made "
            "runs on (retried every few seconds)",
        )
    if f is None:
        if not seen.scheduler_available:
            why = f"Deployment {child_name(pool, 'scheduler')} has no available pod"
            return "False", Reason.SCHEDULER_UNAVAILABLE, why
        return "False", Reason.SCHEDULER_UNREACHABLE, silent
    # The scheduler answered, so it runs, whatever its Deployment says: its pod is not
    # ready (not available) exactly while it serves environments and no agent is connected,
    # which is the case NoNodes names with its hint, or every agent connected is stopping
    # (an agent roll on a one-node pool: for the agent's grace, until its next agent
    # joins), AgentsStopping's.
    if seen.refused is not None:
        return (
            "False",
            Reason.CONFIG_REFUSED,
            "the scheduler refused the current definitions (the pool's or a member's) and "
            f"runs the ones before: {seen.refused}",
        )
    if seen.push_failed is not None:
        return (
            "False",
            Reason.CONFIG_PUSH_FAILED,
            "pushing the current definitions to the scheduler failed, so it may run the "
            f"ones before (pushed again every 10 s): {seen.push_failed}",
        )
    sections = [r for r, s in (("cpu", pool.spec.cpu), ("gpu", pool.spec.gpu)) if s is not None]
    if sections and f.nodes == 0:
        hints = "; ".join(_agents_hint(pool, r, seen.agents) for r in sections)
        return "False", Reason.NO_NODES, f"no node agent connected ({hints})"
    if sections and f.stopping >= f.nodes:  # (a scheduler before the field says 0)
        return (
            "False",
            Reason.AGENTS_STOPPING,
            f"every node agent connected ({f.nodes}) is stopping, so no new work is placed "
            "until another joins (an agent roll: the DaemonSet's next pod on the node); "
            "what runs finishes within the agents' grace",
        )
    if pool.spec.gpu is not None and f.gpus == 0:
        hint = _agents_hint(pool, "gpu", seen.agents, gpus=True)
        return "False", Reason.NO_GPUS, f"spec.gpu is set but the scheduler has no GPU ({hint})"
    return (
        "True",
        Reason.READY,
        f"{f.nodes} nodes, {f.cores} cores, {f.gpus} GPUs, {len(f.apis)} API quotas",
    )


def _agents_hint(
    pool: ActionPool,
    role: str,
    agents: Mapping[str, Mapping[str, Any] | None],
    *,
    gpus: bool = False,
) -> str:
    """What the agent DaemonSet of ``role`` says of why its agents are missing."""
    name = f"DaemonSet {child_name(pool, f'{role}-agent')}"
    selector = f"spec.{role}.nodeSelector"
    if role not in agents:  # not read: both usual causes
        return (f"{name}: check {selector}, and its events for agent pods that could not "
                "be created (Pod Security admission, a ResourceQuota)")  # fmt: skip
    status = agents[role]
    if status is None:
        return f"{name} does not exist"
    desired = int(status.get("desiredNumberScheduled") or 0)
    created = int(status.get("currentNumberScheduled") or 0)
    ready_ = int(status.get("numberReady") or 0)
    if desired == 0:
        return f"{name}: no node matches {selector} (or tolerates its taints)"
    if created < desired:
        return (f"{name}: agent pods created on {created} of {desired} nodes; "
                f"`kubectl describe daemonset` shows why (Pod Security admission, a "
                "ResourceQuota)")  # fmt: skip
    if ready_ < desired:
        return (f"{name}: {ready_} of {desired} agent pods ready; `kubectl describe pod` of "
                "the others says why (Pending: no node has the CPU or memory they request; "
                "else their logs)")  # fmt: skip
    if gpus:
        return f"{name}: {desired} agent pods run but found no GPU devices (drivers, runtime)"
    return f"{name}: {desired} agent pods ready but not connected to the scheduler"


def member_status(
    member: TrajectoryEnv | RewardService,
    pool: ActionPool | None,
    previous: Sequence[Condition],
    now: str,
    pool_invalid: str | None = None,
    *,
    not_served: tuple[str, str] | None = None,
    problems: Sequence[ProblemFigure] | None = None,
) -> MemberStatus:
    """Accepted when the pool it names exists, can serve it and its scheduler has taken
    the definitions that include it. ``pool_invalid``: why the pool's spec does not
    validate (``pool`` is then None); ``not_served``: (reason, why) its scheduler was not
    given it yet; ``problems``: the scheduler's recent failures (None: not read, the
    TrajectoryEnv's SandboxesHealthy stands as it was)."""
    generation = member.metadata.generation or 0
    ns, name = member.pool_key()
    problem: tuple[str, str] | None = reference_problem(member, pool)
    if pool is None and pool_invalid is not None:
        problem = Reason.POOL_INVALID, f"ActionPool {ns}/{name} is invalid: {pool_invalid}"
    if problem is None and not_served is not None:
        problem = not_served
    ready_as: tuple[ConditionStatus, str, str] = (
        ("True", Reason.ACCEPTED, f"served by ActionPool {ns}/{name}")
        if problem is None
        else ("False", *problem)
    )
    status = _member(generation, f"{ns}/{name}", previous, now, ready_as)
    if isinstance(member, TrajectoryEnv) and problems is not None:
        # Accepted says its pool serves it, not that its sandboxes start: an image that is
        # nowhere fails every open. Its own recent failures show here, as on the pool.
        subject = f"TrajectoryEnv {member.metadata.name}"
        healthy, cause, why = _sandboxes_healthy(
            [p for p in problems if p.subject == subject], "no sandbox of it failed recently"
        )
        conditions = condition(status.conditions, type=SANDBOXES_HEALTHY, status=healthy,
                               reason=cause, message=why, generation=generation,
                               now=now)  # fmt: skip
        status = status.model_copy(update={"conditions": conditions})
    return status


def invalid_member_status(
    generation: int, pool_ref: str, previous: Sequence[Condition], message: str, now: str
) -> MemberStatus:
    """A member whose spec does not validate (what CEL cannot check, pydantic does)."""
    return _member(generation, pool_ref, previous, now, ("False", Reason.INVALID_SPEC, message))


def _member(
    generation: int,
    pool: str,
    previous: Sequence[Condition],
    now: str,
    ready_as: tuple[ConditionStatus, str, str],
) -> MemberStatus:
    """A member's status with Ready as (status, reason, message)."""
    status, reason, message = ready_as
    conditions = condition(previous, type=READY, status=status, reason=reason, message=message,
                           generation=generation, now=now)  # fmt: skip
    return MemberStatus(observed_generation=generation, conditions=conditions, pool=pool)


__all__ = [
    "SANDBOXES_HEALTHY",
    "PoolObservation",
    "invalid_member_status",
    "last_figures",
    "member_status",
    "pool_status",
]
