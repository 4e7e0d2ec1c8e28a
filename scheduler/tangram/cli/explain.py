"""``tangram explain STATE.json``: what the scheduler decides for a given state, and why.

STATE.json::

    {"cluster": {...cluster file...}, "config": {"depth": 2, ...}, "now": 100.0,
     "recent_wait_s": 0.0, "think_s": 0.0, "exec_core_s": 0.0, "exec_run_s": 0.0,
     "trajectories": [{"id": "t1", "memory_gb": 4, "node": "n0"}],
     "running": [{"id": "r1", "trajectory": "t1", "action": {...}, "units": 4, "started_s": 90}],
     "queue": [{"id": "a1", "trajectory": "t2", "action": {...}, "submitted_s": 99}]}

``queue`` is in submission order; ``action`` objects are trace actions. A placed
trajectory with nothing running or queued is thinking (the core price counts it).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tangram.api.action import ActionSpec
from tangram.api.cluster import ClusterSpec
from tangram.api.field_errors import described
from tangram.api.learned import MAX_STEPS
from tangram.api.orderings import (
    DEFAULT_ORDERING,
    CorePrice,
    GpuJoining,
    OrderingName,
    QuotaWaiting,
)
from tangram.cli.files import InputError, read_json
from tangram.scheduler.core.actions import needs
from tangram.scheduler.core.resource import Resource
from tangram.scheduler.core.scheduler import Round, Scheduler, SchedulerConfig, SchedulingError


class _Strict(BaseModel):
    # Validated strict (``run``): ``"now": "10"`` is no time, as in a trace file.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TrajectoryState(_Strict):
    id: str
    memory_gb: Annotated[float, Field(ge=0)] = 0.0
    node: str | None = None
    # The client's ``expected_steps`` (docs/service.md): the actions it will submit, >= 1.
    hint_steps: Annotated[int | None, Field(ge=1, le=MAX_STEPS)] = None


class RunningState(_Strict):
    id: str
    trajectory: str
    action: ActionSpec
    units: Annotated[int, Field(ge=1)]
    started_s: float  # at most ``now`` (``_in_the_past``)
    # A service call sharing the instance of this running call (listed before it).
    joins: str | None = None


class QueuedState(_Strict):
    id: str
    trajectory: str
    action: ActionSpec
    submitted_s: float  # at most ``now``


class ConfigState(_Strict):
    """``SchedulerConfig``'s fields; see docs/scheduler.md."""

    ordering: OrderingName = DEFAULT_ORDERING
    depth: Annotated[int, Field(ge=1, le=4)] = 2  # (as an ActionPool allows)
    explore: Literal["paper", "doubling"] = "paper"
    max_candidates: Annotated[int | None, Field(ge=1)] = None
    elastic: bool = True
    fixed_dop: Annotated[int | None, Field(ge=1)] = None
    ageing_factor: Annotated[float, Field(gt=0)] = 4.0
    min_age_s: Annotated[float, Field(ge=0)] = 1.0
    ageing_wait: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 2.0
    horizon: Annotated[int | None, Field(ge=1)] = None
    quota_waiting: QuotaWaiting = "hold"
    core_price: CorePrice = "arrivals"
    gpu_joining: GpuJoining = "until-overdue"


class State(_Strict):
    cluster: ClusterSpec
    config: ConfigState = Field(default_factory=ConfigState)
    now: Annotated[float, Field(ge=0)] = 0.0  # the scheduler's clock, from its start
    # The scheduler's recent mean queueing time: shortest-remaining's ageing reads it.
    recent_wait_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # Its learned mean think time: the core price's return term reads it (0: none yet).
    think_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # Its learned mean exec action at the smallest size, core-seconds and seconds: with
    # think_s they give a node's offered load (0: learned from this state's queue).
    exec_core_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    exec_run_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    trajectories: list[TrajectoryState] = Field(default_factory=list)
    running: list[RunningState] = Field(default_factory=list)
    queue: list[QueuedState] = Field(default_factory=list)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="show the scheduler's decision for a state, step by step",
        description="Show what the scheduler decides for STATE.json, and why.",
        epilog='STATE.json: {"cluster": {...a cluster file...}, "config": {"depth": 2}, '
        '"now": 100.0, "recent_wait_s": 0, "think_s": 0, "exec_core_s": 0, "exec_run_s": 0, '
        '"trajectories": [{"id", "memory_gb", "node", "hint_steps"}], '
        '"running": [{"id", "trajectory", "action", "units", "started_s", "joins"}], '
        '"queue": [{"id", "trajectory", "action", "submitted_s"}]} (queue in '
        "submission order; actions as in trace files). Example: examples/explain/waiting.json; "
        "fields: docs/scheduler.md.",
    )
    p.add_argument("state", help="STATE.json: the cluster, running actions and the queue")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.set_defaults(run=run)


def decide(state: State) -> tuple[Scheduler, Round]:
    cfg = state.config
    sched = Scheduler(state.cluster, SchedulerConfig(**cfg.model_dump()))
    sched.assume_recent_wait(state.recent_wait_s)
    sched.assume_think_time(state.think_s)
    if state.exec_core_s or state.exec_run_s:
        sched.assume_exec_action(state.exec_core_s, state.exec_run_s)
    for t in state.trajectories:
        sched.open_trajectory(t.id, t.memory_gb, t.hint_steps)
        if t.node is not None:
            sched.place_trajectory(t.id, t.node)
    for r in state.running:
        sched.adopt(
            r.id, r.trajectory, r.action, units=r.units, started_at=r.started_s, joins=r.joins
        )
    for q in state.queue:
        sched.submit(q.id, q.trajectory, q.action, q.submitted_s)
    result = sched.schedule(state.now)
    while result.again:  # queued calls join an instance it opened, in a round at once
        result = _merged(result, sched.schedule(state.now))
    return sched, _complete(sched, state, result)


def _merged(first: Round, more: Round) -> Round:
    """Two rounds at one instant as one: what either started or restored ahead, and why
    each action still queued waits (the later round's word on it, else the first's)."""
    started = {a.action_id for a in more.assignments}
    later = {aid for aid, _ in more.blocked}
    kept = tuple((aid, why) for aid, why in first.blocked if aid not in started | later)
    return Round(
        assignments=first.assignments + more.assignments,
        wake_at=more.wake_at,
        groups=first.groups + more.groups,
        blocked=kept + more.blocked,
        again=more.again,
        ahead=first.ahead + more.ahead,
        refused=first.refused + more.refused,
        invalid=first.invalid + more.invalid,
    )


def _complete(sched: Scheduler, state: State, result: Round) -> Round:
    """``result`` with a reason for every queued action it neither started nor names.

    A round stops walking the queue once everything anyone waits for is held for an
    earlier action (or ``max_candidates`` were taken): the actions behind are not looked
    at, so the round says nothing of them; explain must, or they vanish from its output."""
    told = {a.action_id for a in result.assignments} | {aid for aid, _ in result.blocked}
    told |= {inv.action_id for inv in result.invalid}
    cfg = state.config
    seen = sum(len(g.candidates) for g in result.groups)
    capped = cfg.max_candidates is not None and seen >= cfg.max_candidates
    extra: list[tuple[str, str]] = []
    for q in state.queue:
        if q.id in told:
            continue
        if capped:
            extra.append((q.id, f"not looked at: max_candidates ({cfg.max_candidates}) reached"))
        else:
            extra.append((q.id, _held_for(sched, q.id, result.blocked)))
    invalid = tuple((inv.action_id, f"refused for good: {inv}") for inv in result.invalid)
    if not extra and not invalid:
        return result
    return replace(result, blocked=result.blocked + tuple(extra) + invalid)


def _held_for(sched: Scheduler, aid: str, blocked: tuple[tuple[str, str], ...]) -> str:
    """Why ``aid`` was not looked at: what it needs is held for an action ahead of it."""
    wants = set(_needs(sched, aid))
    for other, _ in blocked:
        shared = wants & set(_needs(sched, other))
        if shared:
            what = ",".join(sorted(str(r) for r in shared))
            return f"{what} (held for {other}, ahead of it in the queue)"
    what = ",".join(sorted(str(r) for r in wants))
    return f"{what} (held for actions ahead of it in the queue)"


def _needs(sched: Scheduler, aid: str) -> tuple[Resource, ...]:
    a = sched.actions.get(aid)
    if a is None:  # (started or refused since: nothing it holds back)
        return ()
    node = sched.cpu.placement.get(a.trajectory) if a.cpu else None
    return needs(a, node, sched.cpu.placement)


# What each resource an action is short of means, for the bare names a round gives.
_SHORT = {
    "cpu": "not enough free cores on {name} for its smallest size",
    "gpu": "no free GPU chunk of its size",
    "api": "quota {name} has no room now (calls in flight or its rate window)",
    "place": "no node has the cores and memory for its trajectory",
}


def _because(why: str) -> str:
    """A round's reason, said in words where it is only the resources it is short of
    (``cpu:n0``, ``api:search``)."""
    if " " in why:  # (a reason in words already)
        return why
    parts = []
    for r in why.split(","):
        kind, _, name = r.partition(":")
        text = _SHORT.get(kind)
        parts.append(f"{r}: {text.format(name=name)}" if text else r)
    return "; ".join(parts)


def as_dict(result: Round) -> dict[str, Any]:
    return {
        "assignments": [
            {
                "action": a.action_id,
                "trajectory": a.trajectory,
                "node": a.node,
                "units": a.units,
                "cores": list(a.cores),
                "gpus": None if a.chunk is None else [a.chunk.node, a.chunk.start, a.chunk.size],
                "restore": a.restore,
                "sharing": a.sharing,
                "evicted": list(a.evicted),
                "quotas": dict(a.quotas),
                "expected_s": a.expected_s,
                "queued_s": a.queued_s,
            }
            for a in result.assignments
        ],
        "groups": [
            {
                "resource": str(g.resource),
                "candidates": list(g.candidates),
                "elastic": g.elastic,
                "kept": g.kept,
                "core_price": g.core_price,
                "core_price_terms": None if g.price is None else asdict(g.price),
                "capped": [
                    {"action": aid, "up_to": kept, "of": allowed} for aid, kept, allowed in g.capped
                ],
                "eviction_steps": [
                    {
                        "kept": st.kept,
                        "units": list(st.units),
                        "exact_s": st.exact,
                        "approx_s": st.approx,
                        "objective_s": st.objective,
                    }
                    for st in g.steps
                ],
            }
            for g in result.groups
        ],
        "waiting": [{"action": a, "because": _because(why)} for a, why in result.blocked],
        "ahead": [
            {
                "service": h.service,
                "gpus": [h.chunk.node, h.chunk.start, h.chunk.size],
                "expected_s": h.expected_s,
                "ready_at": h.ready_at,
            }
            for h in result.ahead
        ],
        "wake_at": result.wake_at,
    }


def load_state(path: str) -> State:
    """STATE.json, strict as a trace file (docs/simulator.md): no value of the wrong JSON
    type, no NaN, no key twice; errors name the file and the field."""
    data = read_json(path)
    try:
        # Through JSON again: strict Python validation would refuse ``"kind": "exec"`` for
        # an enum, strict JSON validation takes it and refuses ``"now": "10"``.
        state = State.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as e:
        raise InputError(f"{path}: {described(e, '(top level)')}") from None
    _in_the_past(path, state)
    return state


def _in_the_past(path: str, state: State) -> None:
    """A run started, or an action submitted, after ``now`` is no state the scheduler can
    be in: its elapsed time would be negative, and the decision made on it meaningless."""
    times = [(f"running.{i}.started_s", r.started_s) for i, r in enumerate(state.running)]
    times += [(f"queue.{i}.submitted_s", q.submitted_s) for i, q in enumerate(state.queue)]
    for field, at in times:
        if at > state.now:
            raise InputError(f"{path}: {field}: {at} is after now ({state.now})")


def run(args: argparse.Namespace) -> int:
    state = load_state(args.state)
    try:
        _, result = decide(state)
    except SchedulingError as e:
        raise InputError(f"{args.state}: {e}") from None
    report = as_dict(result)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print(report)
    return 0


def _print(report: dict[str, Any]) -> None:
    from rich.text import Text

    from tangram.cli.progress import plain_console

    # Names from the trace are printed as they are; a long reason is one line, not folded
    # at 80 columns when piped (``soft_wrap``, as ``note`` prints).
    c = plain_console(soft_wrap=True)
    for g in report["groups"]:
        kind = "elastic" if g["elastic"] else "fixed units"
        c.print(
            Text.assemble(
                (g["resource"], "bold"),
                f": {len(g['candidates'])} candidates ({kind}), {g['kept']} start now",
            )
        )
        c.print(f"  candidates in queue order: {', '.join(g['candidates'])}")
        if g["core_price"] is not None:
            c.print(f"  core price {g['core_price']:.3f} ACT-s per core-second:")
            t = g["core_price_terms"]
            c.print(
                f"    load {t['load']:.3f}: utilisation {t['utilisation']:.2f} x "
                f"{t['actions']} actions queued or running, per core"
            )
            if t["thinking"] and not t["think_s"]:
                c.print(
                    f"    + return 0: {t['thinking']} thinking there, but no think time learned yet"
                )
            elif t["thinking"]:
                c.print(
                    f"    + return {t['returns']:.3f}: {t['thinking']} thinking "
                    f"(mean think time {t['think_s']:.1f} s),"
                )
                c.print(
                    f"      {t['back']:.0%} back before the {t['backlog_s']:.1f} s backlog "
                    f"drains, x offered load {t['offered']:.2f} (at most 1)"
                )
            else:
                c.print("    + return 0: no trajectory thinking there (or corePrice is load)")
        for cap in g["capped"]:
            c.print(
                f"  {cap['action']}: up to {cap['up_to']} of {cap['of']} cores (each further "
                "core gains less than its price)"
            )
        for st in g["eviction_steps"]:
            c.print(
                f"  keep {st['kept']:>3}: units {st['units']}  exact {st['exact_s']:.2f} s + "
                f"estimate {st['approx_s']:.2f} s = {st['objective_s']:.2f} s"
            )
        if g["elastic"] and g["eviction_steps"]:
            c.print("  greedy eviction stops at the first step that does not lower the objective")
    c.print(Text("assignments", style="bold"))
    for a in report["assignments"]:
        c.print(f"  {a['action']}: {_where(a)}, expected {a['expected_s']:.2f} s")
    if report["waiting"]:
        c.print(Text("waiting", style="bold"))
        for w in report["waiting"]:
            c.print(f"  {w['action']}: {w['because']}")
    if report["ahead"]:
        c.print(Text.assemble(("restored ahead", "bold"), " (for the next calls of their service)"))
        for h in report["ahead"]:
            node, start, size = h["gpus"]
            ready = f"ready in {h['expected_s']:.2f} s"
            c.print(f"  {h['service']}: {_gpus(start, size)} of {node}, {ready}")


def _where(a: dict[str, Any]) -> str:
    """Where an assignment runs: cores of a node, a GPU chunk, or (an API call) under its
    quotas, which hold no node."""
    extra = " (restore)" if a["restore"] else ""
    if a["sharing"]:
        extra += f" (joins an instance running {a['sharing']} calls)"
    if a["cores"]:
        return f"{a['units']} units on {a['node']}, cores {a['cores']}{extra}"
    if a["gpus"]:
        node, start, size = a["gpus"]
        return f"{a['units']} units on {node}, {_gpus(start, size)}{extra}"
    quotas = ", ".join(f"{q} x{n}" for q, n in a["quotas"].items())
    return f"under quota {quotas}{extra}" if quotas else f"no units held{extra}"


def _gpus(start: int, size: int) -> str:
    return f"GPU {start}" if size == 1 else f"GPUs {start}-{start + size - 1}"
