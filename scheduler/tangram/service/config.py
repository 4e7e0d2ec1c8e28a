"""What a running scheduler serves: environments with their action profiles, API quotas,
scheduling settings — translated from the custom resources (or built directly in tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tangram.api.cluster import ApiSpec
from tangram.api.demand import Demand, Efficiency, RangeDemand
from tangram.api.wire import EnvSpec
from tangram.scheduler.core.scheduler import SchedulerConfig


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


@dataclass(frozen=True, slots=True)
class ApiEndpoint:
    """Where the service sends proxied calls of a quota, and the credential it adds."""

    url: str
    credential: str | None = field(default=None, repr=False)  # never printed
    header: str = "Authorization"  # sent as "Bearer <credential>"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str = "default"
    envs: dict[str, EnvConfig] = field(default_factory=dict)
    apis: tuple[ApiSpec, ...] = ()
    endpoints: dict[str, ApiEndpoint] = field(default_factory=dict)  # by quota name
    scheduling: SchedulerConfig = field(default_factory=SchedulerConfig)
    idle_cores: int = 1  # per node: the shared set idle environments sit on
    cores_per_node: int | None = None  # per node: cores for actions (None: all but idle)
    max_queued: int = 100_000  # admission control: beyond this, 429
    heartbeat_timeout_s: float = 5.0  # an agent silent this long is drained
    # Who may submit when clients present ServiceAccount tokens (in a cluster): the pool's
    # namespace, spec.access.namespaces ('*': all) and spec.access.serviceAccounts (ns/name).
    namespace: str = "default"
    access_namespaces: tuple[str, ...] = ()
    access_service_accounts: tuple[str, ...] = ()
