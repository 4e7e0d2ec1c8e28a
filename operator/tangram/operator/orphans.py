"""Sandbox pods that no node agent of their pool will ever take back (pure: pods in,
decision out; the reconciler reads the pods and deletes what this names).

A node agent takes back its node's sandbox pods when it starts, and deletes those it
cannot (``PodRuntime.adopt``). A node that leaves the pool — its ``nodeSelector`` no
longer matches, ``spec.cpu`` was removed, the agent DaemonSet was deleted — gets no agent
again, so nobody would: its sandboxes would hold their memory and disk (and their pod
slots) until the pool itself is deleted. The operator deletes them once the node has had
no CPU agent pod of the pool (a GPU agent there takes no sandbox back) for the pool's
``agentGraceSeconds``: by then the scheduler has
lost their trajectories, since it waits just as long for an agent to come back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sweep", "agent_nodes", "sandbox_nodes", "sweep"]

# Pods whose containers will not run again (the DaemonSet replaces such an agent pod).
_ENDED = ("Succeeded", "Failed")


def _node_of(pod: Mapping[str, Any]) -> str | None:
    """The node a pod is bound to or, for a DaemonSet's pod not yet bound, the one node its
    affinity allows (the DaemonSet controller pins each pod so, by ``metadata.name``)."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})  # fmt: skip
    for term in required.get("nodeSelectorTerms") or []:
        for match in term.get("matchFields") or []:
            values = match.get("values") or []
            if match.get("key") == "metadata.name" and len(values) == 1:
                return str(values[0])
    return None


def agent_nodes(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """The nodes with an agent pod that is or will be running there: a pending pod's agent
    takes the node's sandboxes back once it starts, and one being deleted still runs (and
    is still connected: the scheduler's grace starts when it stops) until it is gone."""
    nodes = set()
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in _ENDED:
            continue
        if (node := _node_of(pod)) is not None:
            nodes.add(node)
    return nodes


def sandbox_nodes(pods: Iterable[Mapping[str, Any]], pool_uid: str) -> dict[str, str]:
    """Pod name -> node, of the pool's sandbox pods not already being deleted (those its
    ownerReference names: a pod of an earlier pool of the same name is not this one's)."""
    found = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        owners = meta.get("ownerReferences") or []
        if meta.get("deletionTimestamp") or not any(o.get("uid") == pool_uid for o in owners):
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        if node:  # (sandbox pods are created bound to their agent's node)
            found[str(meta["name"])] = str(node)
    return found


@dataclass(frozen=True)
class Sweep:
    """What to delete now, and since when each node has had sandboxes and no agent (to
    pass to the next sweep: a deletion that failed is tried again there at once)."""

    delete: dict[str, list[str]] = field(default_factory=dict)  # node -> its pods, sorted
    waiting: dict[str, dt.datetime] = field(default_factory=dict)


def sweep(
    sandboxes: Mapping[str, str],
    attended: set[str],
    waiting: Mapping[str, dt.datetime],
    now: dt.datetime,
    grace_s: float,
) -> Sweep:
    """The sandboxes (pod name -> node) on nodes without an agent (not in ``attended``)
    since ``grace_s`` or longer. ``waiting`` is the last sweep's: a node first seen so now
    starts its grace now; a node with an agent again, or with no sandbox left, leaves it."""
    since = {n: waiting.get(n, now) for n in set(sandboxes.values()) if n not in attended}
    due = sorted(n for n, t in since.items() if (now - t).total_seconds() >= grace_s)
    delete: dict[str, list[str]] = {n: [] for n in due}
    for pod, node in sorted(sandboxes.items()):
        if node in delete:
            delete[node].append(pod)
    return Sweep(delete=delete, waiting=since)
