"""Small builders for tests: plain data in, no mocks."""

from __future__ import annotations

from typing import Any

from tangram.api import ActionSpec, ClusterSpec
from tangram.scheduler import Scheduler


def started(s: Scheduler, now: float) -> list[str]:
    """The actions a round at ``now`` starts, in the order it starts them."""
    return [a.action_id for a in s.schedule(now).assignments]


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
