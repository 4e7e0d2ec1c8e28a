"""What a submitted action is, checked against the pool: its allowed units per resource,
the quota units it holds, its profile. A request the pool can never run is refused here,
with a ``SchedulingError`` naming the field at fault, rather than waiting forever.

The pool changes after submit: an exec action queued before its trajectory was placed
is refused when the placement gives it a node with fewer cores than its minimum
(``Scheduler._place``, the same error), and one that the pool as it is now cannot host
(its node, GPUs or quota limit left, or its service is being loaded) waits without
holding anyone back until the pool can (``Scheduler.stranded``)."""

from __future__ import annotations

from collections.abc import Mapping

from tangram.api.action import ActionKind, ActionSpec
from tangram.api.cluster import ServiceSpec
from tangram.api.demand import allowed_units
from tangram.scheduler.core.actions import Action
from tangram.scheduler.core.config import SchedulingError
from tangram.scheduler.core.gpu_pool import GpuPool
from tangram.scheduler.core.profiles import Profile
from tangram.scheduler.core.quota_pool import Quota
from tangram.scheduler.core.resource import GPU, Resource
from tangram.scheduler.core.sizing import Sizing


def quota_units(spec: ActionSpec) -> dict[str, int]:
    """Units of each API quota ``spec`` holds while it runs, its ``api`` first: one of its
    ``api`` (on top of any ``quotas`` of that name), and its ``quotas``."""
    held = {spec.api: spec.quotas.get(spec.api, 0) + 1} if spec.api is not None else {}
    return held | {q: n for q, n in spec.quotas.items() if q != spec.api}


def quota_limit(quota: Quota) -> int:
    """The most units of ``quota`` one action may ever hold at once."""
    return min(x for x in (quota.concurrency, quota.per_period, 1 << 30) if x is not None)


def too_wide(minimum: int, trajectory: str, node: str | None, cores: int) -> SchedulingError:
    """The refusal of an exec action whose ``minimum`` cores exceed ``node`` (where its
    trajectory lives; None: not placed yet, the largest node) of ``cores`` cores: at submit,
    and when its trajectory is placed on a smaller node while it is queued."""
    where = f"node {node}, where {trajectory} lives," if node else "the largest node"
    return SchedulingError("cpu", f"minimum {minimum} cores exceeds {where} ({cores} cores)")


def resolve(
    spec: ActionSpec,
    *,
    action_id: str,
    trajectory: str,
    seq: int,
    now: float,
    sizing: Sizing,
    gpu: GpuPool,
    services: Mapping[str, ServiceSpec],
    quotas: Mapping[str, Quota],
) -> Action:
    """The action ``spec`` describes, submitted at ``now`` as the ``seq``-th.

    An elastic action of a type the profile book has not learned yet is counted there, and
    every few of them probe twice the minimum (so that the fit sees a second unit count).
    """
    cpu_pool, book, config = sizing.cpu, sizing.book, sizing.config
    cpu: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    profile = Profile(spec.t1_s, spec.efficiency) if spec.t1_s is not None else None
    for q in spec.quotas:
        if q not in quotas:
            raise SchedulingError("quotas", f"unknown API quota {q!r}")
    if spec.kind is ActionKind.EXEC:
        if not cpu_pool.nodes:
            raise SchedulingError("kind", "this pool has no CPU nodes for exec actions")
        cpu = allowed_units(spec.cpu) if spec.cpu is not None else (1,)
        placed = cpu_pool.placement.get(trajectory)
        cap = cpu_pool.nodes[placed].cores if placed is not None else sizing.biggest_any_node
        if cpu[0] > cap:
            raise too_wide(cpu[0], trajectory, placed, cap)
    elif spec.kind is ActionKind.SERVICE:
        assert spec.service is not None
        svc = services.get(spec.service)
        if svc is None:
            raise SchedulingError("service", f"unknown RewardService {spec.service!r}")
        wanted = allowed_units(spec.gpu) if spec.gpu is not None else tuple(svc.dop_choices)
        # A node still loading the service counts: the call waits for it, is not refused.
        gpus = tuple(k for k in wanted if k in svc.dop_choices and gpu.fits(svc.name, k, soon=True))
        if not gpus:
            raise SchedulingError(
                "gpu", f"no DoP in {list(wanted)} fits service {svc.name} on this pool's GPUs"
            )
        if profile is not None and profile.efficiency is None and svc.efficiency is not None:
            profile = Profile(profile.t1_s, svc.efficiency)
    else:
        assert spec.api is not None
        if spec.api not in quotas:
            raise SchedulingError("api", f"unknown API quota {spec.api!r}")
    held = quota_units(spec)
    for q, n in held.items():
        limit = quota_limit(quotas[q])
        if n > limit:
            # An api action's own quota: the units of the lease (the request's ``units``).
            field = "units" if q == spec.api else "quotas"
            raise SchedulingError(field, f"{n} units of {q} exceed its limit of {limit}")
    units = cpu or gpus
    elastic_capable = len(units) > 1
    ordered = tuple(sorted(held.items(), key=lambda kv: (kv[0] != spec.api, kv[0])))
    action = Action(
        id=action_id,
        trajectory=trajectory,
        kind=spec.kind,
        type=spec.action_type(),
        seq=seq,
        submitted_at=now,
        cpu=cpu,
        gpu=gpus,
        service=spec.service,
        quotas=ordered,
        profile=profile,
        elastic_capable=elastic_capable,
        pool_wide=((GPU,) if gpus else ()) + tuple(Resource.api(q) for q, _ in ordered),
    )
    if (
        elastic_capable
        and config.learn
        and config.elastic
        and config.fixed_dop is None
        and (profile is None or profile.efficiency is None)
        and book.learned(action.type) is None
    ):
        action.probe = book.should_probe(action.type)
    return action
