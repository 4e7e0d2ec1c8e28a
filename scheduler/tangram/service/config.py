"""What a running scheduler serves: environments with their action profiles, API quotas,
scheduling settings — translated from the custom resources (or built directly in tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tangram.api.cluster import ApiSpec
from tangram.api.demand import Demand, Efficiency, RangeDemand
from tangram.api.wire import EnvSpec, ServiceDef
from tangram.scheduler.core.scheduler import SchedulerConfig
from tangram.scheduler.core.shares import TenantShare


@dataclass(frozen=True, slots=True)
class ActionProfile:
    """A named command of an environment (``pytest -n {dop}``) with its demand profile."""

    command: tuple[str, ...]
    cpu: Demand = 1
    t1_s: float | None = None
    efficiency: Efficiency | None = None
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class EnvConfig:
    spec: EnvSpec  # what the agent builds the environment from
    cpu: Demand = field(default_factory=lambda: RangeDemand(min=1, max=1))  # per action default
    profiles: dict[str, ActionProfile] = field(default_factory=dict)
    idle_timeout_s: float | None = None  # a trajectory idle this long is closed (None: never)
    max_command_s: float | None = None  # no command runs longer (None: no limit)


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """A RewardService as the scheduler serves it."""

    spec: ServiceDef  # what the GPU agents load
    dop_choices: tuple[int, ...] = (1,)
    # Measured call durations: (dop, seconds, (min, max) input size or None for any size).
    profiles: tuple[tuple[int, float, tuple[int, int] | None], ...] = ()
    restore_s: float | None = None  # declared; None: model bytes over measured bandwidth
    max_calls: int = 1  # calls a resident instance serves at once
    batch_slowdown: float = 0.0  # a call joining n running calls takes (1 + this·n)× as long

    def durations(self, input_size: int | None) -> dict[int, float]:
        """Expected call duration per profiled DoP for a call of ``input_size``: the
        profiles whose range holds it (or that have none); a size outside every range of
        a DoP takes that DoP's nearest range. Without a size, the slowest profile of each
        DoP: a conservative estimate."""
        best: dict[int, tuple[int, float]] = {}  # dop -> (distance to the range, seconds)
        for dop, seconds, size in self.profiles:
            gap = 0
            if input_size is not None and size is not None:
                gap = max(size[0] - input_size, input_size - size[1], 0)
            held = best.get(dop)
            if held is None or gap < held[0] or (gap == held[0] and seconds > held[1]):
                best[dop] = (gap, seconds)
        return {dop: seconds for dop, (_, seconds) in best.items()}


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What one tenant may hold (``spec.access.tenants``); its share is the core's."""

    max_trajectories: int | None = None
    max_queued: int | None = None
    weight: float = 1.0
    max_share: float = 1.0
    max_streams: int | None = None


NO_LIMITS = TenantLimits()
ANY_TENANT = "*"  # the entry for tenants not listed


@dataclass(frozen=True, slots=True)
class ApiEndpoint:
    """Where the service sends proxied calls of a quota, and the credential it adds."""

    url: str
    credential: str | None = field(default=None, repr=False)  # never printed
    header: str = "Authorization"  # sent as "Bearer <credential>"
    # Why its credential could not be read when the scheduler started (a Secret not made
    # yet): its calls are refused, saying so, until a reload resolves it.
    unresolved: str | None = None


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str = "default"
    envs: dict[str, EnvConfig] = field(default_factory=dict)
    services: dict[str, ServiceConfig] = field(default_factory=dict)  # RewardServices
    gpus_per_node: int | None = None  # GPUs of each node the pool uses (None: all)
    apis: tuple[ApiSpec, ...] = ()
    endpoints: dict[str, ApiEndpoint] = field(default_factory=dict)  # by quota name
    scheduling: SchedulerConfig = field(default_factory=SchedulerConfig)
    idle_cores: int = 1  # per node: the shared set idle environments sit on
    cores_per_node: int | None = None  # per node: cores for actions (None: all but idle)
    max_queued: int = 100_000  # admission control: beyond this, 429
    max_request_bytes: int = 1 << 20  # a larger request body (or stream message): 413
    max_file_bytes: int = 1 << 30  # a larger file upload: 413
    heartbeat_timeout_s: float = 5.0  # an agent silent this long is drained
    # How long the trajectories of a node whose agent went away wait for it to come back
    # (an agent pod restart, a crash) before they are lost.
    agent_grace_s: float = 120.0
    # Who may submit when clients present ServiceAccount tokens (in a cluster): the pool's
    # namespace, spec.access.namespaces ('*': all) and spec.access.serviceAccounts (ns/name).
    namespace: str = "default"
    access_namespaces: tuple[str, ...] = ()
    access_service_accounts: tuple[str, ...] = ()
    tenants: dict[str, TenantLimits] = field(default_factory=dict)  # by tenant, or ANY_TENANT

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant) or self.tenants.get(ANY_TENANT) or NO_LIMITS

    def shares(self) -> tuple[dict[str, TenantShare], TenantShare]:
        """The core's view of the tenants: each named one's share, and everyone else's."""
        named = {
            t: TenantShare(weight=lim.weight, max_share=lim.max_share)
            for t, lim in self.tenants.items()
            if t != ANY_TENANT
        }
        rest = self.limits(ANY_TENANT)
        return named, TenantShare(weight=rest.weight, max_share=rest.max_share)
