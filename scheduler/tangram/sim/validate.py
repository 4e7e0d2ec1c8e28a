"""Checking a trace against a cluster before any replay, so errors name the step at fault."""

from __future__ import annotations

from collections.abc import Sequence

from tangram.api.action import ActionKind
from tangram.api.cluster import ClusterSpec
from tangram.api.demand import allowed_units
from tangram.api.trace import TrajectoryTrace


def check_trace(trace: Sequence[TrajectoryTrace], cluster: ClusterSpec) -> None:
    """Raise ``ValueError`` naming the trajectory, step and field that the cluster cannot serve."""
    services = {s.name for s in cluster.services}
    apis = {a.name for a in cluster.apis}
    cpu_nodes = [n for n in cluster.nodes if n.cpus]
    biggest = max((n.cpus for n in cpu_nodes), default=0)
    most_memory = max((n.memory_gb for n in cpu_nodes), default=0.0)
    for t in trace:
        if any(s.action.kind is ActionKind.EXEC for s in t.steps):
            if not cpu_nodes:
                raise ValueError(f"trajectory {t.id}: exec actions, but the cluster has no cpus")
            if t.memory_gb > most_memory:
                raise ValueError(
                    f"trajectory {t.id}: memory_gb {t.memory_gb} exceeds every node's memory"
                )
        for i, step in enumerate(t.steps):
            a = step.action
            where = f"trajectory {t.id}, step {i}"
            if a.service is not None and a.service not in services:
                raise ValueError(f"{where}: service {a.service!r} is not in the cluster")
            for q in ([a.api] if a.api else []) + list(a.quotas):
                if q not in apis:
                    raise ValueError(f"{where}: API quota {q!r} is not in the cluster")
            if a.cpu is not None and min(allowed_units(a.cpu)) > biggest:
                raise ValueError(f"{where}: cpu minimum exceeds the largest node ({biggest})")
