"""Small builders for tests: plain data in, no mocks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tangram.api import ActionSpec, ClusterSpec
from tangram.scheduler import Scheduler, SchedulerConfig


def started(s: Scheduler, now: float) -> list[str]:
    """The actions a round at ``now`` starts, in the order it starts them."""
    return [a.action_id for a in s.schedule(now).assignments]


def queued_books(s: Scheduler) -> tuple[Any, ...]:
    """What the scheduler counts of its queued actions, besides the queue's order."""
    return (
        sorted(s.actions),
        dict(s.waiting),
        dict(s.queued_work),
        dict(s.queued_calls),
        dict(s.queued_by_tenant),
        set(s.stranded),
        {t: (x.in_flight, x.queued_exec, x.queued_work) for t, x in s.trajectories.items()},
        {a.id: (a.seq, a.submitted_at, a.work) for a in s.actions.values()},
    )


def cluster(**kw: Any) -> ClusterSpec:
    return ClusterSpec.model_validate(kw)


def exec_action(
    cpu: Any = 1, t1: float | None = None, amdahl: float | None = None, type_: str | None = None
) -> ActionSpec:
    data: dict[str, Any] = {"kind": "exec", "cpu": cpu}
    if t1 is not None:
        data["t1_s"] = t1
    if amdahl is not None:
        data["efficiency"] = {"amdahl": amdahl}
    if type_ is not None:
        data["type"] = type_
    return ActionSpec.model_validate(data)


def elastic(lo: int, hi: int, t1: float, p: float = 0.95) -> ActionSpec:
    return exec_action({"min": lo, "max": hi}, t1, p)


def service_call(name: str, t1: float = 1.0, gpu: Any = None) -> ActionSpec:
    data: dict[str, Any] = {"kind": "service", "service": name, "t1_s": t1}
    if gpu is not None:
        data["gpu"] = gpu
    return ActionSpec.model_validate(data)


def api_call(name: str, t1: float = 1.0) -> ActionSpec:
    return ActionSpec.model_validate({"kind": "api", "api": name, "t1_s": t1})


def busy_node(config: SchedulerConfig, thinking: int = 0) -> Scheduler:
    """64 cores: 48 held by one-core commands of 48 trajectories, a long elastic test suite
    (1-16 cores, 600 s alone, p 0.9) queued, and ``thinking`` placed trajectories idle."""
    s = Scheduler(
        cluster(nodes=[{"name": "n1", "cpus": 64, "numa_nodes": 1, "memory_gb": 1024}]), config
    )
    for i in range(48):
        s.open_trajectory(f"r{i}")
        s.place_trajectory(f"r{i}", "n1")
        s.adopt(f"run{i}", f"r{i}", exec_action(1, 30.0), units=1, started_at=0.0)
    for i in range(thinking):
        s.open_trajectory(f"idle{i}")
        s.place_trajectory(f"idle{i}", "n1")
    s.open_trajectory("t")
    s.place_trajectory("t", "n1")
    s.submit("suite", "t", elastic(1, 16, 600.0, 0.9), 0.0)
    return s


def suite_state() -> dict[str, Any]:
    """An explain state: 8 cores, 6 held by one-core commands, an elastic suite (1-8 cores,
    300 s alone, p 0.8) queued for t7, and t6 thinking."""
    return {
        "cluster": {"nodes": [{"name": "n1", "cpus": 8, "memory_gb": 64}]},
        "trajectories": [{"id": f"t{i}", "node": "n1"} for i in range(8)],
        "running": [
            {"id": f"r{i}", "trajectory": f"t{i}", "units": 1, "started_s": 0.0,
             "action": {"kind": "exec", "cpu": 1, "t1_s": 30.0}}
            for i in range(6)
        ],
        "queue": [
            {"id": "suite", "trajectory": "t7", "submitted_s": 0.0,
             "action": {"kind": "exec", "cpu": {"min": 1, "max": 8}, "t1_s": 300,
                        "efficiency": {"amdahl": 0.8}}},
        ],
    }  # fmt: skip


async def settle(done: Callable[[], bool] = lambda: False, ticks: int = 100) -> bool:
    """Let the loop run what is ready (nothing here waits on time), until ``done``:
    whether it is, within ``ticks`` turns of the loop."""
    for _ in range(ticks):
        if done():
            return True
        await asyncio.sleep(0)
    return done()
