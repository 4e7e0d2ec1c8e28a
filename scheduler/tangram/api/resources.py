"""The custom resources of ``tangram.dev/v1alpha1``: ActionPool, TrajectoryEnv, RewardService.

One source of truth for three readers: the operator (objects from the API server), embedded
mode (``tangram up -f``, the same YAML ``kubectl apply`` takes) and the CRD generator (the
OpenAPI schemas come from these models, so every field has a description, a default and its
constraints as ``Field`` arguments or ``Literal`` enums).

Kubernetes conventions: keys are camelCase in YAML and snake_case in Python; a spec rejects
unknown keys (a misspelt key is an error naming it, never a silently ignored setting) and
infinite or NaN numbers; ``metadata`` ignores what the API server adds (uid,
resourceVersion, ...). ``status`` is written by the operator and ignored on input.

This module is pure: reading files and parsing YAML happen in ``tangram.cli.manifests``,
which hands the parsed documents to :func:`tangram.api.documents.parse_documents`.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal, Self, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from tangram.api.access import Access, TenantPolicy, namespace_admitted
from tangram.api.action import _API_NAME
from tangram.api.demand import Demand, Efficiency, RangeDemand, allowed_units, ordered
from tangram.api.orderings import (
    DEFAULT_ORDERING,
    CorePrice,
    GpuJoining,
    OrderingName,
    QuotaWaiting,
)
from tangram.api.reasons import Reason
from tangram.api.spec_base import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    ENTRYPOINT,
    ENV_NAME,
    POOL_REF,
    QUANTITY,
    SECRET_KEY,
    Spec,
    label_value_problem,
    qualified_name_problem,
    quantity_value,
    unique,
)

GROUP = "tangram.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

SHORT_NAMES = {"ActionPool": "ap", "TrajectoryEnv": "tenv", "RewardService": "rsvc"}
PLURALS = {
    "ActionPool": "actionpools",
    "TrajectoryEnv": "trajectoryenvs",
    "RewardService": "rewardservices",
}

GpuCount = Literal[1, 2, 4, 8]
ObjectKey: TypeAlias = tuple[str, str]
"""(namespace, name) of an object."""

_HTTP_URL: TypeAdapter[HttpUrl] = TypeAdapter(HttpUrl)


# --- metadata --------------------------------------------------------------------------------


# The operator names a pool's children tangram-<pool>-<role>; the longest that must be a
# DNS label (63 characters) is the scheduler's Service, tangram-<pool>-scheduler.
POOL_NAME_MAX = 63 - len("tangram-") - len("-scheduler")
# Where a sandbox's exec server and its socket are mounted: no workdir of an env.
RESERVED_DIR = "/.tangram"
# The kernel's largest pid_max (PID_MAX_LIMIT on 64-bit): a cgroup's pids.max refuses more.
PID_MAX_LIMIT = 4_194_304


# ObjectMeta's other fields (Kubernetes' own, set by the API server or by kubectl), which
# Tangram does not read; any other key is a misspelling (``namspace``), refused as the
# API server's strict field validation refuses it.
_OTHER_META = frozenset({
    "uid", "resourceVersion", "creationTimestamp", "deletionTimestamp",
    "deletionGracePeriodSeconds", "managedFields", "ownerReferences", "finalizers",
    "generateName", "selfLink", "clusterName",
})  # fmt: skip


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata that Tangram reads; Kubernetes' other
    fields are ignored, any other key is an error naming it."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        extra="ignore",  # the fields of _OTHER_META (the validator below refuses the rest)
        frozen=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ours = {f.alias or n for n, f in cls.model_fields.items()} | set(cls.model_fields)
            unknown = sorted(str(k) for k in data if k not in ours and k not in _OTHER_META)
            if unknown:
                raise ValueError(f"{unknown[0]}: unknown field (misspelt? keys are camelCase)")
        return data

    name: Annotated[
        str,
        Field(
            pattern=DNS_LABEL,
            max_length=63,
            description="object name: lower-case letters, digits and '-', at most 63",
        ),
    ]
    namespace: Annotated[
        str, Field(pattern=DNS_LABEL, max_length=63, description="namespace of the object")
    ] = "default"
    labels: Annotated[dict[str, str], Field(description="Kubernetes labels")] = {}
    annotations: Annotated[dict[str, str], Field(description="Kubernetes annotations")] = {}
    generation: Annotated[
        int | None, Field(ge=0, description="spec generation, set by the API server")
    ] = None

    @property
    def key(self) -> ObjectKey:
        return (self.namespace, self.name)


# --- ActionPool ------------------------------------------------------------------------------


def _resource_name_problem(name: str) -> str | None:
    """Why the API server would refuse ``name`` as a container's resource; None if not."""
    if name in ("cpu", "memory", "ephemeral-storage") or name.startswith("hugepages-"):
        return None
    if "/" not in name:
        return (f"{name!r} is not a resource: cpu, memory, ephemeral-storage, hugepages-<size> "
                "or a qualified name (example.com/gpu)")  # fmt: skip
    return qualified_name_problem(name)


def _node_selector(v: dict[str, str]) -> dict[str, str]:
    for key, value in v.items():
        problem = qualified_name_problem(key) or label_value_problem(value)
        if problem is not None:
            raise ValueError(f"{key}: {problem}")
    return v


NodeSelector = Annotated[dict[str, str], AfterValidator(_node_selector)]


class CpuPool(Spec):
    """The CPU cores pooled for exec actions."""

    node_selector: Annotated[
        NodeSelector, Field(description="labels of the nodes whose cores join the pool")
    ] = {}
    cores_per_node: Annotated[
        int | None,
        Field(
            ge=1,
            description="cores reserved for actions on each node; unset = every core but the "
            "idle set",
        ),
    ] = None
    idle_cores: Annotated[
        int,
        Field(
            ge=1,
            description="cores per node that idle environment containers share between actions",
        ),
    ] = 1


class GpuPool(Spec):
    """The GPUs pooled for RewardService calls, allocated in power-of-two chunks."""

    node_selector: Annotated[
        NodeSelector, Field(description="labels of the nodes whose GPUs join the pool")
    ] = {}
    gpus_per_node: Annotated[
        GpuCount | None,
        Field(description="GPUs per node used by the pool (1, 2, 4 or 8); unset = all of them"),
    ] = None


class SecretRef(Spec):
    """A key of a Secret in the pool's namespace."""

    name: Annotated[
        str, Field(pattern=DNS_SUBDOMAIN, max_length=253, description="name of the Secret")
    ]
    key: Annotated[
        str, Field(pattern=SECRET_KEY, max_length=253, description="key within the Secret")
    ]


class ApiQuota(Spec):
    """A named API quota: at most ``concurrency`` calls in flight, ``rate`` starts per period."""

    name: Annotated[
        str,
        Field(
            pattern=_API_NAME.pattern,
            max_length=63,
            description="quota name; actions ask for it as api:<name>",
        ),
    ]
    concurrency: Annotated[int | None, Field(ge=1, description="calls in flight at most")] = None
    rate: Annotated[int | None, Field(ge=1, description="calls started per periodSeconds")] = None
    period_seconds: Annotated[
        float, Field(gt=0, description="window that rate is counted over, seconds")
    ] = 1.0
    burst: Annotated[
        int | None, Field(ge=1, description="calls that may start at once; unset = rate")
    ] = None
    endpoint: Annotated[
        str | None,
        Field(
            pattern=r"^https?://",
            description="http(s) base URL the scheduler calls; unset = the caller makes the call",
        ),
    ] = None
    secret_ref: Annotated[
        SecretRef | None, Field(description="Secret key holding the API credential")
    ] = None

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                _HTTP_URL.validate_python(v)
            except ValidationError as e:
                raise ValueError(f"not an http(s) URL: {e.errors()[0]['msg']}") from None
        return v

    @model_validator(mode="after")
    def _limited(self) -> Self:
        if self.concurrency is None and self.rate is None:
            raise ValueError("set concurrency, rate or both: a quota needs a limit")
        if self.burst is not None and self.rate is None:
            raise ValueError("burst: only a rate has a burst")
        return self


class Scheduling(Spec):
    """How the pool's scheduler orders and sizes actions."""

    ordering: Annotated[
        OrderingName,
        Field(
            description="queue order: first come first served, or by the work trajectories "
            "have left (most first: trajectory-priority; least first: shortest-remaining)"
        ),
    ] = DEFAULT_ORDERING
    depth: Annotated[
        int,
        Field(ge=1, le=4, description="look-ahead of the completion-time approximation"),
    ] = 2
    max_candidates: Annotated[
        int | None,
        Field(ge=1, description="queued actions considered per round; unset = no limit"),
    ] = None
    elastic: Annotated[
        bool, Field(description="give elastic actions more units than their minimum")
    ] = True
    tenant_fairness: Annotated[
        bool,
        Field(
            description="queue tenants fairly by their spec.access.tenants weights (each "
            "tenant's own actions in the ordering above); false: one order across tenants"
        ),
    ] = True
    quota_waiting: Annotated[
        QuotaWaiting,
        Field(
            description="an action waiting for one API quota — hold: it holds every quota "
            "it needs, so nothing behind it starts on them (first come first served per "
            "quota: the shorter tail); pass: calls that need only a quota with room pass "
            "it, and the first one waiting keeps just its own units (the lower mean)"
        ),
    ] = "hold"
    gpu_joining: Annotated[
        GpuJoining,
        Field(
            description="calls joining a busy RewardService instance while another call "
            "waits for GPUs — until-overdue (the default): they may keep the instance's GPUs "
            "longer until the waiting call is overdue (its ageing bound), so a busy "
            "instance's calls batch instead of taking turns with it; no-delay: only calls "
            "that end before the instance's last call join (the waiting call is never "
            "delayed)"
        ),
    ] = "until-overdue"
    core_price: Annotated[
        CorePrice,
        Field(
            description="how far an elastic action may grow on a loaded node — load: sizes "
            "whose gain per extra core-second is below the node's core price (its queued "
            "and running actions per core, times its utilisation) are dropped before the "
            "completion-time approximation chooses; arrivals (the default): the price also "
            "counts the thinking trajectories expected back before the node's queue drains "
            "(learned think time), weighted by the node's offered load (the share of its "
            "cores its trajectories would hold at their smallest sizes); none: the "
            "approximation alone (the paper's rule, which lets long actions take the cores "
            "the next short ones need)"
        ),
    ] = "arrivals"


Quantity = int | float | str


class SchedulerDeployment(Spec):
    """The scheduler pod of the pool."""

    replicas: Annotated[
        int,
        Field(
            ge=1,
            le=1,
            description="scheduler pods; exactly 1, since one scheduler owns a pool's resources",
        ),
    ] = 1
    resources: Annotated[
        dict[str, dict[str, Quantity]],
        Field(
            description="Kubernetes resource requirements of the scheduler container, passed "
            'through, e.g. {"requests": {"cpu": "1"}}'
        ),
    ] = {}
    port: Annotated[int, Field(ge=1, le=65535, description="HTTP port of the action API")] = 8080
    drain_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=86_400,
            description="on deletion: how long open trajectories may go on (no new ones are "
            "admitted) before the pool and its environments are removed",
        ),
    ] = 600
    agent_grace_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=86_400,
            description="how long the trajectories of a node whose agent went away (a pod "
            "restart, a crash, the node leaving the pool) wait for it to come back with their "
            "environments before they are lost (meanwhile their actions are answered 503); "
            "the operator then deletes the sandbox pods of a node left without an agent",
        ),
    ] = 120

    @field_validator("resources")
    @classmethod
    def _requirements(cls, v: dict[str, dict[str, Quantity]]) -> dict[str, dict[str, Quantity]]:
        for section, amounts in v.items():
            if section not in ("requests", "limits"):
                raise ValueError(f"{section!r}: only requests and limits can be set")
            for resource, amount in amounts.items():
                ok = amount >= 0 if not isinstance(amount, str) else QUANTITY.match(amount)
                if isinstance(amount, bool) or not ok:
                    raise ValueError(f"{section}.{resource}: {amount!r} is not a quantity")
                if (problem := _resource_name_problem(resource)) is not None:
                    raise ValueError(f"{section}.{resource}: {problem}")
        requests, limits = v.get("requests", {}), v.get("limits", {})
        for resource in requests.keys() & limits.keys():
            if quantity_value(requests[resource]) > quantity_value(limits[resource]):
                raise ValueError(
                    f"requests.{resource}: {requests[resource]!r} is more than "
                    f"limits.{resource} ({limits[resource]!r})"
                )
        return v


class Admission(Spec):
    """Bounds on what the scheduler accepts before it answers 429 or 413."""

    max_queued: Annotated[
        int, Field(ge=1, description="queued actions at most; more are refused with 429")
    ] = 100000
    max_request_bytes: Annotated[
        int, Field(ge=1024, description="largest request body accepted, bytes")
    ] = 1048576
    max_file_bytes: Annotated[
        int, Field(ge=1024, description="largest file upload accepted (files API), bytes")
    ] = 1073741824


class ActionPoolSpec(Spec):
    """Resources pooled at the level of single actions, and the scheduler that owns them."""

    cpu: Annotated[CpuPool | None, Field(description="CPU cores for exec actions")] = None
    gpu: Annotated[GpuPool | None, Field(description="GPUs for RewardService calls")] = None
    apis: Annotated[list[ApiQuota], Field(description="named API quotas")] = []
    scheduling: Annotated[Scheduling, Field(description="scheduling policy")] = Scheduling()
    access: Annotated[Access, Field(description="who may use the pool")] = Access()
    scheduler: Annotated[SchedulerDeployment, Field(description="the scheduler pod")] = (
        SchedulerDeployment()
    )
    admission: Annotated[Admission, Field(description="request and queue bounds")] = Admission()

    @field_validator("apis")
    @classmethod
    def _unique_apis(cls, v: list[ApiQuota]) -> list[ApiQuota]:
        unique("API names", (a.name for a in v))
        return v

    @model_validator(mode="after")
    def _pools_something(self) -> Self:
        if self.cpu is None and self.gpu is None and not self.apis:
            raise ValueError("a pool needs cpu, gpu or apis")
        return self


# --- TrajectoryEnv ---------------------------------------------------------------------------


class Security(Spec):
    """Hardening of the environment containers."""

    read_only_root: Annotated[
        bool, Field(description="mount the image's root filesystem read-only")
    ] = False
    user: Annotated[
        str | None,
        Field(
            pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[0-9]+)?$",
            description="user (name or uid, then :gid) commands run as; unset = the image's "
            "USER, else "
            'its first regular user, else 65532 (never root: name "0" for root)',
        ),
    ] = None
    pids_limit: Annotated[
        int,
        Field(
            ge=16,
            le=PID_MAX_LIMIT,
            description="processes and threads per container at most (the kernel's pid_max "
            "bounds it: 4194304)",
        ),
    ] = 512


class ActionProfile(Spec):
    """A named kind of exec action: its argv template, core demand and speed-up profile."""

    name: Annotated[
        str,
        Field(
            pattern=_API_NAME.pattern,
            max_length=63,
            description="profile name that requests refer to",
        ),
    ]
    command: Annotated[
        list[str],
        Field(
            description="argv template; '{dop}' is replaced by the cores granted; empty = the "
            "request supplies the argv"
        ),
    ] = []
    cpu: Annotated[
        Demand | None,
        Field(description="cores: n, {min, max} or {choices}; unset = the environment's cpu"),
    ] = None
    t1_seconds: Annotated[
        float | None, Field(gt=0, description="run time with one core, seconds, if known")
    ] = None
    efficiency: Annotated[
        Efficiency | None,
        Field(description="parallel efficiency, {amdahl: p} or {table: {m: E(m)}}"),
    ] = None
    timeout_seconds: Annotated[
        float | None, Field(gt=0, description="kill the command after this long")
    ] = None


PoolRef = Annotated[
    str,
    Field(
        pattern=POOL_REF,
        max_length=127,
        description="ActionPool in the same namespace, or namespace/name",
    ),
]


class TrajectoryEnvSpec(Spec):
    """The environment container that each trajectory owns for its lifetime."""

    pool_ref: PoolRef
    image: Annotated[
        str,
        Field(min_length=1, description="container image (ignored by the process runtime)"),
    ]
    memory_gib: Annotated[
        float,
        Field(alias="memoryGiB", gt=0, description="memory reserved per trajectory, GiB"),
    ] = 1.0
    disk_gib: Annotated[
        float | None,
        Field(
            alias="diskGiB",
            gt=0,
            description="writable disk per trajectory, GiB (files it writes outside volumes; "
            "going over ends the trajectory: DiskLimitExceeded); unset = no limit",
        ),
    ] = None
    cpu: Annotated[
        Demand, Field(description="default cores per action: n, {min, max} or {choices}")
    ] = RangeDemand(min=1, max=1)
    workdir: Annotated[
        str, Field(pattern=r"^/", description="absolute working directory of commands")
    ] = "/work"
    env: Annotated[dict[str, str], Field(description="environment variables of commands")] = {}
    setup: Annotated[
        list[Annotated[list[str], Field(min_length=1)]],
        Field(description="argv lists run once when a trajectory opens, in order"),
    ] = []
    network: Annotated[
        str,
        Field(min_length=1, description="container network: none, host or a network name"),
    ] = "none"
    security: Annotated[Security, Field(description="container hardening")] = Security()
    runtime_class_name: Annotated[
        str | None,
        Field(
            pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
            description="RuntimeClass of the sandbox pods on Kubernetes (runc-based "
            "runtimes; gVisor and Kata are not supported yet); unset = the node's default",
        ),
    ] = None
    warm_pool: Annotated[
        int, Field(ge=0, description="containers kept started ahead of trajectories")
    ] = 0
    idle_timeout_seconds: Annotated[
        float | None,
        Field(gt=0, description="close a trajectory idle this long; unset = never"),
    ] = None
    max_command_seconds: Annotated[
        float | None,
        Field(
            gt=0,
            description="no command runs longer: one given no timeout, or a longer one, is "
            "killed after this long (status timeout); unset = no limit",
        ),
    ] = None
    actions: Annotated[list[ActionProfile], Field(description="named action profiles")] = []

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not re.fullmatch(ENV_NAME, k)]
        if bad:
            raise ValueError(f"not environment variable names: {bad}")
        return v

    @field_validator("setup")
    @classmethod
    def _argv(cls, v: list[list[str]]) -> list[list[str]]:
        for i, argv in enumerate(v):
            if not argv[0]:
                raise ValueError(f"setup[{i}]: the program name is empty")
        return v

    @field_validator("cpu")
    @classmethod
    def _cpu_at_least_one(cls, v: Demand) -> Demand:
        if min(allowed_units(v)) < 1:
            raise ValueError("an action needs at least one core")
        return v

    @field_validator("actions")
    @classmethod
    def _unique_actions(cls, v: list[ActionProfile]) -> list[ActionProfile]:
        unique("action profile names", (a.name for a in v))
        for i, profile in enumerate(v):
            if profile.cpu is not None and min(allowed_units(profile.cpu)) < 1:
                raise ValueError(f"actions[{i}].cpu: an action needs at least one core")
            if profile.command and not profile.command[0]:
                raise ValueError(f"actions[{i}].command: the program name is empty")
        return v

    @model_validator(mode="after")
    def _timeouts_within_the_limit(self) -> Self:
        limit = self.max_command_seconds
        for i, profile in enumerate(self.actions):
            if limit is not None and (profile.timeout_seconds or 0) > limit:
                raise ValueError(
                    f"actions[{i}].timeoutSeconds: {profile.timeout_seconds:g} s is over "
                    f"maxCommandSeconds ({limit:g} s)"
                )
        return self

    @model_validator(mode="after")
    def _workdir_is_usable(self) -> Self:
        where = "/" + posixpath.normpath(self.workdir).lstrip("/")  # (normpath keeps "//")
        if where == RESERVED_DIR or where.startswith(f"{RESERVED_DIR}/"):
            raise ValueError(f"workdir: {RESERVED_DIR} holds the exec server (read-only); "
                             "name another directory")  # fmt: skip
        if where == "/" and self.security.read_only_root:
            raise ValueError("workdir: / cannot be the writable directory a read-only "
                             "root (security.readOnlyRoot) gets; name one below it, as "
                             "/work")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _efficiency_needs_a_range(self) -> Self:
        for i, profile in enumerate(self.actions):
            if profile.efficiency is not None and len(allowed_units(self.profile_cpu(profile))) < 2:
                raise ValueError(
                    f"actions[{i}].efficiency: given, but cpu allows only one core count"
                )
        return self

    def profile_cpu(self, profile: ActionProfile) -> Demand:
        """The core demand of a profile: its own, else the environment's default."""
        return profile.cpu if profile.cpu is not None else self.cpu


# --- RewardService ---------------------------------------------------------------------------


class InputSizeRange(Spec):
    """Request sizes a profile was measured on, inclusive."""

    min: Annotated[int, Field(ge=0, description="smallest input size")]
    max: Annotated[int, Field(ge=0, description="largest input size")]

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        return ordered(self)


class ServiceProfile(Spec):
    """Measured duration of one call at one DoP, optionally for a range of input sizes."""

    dop: Annotated[GpuCount, Field(description="GPUs of the instance")]
    t1_seconds: Annotated[float, Field(gt=0, description="duration of one call, seconds")]
    input_size: Annotated[
        InputSizeRange | None,
        Field(description="input sizes (e.g. tokens) it applies to; unset = all"),
    ] = None


class CallBatching(Spec):
    """Calls one resident instance serves at once, as an inference server batches them."""

    max_calls: Annotated[
        int,
        Field(
            ge=1,
            le=1024,
            description="calls an instance runs at once; a call joins a running instance "
            "with room instead of taking GPUs of its own when that is faster for it",
        ),
    ] = 1
    slowdown: Annotated[
        float,
        Field(
            ge=0,
            le=100,
            description="a call that joins an instance running n calls takes "
            "(1 + slowdown x n) times as long as alone",
        ),
    ] = 0.0


class RewardServiceSpec(Spec):
    """A reward or teacher model served from the pool's GPUs, restored on demand."""

    pool_ref: PoolRef
    entrypoint: Annotated[
        str,
        Field(
            pattern=ENTRYPOINT,
            description="package.module:function, a function returning (torch module, score)",
        ),
    ]
    weights: Annotated[
        str,
        Field(
            min_length=1,
            description="path of the model weights on the GPU nodes: a torch.save state dict",
        ),
    ]
    gpu_memory_gib: Annotated[
        float,
        Field(alias="gpuMemoryGiB", gt=0, description="weights plus working memory, GiB"),
    ]
    dop_choices: Annotated[
        list[GpuCount],
        Field(min_length=1, description="GPUs an instance may span: 1, 2, 4 or 8"),
    ] = [1]
    profiles: Annotated[
        list[ServiceProfile], Field(description="measured call durations by DoP")
    ] = []
    max_batch: Annotated[
        int,
        Field(
            ge=1,
            description="inputs scored in one forward pass; a call with more is split",
        ),
    ] = 16
    batching: Annotated[
        CallBatching | None,
        Field(
            description="concurrent calls sharing a resident instance; unset = a call has "
            "its instance to itself"
        ),
    ] = None
    parallelism: Annotated[
        Literal["replicate", "shard"],
        Field(
            description="replicate: a DoP-k instance is k full copies, each scoring 1/k of a "
            "call's inputs (the built-in PyTorch worker; gpuMemoryGiB is per GPU); shard: "
            "the model is split over its k GPUs (an external inference server with tensor "
            "parallelism; gpuMemoryGiB is the total)"
        ),
    ] = "replicate"
    restore_seconds: Annotated[
        float | None,
        Field(
            ge=0,
            description="host-to-GPU restore time of one GPU's copy; unset = model bytes "
            "over the host-to-device bandwidth the node agents measure",
        ),
    ] = None

    @field_validator("dop_choices")
    @classmethod
    def _distinct(cls, v: list[GpuCount]) -> list[GpuCount]:
        if len(set(v)) != len(v):
            raise ValueError("DoP choices must not repeat")
        return sorted(v)

    @model_validator(mode="after")
    def _profiles_match(self) -> Self:
        for i, profile in enumerate(self.profiles):
            if profile.dop not in self.dop_choices:
                raise ValueError(
                    f"profiles[{i}].dop: {profile.dop} is not one of dopChoices {self.dop_choices}"
                )
            for j, other in enumerate(self.profiles[:i]):
                if other.dop == profile.dop and _overlap(other.input_size, profile.input_size):
                    raise ValueError(
                        f"profiles[{i}]: overlaps profiles[{j}] (same dop {profile.dop} and "
                        "input sizes)"
                    )
        return self


def _overlap(a: InputSizeRange | None, b: InputSizeRange | None) -> bool:
    if a is None or b is None:
        return True
    return a.min <= b.max and b.min <= a.max


# --- the resources ---------------------------------------------------------------------------


_OBJECT_CONFIG = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
    extra="forbid",  # a misspelt "spec" is an error, not an empty spec
    frozen=True,
)
_ApiVersion = Annotated[Literal["tangram.dev/v1alpha1"], Field(description="API group/version")]
_Metadata = Annotated[ObjectMeta, Field(description="standard object metadata")]
_Status = Annotated[
    dict[str, Any] | None, Field(description="written by the operator; ignored on input")
]


class _Object(BaseModel):
    """What every custom resource has besides its kind and spec."""

    model_config = _OBJECT_CONFIG

    api_version: _ApiVersion
    metadata: _Metadata
    status: _Status = None

    @property
    def key(self) -> ObjectKey:
        return self.metadata.key


class _PoolMember(_Object):
    spec: Any  # narrowed by each kind; it names its pool

    def pool_key(self) -> ObjectKey:
        return resolve_pool_ref(self.spec.pool_ref, self.metadata.namespace)


class ActionPool(_Object):
    """Pooled CPU cores, GPUs and API quotas with the scheduler that hands them to actions."""

    kind: Annotated[Literal["ActionPool"], Field(description="ActionPool")]
    spec: Annotated[ActionPoolSpec, Field(description="desired state")]

    @field_validator("metadata")
    @classmethod
    def _name_fits_its_children(cls, meta: ObjectMeta) -> ObjectMeta:
        if len(meta.name) > POOL_NAME_MAX:
            raise ValueError(
                f"name: {meta.name!r} has {len(meta.name)} characters; a pool's has at most "
                f"{POOL_NAME_MAX} (its scheduler's Service, tangram-<name>-scheduler, is a "
                "DNS label of at most 63)"
            )
        return meta


class TrajectoryEnv(_PoolMember):
    """The per-trajectory environment container and its named exec actions."""

    kind: Annotated[Literal["TrajectoryEnv"], Field(description="TrajectoryEnv")]
    spec: Annotated[TrajectoryEnvSpec, Field(description="desired state")]


class RewardService(_PoolMember):
    """A GPU reward or teacher model called as service actions."""

    kind: Annotated[Literal["RewardService"], Field(description="RewardService")]
    spec: Annotated[RewardServiceSpec, Field(description="desired state")]


Resource = Annotated[ActionPool | TrajectoryEnv | RewardService, Field(discriminator="kind")]
KINDS: dict[str, type[ActionPool] | type[TrajectoryEnv] | type[RewardService]] = {
    "ActionPool": ActionPool,
    "TrajectoryEnv": TrajectoryEnv,
    "RewardService": RewardService,
}


def resolve_pool_ref(ref: str, namespace: str) -> ObjectKey:
    """``name`` or ``namespace/name`` as the key of an ActionPool, seen from ``namespace``."""
    ns, slash, name = ref.partition("/")
    return (ns, name) if slash else (namespace, ref)


def reference_problem(
    obj: TrajectoryEnv | RewardService, pool: ActionPool | None
) -> tuple[Reason, str] | None:
    """Why ``obj`` cannot use the pool its ``spec.poolRef`` names (``pool``, None when there
    is none), as (a reason, a message); None when it can."""
    pool_ns, pool_name = obj.pool_key()
    if pool is None:
        return Reason.POOL_NOT_FOUND, f"no ActionPool {pool_ns}/{pool_name}"
    ns = obj.metadata.namespace
    if not pool.spec.access.admits(pool_ns, ns):
        return (
            Reason.NAMESPACE_NOT_ADMITTED,
            f"ActionPool {pool_ns}/{pool_name} does not admit namespace {ns} "
            "(spec.access.namespaces)",
        )
    if isinstance(obj, TrajectoryEnv):
        cpu = pool.spec.cpu
        if cpu is None:
            return Reason.NO_CPU_SECTION, f"ActionPool {pool_name} has no cpu section"
        if cpu.cores_per_node is not None:
            demands = [("spec.cpu", obj.spec.cpu)] + [
                (f"spec.actions[{a.name}].cpu", a.cpu)
                for a in obj.spec.actions
                if a.cpu is not None
            ]
            for field, demand in demands:
                least = min(allowed_units(demand))
                if least > cpu.cores_per_node:  # (else every such action is a 400)
                    return (
                        Reason.DOP_DOES_NOT_FIT,
                        f"{field} needs at least {least} cores; coresPerNode of ActionPool "
                        f"{pool_name} is {cpu.cores_per_node}",
                    )
    if isinstance(obj, RewardService):
        gpu = pool.spec.gpu
        if gpu is None:
            return Reason.NO_GPU_SECTION, f"ActionPool {pool_name} has no gpu section"
        if gpu.gpus_per_node is not None and min(obj.spec.dop_choices) > gpu.gpus_per_node:
            return (
                Reason.DOP_DOES_NOT_FIT,
                f"dopChoices {obj.spec.dop_choices} do not fit in gpusPerNode "
                f"{gpu.gpus_per_node} of ActionPool {pool_name}",
            )
    return None


__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "PLURALS",
    "POOL_NAME_MAX",
    "SHORT_NAMES",
    "VERSION",
    "Access",
    "ActionPool",
    "ActionPoolSpec",
    "ActionProfile",
    "Admission",
    "ApiQuota",
    "CallBatching",
    "CpuPool",
    "GpuPool",
    "InputSizeRange",
    "ObjectKey",
    "ObjectMeta",
    "Resource",
    "RewardService",
    "RewardServiceSpec",
    "SchedulerDeployment",
    "Scheduling",
    "SecretRef",
    "Security",
    "ServiceProfile",
    "TenantPolicy",
    "TrajectoryEnv",
    "TrajectoryEnvSpec",
    "namespace_admitted",
    "resolve_pool_ref",
]
