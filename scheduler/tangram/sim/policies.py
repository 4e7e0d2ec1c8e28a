"""Policy names of ``tangram bench`` and how each is assembled from backends.

==================== ==============================================================
``elastic``          ARL-Tangram: every action through the scheduler, FCFS, depth 2
``elastic-priority`` the same with ``trajectory-priority`` ordering
``elastic-doubling`` the same with the estimate exploring doubling unit counts
``elastic-pass``     the same with ``quota_waiting="pass"``: calls on a quota with room
                     pass one that waits for another quota
``elastic-shortest`` the same with ``shortest-remaining`` ordering (least predicted work
                     left first); ``elastic-shortest-hinted``: and each client sends its
                     remaining actions at open, off by a lognormal factor (``HINT_SIGMA``);
                     ``elastic-shortest-hinted-S``: of sigma S (0: exact hints)
``elastic-paper``    the same with ``core_price="none"``: sizes from the paper's ACT
                     estimate alone
``elastic-load``     the same with ``core_price="load"``: the price counts the node's
                     queued and running actions only, not its thinking trajectories
``elastic-unbatched`` the same with every service's ``max_calls`` at 1: a call has its
                     instance to itself (the paper's GPU manager)
``elastic-no-ahead`` the same without restoring instances ahead of their calls
``elastic-no-delay`` the same with ``gpu_joining="no-delay"``: a call joins a busy
                     instance past one waiting for GPUs only if it ends before the
                     instance's last call (the rule before 2026-11-30)
``fixed-dop-N``      action-level pooling, but elastic actions always get N units
``k8s-static``       exec actions in a pod per trajectory (0.5 CPU request, 4 limit),
                     single-process commands; ``k8s-static-dop-N`` runs N processes;
                     ``k8s-static-cp``, ``k8s-static-dop-N-cp``: and pods are bound at
                     the kube-scheduler's default rate (50/s, bursts of 100)
``static-gpu``       service calls on dedicated always-resident GPUs per service,
                     batching up to the service's ``max_calls`` calls an instance;
                     ``static-gpu-batch-N``: N
``unmanaged``        API calls straight to the provider, retried on errors
==================== ==============================================================

Baselines replace only the backend of the resource class they are about; the other
action kinds still go through the elastic scheduler.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from tangram.api.action import ActionKind
from tangram.api.cluster import ClusterSpec
from tangram.api.orderings import CorePrice
from tangram.api.trace import TrajectoryTrace
from tangram.scheduler.core.scheduler import SchedulerConfig
from tangram.sim.backends import (
    K8S_SCHEDULER_BINDS,
    K8sStaticBackend,
    Overheads,
    SchedulerBackend,
    StaticGpuBackend,
    UnmanagedApiBackend,
)
from tangram.sim.engine import Backend, Replay
from tangram.sim.events import EventLoop
from tangram.sim.records import SimResult
from tangram.sim.validate import check_trace

# Elastic policies that differ only in the core price rule (docs/scheduler.md).
_CORE_PRICE: dict[str, CorePrice] = {
    "elastic-paper": "none",
    "elastic-load": "load",
}
_FIXED = re.compile(r"^fixed-dop-([1-9][0-9]*)$")
_K8S = re.compile(r"^k8s-static(?:-dop-([1-9][0-9]*))?(-cp)?$")
_STATIC = re.compile(r"^static-gpu(?:-batch-([1-9][0-9]*))?$")
_HINTED = re.compile(r"^elastic-shortest-hinted(?:-([0-9]+(?:\.[0-9]+)?))?$")
# How far off a client's remaining-steps hint is (lognormal sigma): the true count times a
# factor within [0.55, 1.8] for two trajectories in three. ASSUMPTION: no paper gives one.
HINT_SIGMA = 0.6
NAMED = (
    "elastic",
    "elastic-priority",
    "elastic-doubling",
    "elastic-pass",
    "elastic-shortest",
    "elastic-shortest-hinted",  # and elastic-shortest-hinted-S
    "elastic-paper",
    "elastic-load",
    "elastic-unbatched",
    "elastic-no-ahead",
    "elastic-no-delay",
    "unmanaged",
)


# A count a policy name ends in that is no count: ``fixed-dop-0``, ``static-gpu-batch-007``
# name known policies with a bad N, said so rather than "unknown policy".
_BAD_COUNT = re.compile(r"^(fixed-dop|k8s-static-dop|static-gpu-batch)-([0-9]+)(-cp)?$")


def check_policy(name: str) -> str:
    """Validate a policy name; the error names the allowed forms."""
    if any(p.match(name) for p in (_FIXED, _K8S, _STATIC, _HINTED)) or name in NAMED:
        return name
    bad = _BAD_COUNT.match(name)
    if bad and (bad.group(3) is None or bad.group(1) == "k8s-static-dop"):
        raise ValueError(
            f"policy {name!r}: N of {bad.group(1)}-N must be a whole number >= 1 "
            f"(without leading zeros), got {bad.group(2)}"
        )
    raise ValueError(
        f"policy {name!r} is unknown; use one of {', '.join(NAMED)}, "
        "elastic-shortest-hinted-S (S: the hints' lognormal sigma), fixed-dop-N, "
        "k8s-static, k8s-static-dop-N (either with -cp), static-gpu or static-gpu-batch-N"
    )


def build(
    policy: str,
    cluster: ClusterSpec,
    *,
    seed: int = 0,
    config: SchedulerConfig | None = None,
    overheads: Overheads | None = None,
) -> Replay:
    check_policy(policy)
    base = config or SchedulerConfig()
    oh = overheads or Overheads()
    if policy == "elastic-priority":
        base = replace(base, ordering="trajectory-priority")
    if policy == "elastic-doubling":
        base = replace(base, explore="doubling")
    if policy == "elastic-pass":
        base = replace(base, quota_waiting="pass")
    hint = None
    if policy.startswith("elastic-shortest"):
        base = replace(base, ordering="shortest-remaining")
        if m := _HINTED.match(policy):  # its own stream: the others' draws stay put
            sigma = float(m.group(1)) if m.group(1) else HINT_SIGMA
            hint = (sigma, np.random.default_rng([seed, 1]))
    if policy == "elastic-no-ahead":
        base = replace(base, restore_ahead=False)
    if policy == "elastic-no-delay":
        base = replace(base, gpu_joining="no-delay")
    if policy in _CORE_PRICE:
        base = replace(base, core_price=_CORE_PRICE[policy])
    if m := _FIXED.match(policy):
        base = replace(base, fixed_dop=int(m.group(1)))
    loop = EventLoop()
    pooled_cluster = cluster
    if policy == "elastic-unbatched":  # the paper's GPU manager: one call per instance
        pooled_cluster = cluster.model_copy(
            update={"services": [s.model_copy(update={"max_calls": 1}) for s in cluster.services]}
        )
    pooled = SchedulerBackend(loop, pooled_cluster, base, oh, seed, steps_hint=hint)
    routes: dict[ActionKind, Backend] = dict.fromkeys(ActionKind, pooled)
    if m := _K8S.match(policy):
        dop = int(m.group(1) or 1)
        binds = K8S_SCHEDULER_BINDS if m.group(2) else None
        routes[ActionKind.EXEC] = K8sStaticBackend(loop, cluster, oh, seed, dop=dop, binds=binds)
    elif m := _STATIC.match(policy):
        batch = int(m.group(1)) if m.group(1) else None  # None: each service's maxCalls
        routes[ActionKind.SERVICE] = StaticGpuBackend(loop, cluster, oh, max_batch=batch)
    elif policy == "unmanaged":
        routes[ActionKind.API] = UnmanagedApiBackend(loop, cluster, oh)
    return Replay(loop, routes, policy)


def simulate(
    trace: Sequence[TrajectoryTrace],
    cluster: ClusterSpec,
    policy: str,
    *,
    seed: int = 0,
    config: SchedulerConfig | None = None,
    overheads: Overheads | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay ``trace`` on ``cluster`` under ``policy``; deterministic for a seed. A trace
    the cluster cannot serve raises ``ValueError`` naming the step (``check_trace``)."""
    check_trace(trace, cluster, (policy,))
    return build(policy, cluster, seed=seed, config=config, overheads=overheads).run(
        trace, progress
    )
