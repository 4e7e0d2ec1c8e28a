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
from dataclasses import asdict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tangram.api.action import ActionSpec
from tangram.api.cluster import ClusterSpec
from tangram.api.field_errors import described
from tangram.api.orderings import DEFAULT_ORDERING, CorePrice, OrderingName, QuotaWaiting
from tangram.cli.files import InputError, read_json
from tangram.scheduler.core.scheduler import Round, Scheduler, SchedulerConfig, SchedulingError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrajectoryState(_Strict):
    id: str
    memory_gb: Annotated[float, Field(ge=0)] = 0.0
    node: str | None = None
    hint_steps: int | None = None


class RunningState(_Strict):
    id: str
    trajectory: str
    action: ActionSpec
    units: Annotated[int, Field(ge=1)]
    started_s: float
    # A service call sharing the instance of this running call (listed before it).
    joins: str | None = None


class QueuedState(_Strict):
    id: str
    trajectory: str
    action: ActionSpec
    submitted_s: float


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


class State(_Strict):
    cluster: ClusterSpec
    config: ConfigState = Field(default_factory=ConfigState)
    now: float = 0.0
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
        more = sched.schedule(state.now)
        result = Round(
            assignments=result.assignments + more.assignments,
            wake_at=more.wake_at,
            groups=result.groups + more.groups,
            blocked=more.blocked,
            again=more.again,
        )
    return sched, result


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
        "waiting": [{"action": a, "because": why} for a, why in result.blocked],
        "wake_at": result.wake_at,
    }


def run(args: argparse.Namespace) -> int:
    data = read_json(args.state)
    try:
        state = State.model_validate(data)
    except ValidationError as e:
        raise InputError(f"{args.state}: {described(e)}") from None
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

    c = plain_console()  # (names from the trace are printed as they are)
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
        where = f"cores {a['cores']}" if a["cores"] else (f"GPUs {a['gpus']}" if a["gpus"] else "")
        extra = " (restore)" if a["restore"] else ""
        if a["sharing"]:
            extra += f" (joins an instance running {a['sharing']} calls)"
        c.print(
            f"  {a['action']}: {a['units']} units on {a['node']} {where}{extra}, "
            f"expected {a['expected_s']:.2f} s"
        )
    if report["waiting"]:
        c.print(Text("waiting", style="bold"))
        for w in report["waiting"]:
            c.print(f"  {w['action']}: {w['because']}")
