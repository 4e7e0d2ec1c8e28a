"""Checking a trace against a cluster before any replay, so errors name the step at fault."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tangram.api.action import ActionKind, ActionSpec
from tangram.api.cluster import ClusterSpec, NodeSpec, ServiceSpec
from tangram.api.demand import allowed_units
from tangram.api.trace import TrajectoryTrace
from tangram.scheduler.core.admission import quota_limit, quota_units
from tangram.scheduler.core.dp import chunk_level
from tangram.scheduler.core.gpu_pool import gb_per_gpu, holds
from tangram.scheduler.core.quota_pool import Quota


def check_trace(
    trace: Sequence[TrajectoryTrace], cluster: ClusterSpec, policies: Iterable[str] = ()
) -> None:
    """Raise ``ValueError`` naming the trajectory, step and field that the cluster cannot
    serve, under any policy or one of ``policies``."""
    services = {s.name: s for s in cluster.services}
    quotas = {a.name: Quota.of(a) for a in cluster.apis}
    cpu_nodes = [n for n in cluster.nodes if n.cpus]
    biggest = max((n.cpus for n in cpu_nodes), default=0)
    most_memory = max((n.memory_gb for n in cpu_nodes), default=0.0)
    # k8s-static opens a pod for every trajectory, whatever its actions.
    pods = [p for p in policies if p.startswith("k8s-static")]
    gpu_checked: set[tuple[str, tuple[int, ...]]] = set()
    for t in trace:
        if pods or any(s.action.kind is ActionKind.EXEC for s in t.steps):
            why = f"{pods[0]} runs each trajectory in a pod" if pods else "exec actions"
            if not cpu_nodes:
                raise ValueError(f"trajectory {t.id}: {why}, but the cluster has no cpus")
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
                if q not in quotas:
                    raise ValueError(f"{where}: API quota {q!r} is not in the cluster")
            for q, n in quota_units(a).items():  # more than a quota ever has: never starts
                if n > (limit := quota_limit(quotas[q])):
                    raise ValueError(
                        f"{where}: quotas: {n} units of {q} exceed its limit of {limit}"
                    )
            if a.cpu is not None and min(allowed_units(a.cpu)) > biggest:
                raise ValueError(f"{where}: cpu minimum exceeds the largest node ({biggest})")
            if a.service is not None:
                svc = services[a.service]
                wanted = _gpu_units(a, svc)
                if (svc.name, wanted) not in gpu_checked:
                    _check_gpu(svc, wanted, cluster, where)
                    gpu_checked.add((svc.name, wanted))


def _gpu_units(a: ActionSpec, svc: ServiceSpec) -> tuple[int, ...]:
    return allowed_units(a.gpu) if a.gpu is not None else tuple(svc.dop_choices)


def why_no_node_holds(svc: ServiceSpec, k: int, nodes: Sequence[NodeSpec]) -> str:
    """Why no node holds a DoP-``k`` instance of ``svc`` (GPUs, or memory per GPU)."""
    size = chunk_level(k)
    big = [n for n in nodes if n.gpus >= size]
    if not big:
        most_gpus = max((n.gpus for n in nodes), default=0)
        return f"DoP {k} needs {size} GPUs on one node (gpus at most {most_gpus})"
    per_gpu = gb_per_gpu(svc.gpu_memory_gb, svc.replicated, size)
    most = max(n.gpu_memory_gb for n in big)
    return f"DoP {k} needs {per_gpu:g} GB per GPU (gpu_memory_gb at most {most:g})"


def _check_gpu(svc: ServiceSpec, wanted: tuple[int, ...], cluster: ClusterSpec, where: str) -> None:
    """As the scheduler's admission decides (``GpuPool.fits``): some DoP the call allows is
    one of the service's choices and an instance at it fits one node's GPUs."""
    choices = [k for k in wanted if k in svc.dop_choices]
    if not choices:
        raise ValueError(
            f"{where}: gpu: {list(wanted)} has none of service {svc.name}'s dop_choices "
            f"{svc.dop_choices}"
        )
    why = []
    for k in choices:
        size = chunk_level(k)
        per_gpu = gb_per_gpu(svc.gpu_memory_gb, svc.replicated, size)
        if any(holds(n.gpus, n.gpu_memory_gb, size, per_gpu) for n in cluster.nodes):
            return
        why.append(why_no_node_holds(svc, k, cluster.nodes))
    raise ValueError(
        f"{where}: gpu: no DoP in {choices} fits service {svc.name} on one node: " + "; ".join(why)
    )
