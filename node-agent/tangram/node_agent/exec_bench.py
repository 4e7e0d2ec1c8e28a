"""Measurements of the execution plane: per-action overhead and trajectory open latency.

Per-action overhead is the wall time of one ``exec`` of ``true`` on the same container,
through the fast and the portable path alternately (so that both see the same machine
state): cgroup writes, starting the command, collecting its exit, returning to the idle
set. ``true``'s own run (one exec and exit inside the container) is included, which
makes the figures an upper bound of the system's overhead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from tangram.api.wire import EnvSpec
from tangram.node_agent.execution import ExecError, ExecResult, Opened

WARMUP = 20  # actions per path before timing starts (caches, first connections)


class Measured(Protocol):
    """A runtime with environments reached through their exec servers (Docker, pods)."""

    async def exec(
        self, trajectory: str, argv: Sequence[str], cores: Sequence[int], *, path: str = ...
    ) -> ExecResult: ...
    def open(self, trajectory: str, template: EnvSpec) -> Opened: ...
    def close(self, trajectory: str) -> None: ...
    def warm(self, template: EnvSpec) -> int: ...
    def shutdown_warm(self) -> None: ...


def _summary(seconds: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


async def measure_exec(
    rt: Measured,
    trajectory: str,
    actions: int,
    cores: Sequence[int],
    *,
    paths: Sequence[str] = ("fast", "portable"),
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, Any]:
    """Overhead per action of each path, ``actions`` of each, interleaved."""
    times: dict[str, list[float]] = {p: [] for p in paths}
    split: dict[str, list[tuple[float, float, float]]] = {p: [] for p in paths}
    for i in range(WARMUP + actions):
        for path in paths:
            t0 = time.perf_counter()
            res = await rt.exec(trajectory, ["true"], cores, path=path)
            elapsed = time.perf_counter() - t0
            if res.exit_code != 0 or res.path != path:
                raise ExecError(f"{path}: `true` did not run cleanly: {res}")
            if i >= WARMUP:
                times[path].append(elapsed)
                split[path].append((res.setup_s, res.exec_s, res.teardown_s))
        progress(max(0, i + 1 - WARMUP), actions)
    out: dict[str, Any] = {"actions": actions, "cores": list(cores)}
    for path in paths:
        parts = np.median(np.asarray(split[path]), axis=0) * 1e3
        out[path] = {
            **_summary(times[path]),
            "setup_p50_ms": float(parts[0]),
            "exec_p50_ms": float(parts[1]),
            "teardown_p50_ms": float(parts[2]),
        }
    if "portable" in out:
        out["portable_over_fast_p50"] = out["portable"]["p50_ms"] / out["fast"]["p50_ms"]
    return out


def measure_open(
    rt: Measured,
    template: EnvSpec,
    opens: int,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, Any]:
    """Open latency from a cold start (create + start + exec server up) and from the
    warm pool (a rename); the pool is refilled between warm opens, untimed."""
    cold: list[float] = []
    warm: list[float] = []
    pooled = template.model_copy(update={"warm": 1})
    for i in range(opens):
        t = f"bench-open-{i}"
        cold.append(rt.open(t, template).seconds)
        rt.close(t)
        rt.warm(pooled)
        opened = rt.open(t, pooled)
        if not opened.warm:
            raise ExecError("the warm pool handed out nothing")
        warm.append(opened.seconds)
        rt.close(t)
        progress(i + 1, opens)
    rt.shutdown_warm()
    return {"opens": opens, "cold": _summary(cold), "warm": _summary(warm)}
