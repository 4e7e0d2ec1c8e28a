"""From custom resources to what a running scheduler serves (pure translation)."""

from __future__ import annotations

from collections.abc import Callable

from tangram.api.cluster import ApiSpec
from tangram.api.documents import Resources
from tangram.api.resources import ActionPool, RewardService, SecretRef, TrajectoryEnv
from tangram.api.wire import EnvSpec, ServiceDef
from tangram.scheduler.core.scheduler import SchedulerConfig
from tangram.service.config import (
    ActionProfile,
    ApiEndpoint,
    EnvConfig,
    PoolConfig,
    ServiceConfig,
    TenantLimits,
)


class PoolChoiceError(ValueError):
    pass


def choose_pool(resources: Resources, name: str | None, serving: str | None = None) -> ActionPool:
    """The pool to serve: the one named (NAME, or NAMESPACE/NAME when two namespaces
    declare one of that name), or the only one declared; ``serving`` (NAMESPACE/NAME: a
    reload's, of the pool it serves) when several are declared and none is named."""
    pools = list(resources.pools.values())
    declared = ", ".join(_shown(p) for p in pools) or "none"
    if name is None and serving is not None and len(pools) > 1:
        for p in pools:
            if _shown(p) == serving:
                return p
        raise PoolChoiceError(f"{len(pools)} ActionPools declared ({declared}), none of them "
                              f"{serving}, the one served; a new pool needs a restart")  # fmt: skip
    if name is not None:
        found = [p for p in pools if name in (p.metadata.name, _shown(p))]
        if not found:
            raise PoolChoiceError(f"--pool: no ActionPool {name!r} (declared: {declared})")
        if len(found) > 1:
            raise PoolChoiceError(
                f"--pool: {len(found)} ActionPools are named {name!r}; give one as "
                f"NAMESPACE/NAME: {', '.join(_shown(p) for p in found)}"
            )
        return found[0]
    if len(pools) != 1:
        raise PoolChoiceError(
            f"{len(pools)} ActionPools declared ({declared}); name the one to serve with --pool"
            if pools
            else "no ActionPool declared: the files need one (kind: ActionPool)"
        )
    return pools[0]


def _shown(pool: ActionPool) -> str:
    return f"{pool.metadata.namespace}/{pool.metadata.name}"


SecretLookup = Callable[[str, SecretRef], str]
"""(namespace, secretRef) -> the value; raises LookupError saying what is missing."""


def secret_from_documents(resources: Resources) -> SecretLookup:
    """Embedded mode: Secrets are documents next to the pool."""

    def lookup(namespace: str, ref: SecretRef) -> str:
        value = resources.secret_value(namespace, ref)
        if value is None:
            raise LookupError(f"Secret {ref.name} key {ref.key} is not among the documents")
        return value

    return lookup


def pool_config(
    resources: Resources,
    pool: ActionPool,
    secrets: SecretLookup | None = None,
    *,
    unresolved_ok: bool = False,
) -> PoolConfig:
    """``secrets``: where secretRefs resolve (default: Secret documents among ``resources``;
    in a cluster, the API server). ``unresolved_ok``: a secretRef that cannot be resolved
    leaves its quota's calls refused (:attr:`ApiEndpoint.unresolved`) instead of refusing
    the whole pool."""
    lookup = secrets or secret_from_documents(resources)
    spec = pool.spec
    envs = {
        env.metadata.name: env_config(env, pool.metadata.name)
        for env in resources.envs.values()
        if env.pool_key() == pool.key
    }
    services = {
        svc.metadata.name: service_config(svc)
        for svc in resources.services.values()
        if svc.pool_key() == pool.key and spec.gpu is not None
    }
    apis = tuple(
        ApiSpec(
            name=q.name,
            concurrency=q.concurrency,
            rate_per_s=q.rate / q.period_seconds if q.rate is not None else None,
            period_s=q.period_seconds,
            burst=q.burst,
        )
        for q in spec.apis
    )
    endpoints = {}
    for q in spec.apis:
        if q.endpoint is None:
            continue
        credential, unresolved = None, None
        if q.secret_ref is not None:
            try:
                credential = lookup(pool.metadata.namespace, q.secret_ref)
            except LookupError as e:
                unresolved = f"ActionPool {pool.metadata.name}: apis[{q.name}].secretRef: {e}"
                if not unresolved_ok:
                    raise PoolChoiceError(unresolved) from None
        endpoints[q.name] = ApiEndpoint(q.endpoint, credential, unresolved=unresolved)
    scheduling = SchedulerConfig(**spec.scheduling.model_dump())  # the same field names
    return PoolConfig(
        name=pool.metadata.name,
        envs=envs,
        services=services,
        gpus_per_node=spec.gpu.gpus_per_node if spec.gpu else None,
        apis=apis,
        endpoints=endpoints,
        scheduling=scheduling,
        idle_cores=spec.cpu.idle_cores if spec.cpu else 1,
        cores_per_node=spec.cpu.cores_per_node if spec.cpu else None,
        max_queued=spec.admission.max_queued,
        agent_grace_s=float(spec.scheduler.agent_grace_seconds),
        max_request_bytes=spec.admission.max_request_bytes,
        max_file_bytes=spec.admission.max_file_bytes,
        namespace=pool.metadata.namespace,
        access_namespaces=tuple(spec.access.namespaces),
        access_service_accounts=tuple(spec.access.service_accounts),
        tenants={
            t.name: TenantLimits(
                t.max_trajectories, t.max_queued, t.weight, t.max_share, t.max_streams
            )
            for t in spec.access.tenants
        },
    )


def env_config(env: TrajectoryEnv, pool: str) -> EnvConfig:
    s = env.spec
    profiles = {
        p.name: ActionProfile(
            command=tuple(p.command),
            cpu=p.cpu if p.cpu is not None else s.cpu,
            t1_s=p.t1_seconds,
            efficiency=p.efficiency,
            timeout_s=p.timeout_seconds,
        )
        for p in s.actions
    }
    return EnvConfig(
        spec=EnvSpec(
            name=env.metadata.name,
            image=s.image,
            memory_gb=s.memory_gib,
            disk_gb=s.disk_gib,
            workdir=s.workdir,
            env=dict(s.env),
            setup=[list(a) for a in s.setup],
            network=s.network,
            read_only_root=s.security.read_only_root,
            user=s.security.user,
            pids_limit=s.security.pids_limit,
            runtime_class_name=s.runtime_class_name,
            pool=pool,
            warm=s.warm_pool,
        ),
        cpu=s.cpu,
        profiles=profiles,
        idle_timeout_s=s.idle_timeout_seconds,
        max_command_s=s.max_command_seconds,
    )


def service_config(svc: RewardService) -> ServiceConfig:
    s = svc.spec
    return ServiceConfig(
        spec=ServiceDef(
            name=svc.metadata.name,
            entrypoint=s.entrypoint,
            weights=s.weights,
            gpu_memory_gb=s.gpu_memory_gib,
            replicated=s.parallelism == "replicate",
            max_batch=s.max_batch,
        ),
        dop_choices=tuple(s.dop_choices),
        profiles=tuple(
            (
                p.dop,
                p.t1_seconds,
                (p.input_size.min, p.input_size.max) if p.input_size is not None else None,
            )
            for p in s.profiles
        ),
        restore_s=s.restore_seconds,
        max_calls=s.batching.max_calls if s.batching is not None else 1,
        batch_slowdown=s.batching.slowdown if s.batching is not None else 0.0,
    )
