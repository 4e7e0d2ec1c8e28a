"""The scheduler service's HTTP API (``/v1``) and its node-agent protocol, as models.

Requests forbid unknown fields, so a misspelt option is a 400 naming it rather than a
silently ignored setting. Every action ends in an ``ActionResult`` whatever its kind:
status, outputs, the allocation it ran with and where its time went.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, AnyStr, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tangram.api.action import MAX_T1_S
from tangram.api.demand import Demand, Efficiency
from tangram.api.inventory import NodeInventory
from tangram.api.learned import MAX_STEPS, MAX_TYPE_CHARS
from tangram.api.spec_base import ENV_NAME

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_ENV_NAME = re.compile(ENV_NAME)


def env_problem(env: dict[str, str]) -> str | None:
    """What is wrong with environment variables ``env`` (a command's), naming the
    variable; None when nothing is."""
    for k, v in env.items():
        if not _ENV_NAME.fullmatch(k):
            return f"{k!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)"
        if "\0" in v:
            return f"{k!r}: values cannot contain NUL bytes"
    return None


# What a trajectory's labels, and its env_vars, may each take as JSON: its agent sends both
# with every environment it holds in each hello, one frame of at most 64 MiB (4,096
# trajectories of a node at 16 KiB each fit in it).
MAX_CARRIED_BYTES = 8 << 10


def carried_problem(pairs: dict[str, str]) -> str | None:
    """Why a trajectory's labels or env_vars are too large to carry (measured as the hello
    writes them: JSON, a control character as six bytes); None when they are not."""
    size = len(json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode())
    if size > MAX_CARRIED_BYTES:
        return f"{size} bytes as JSON, over the {MAX_CARRIED_BYTES} a trajectory may carry"
    return None


def env_vars_problem(env: dict[str, str]) -> str | None:
    """What is wrong with a trajectory's ``env_vars``: a command's checks, and their size."""
    return env_problem(env) or carried_problem(env)


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)
MAX_OUTPUT = 16 << 20


def fit_output(text: str, budget: int = MAX_OUTPUT) -> tuple[str, bool]:
    """The head of ``text`` that JSON writes in at most ``budget`` bytes, between its
    quotes, and whether it was cut. Text with nothing to escape takes its UTF-8 bytes, what
    ``output_cap`` counts, so an output at the largest cap (16 MiB) comes back whole. A
    control byte takes 6 (``\\u0000``): 16 MiB of them would make a reply of 96 MiB per
    stream, over every link's frame limit (64 MiB), and a frame over it ends the link and
    every action on it, on each retry again."""
    if 6 * len(text) <= budget:  # (no character takes more than 6)
        return text, False
    size = _encoded_size(text)
    if size <= budget:
        return text, False
    keep = over = len(text)  # ``over``: a length known not to fit
    while size > budget:  # shrinks by at least 1 % a turn: a few turns
        over, keep = keep, min(keep - 1, int(keep * budget / size * 0.99))
        size = _encoded_size(text[:keep])
    # The estimate takes the cut characters to weigh the average: when they are lighter
    # (a plain head before control bytes) it cut too much; bisect back up to the most
    # that fits (a few encodings more, and only for output that is cut).
    while over - keep > 1:
        mid = (keep + over) // 2
        if _encoded_size(text[:mid]) <= budget:
            keep = mid
        else:
            over = mid
    return text[:keep], True


def _encoded_size(text: str) -> int:
    """Bytes of ``text`` as JSON writes it, less its two quotes."""
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Request(_Strict):
    """What a client sends: besides unknown fields, a value of the wrong JSON type is
    refused, never converted. ``"yes"`` or ``1`` is no ``true`` (``pty``), ``true`` no
    core count, ``"5"`` no number (a JSON integer is one, for a field of seconds too): a
    400 names the field, as for the custom resources' files. A literal is given as its
    JSON string still. (FastAPI validates a route's body as Python objects, where a
    strict enum takes only its members: an enum field would need ``Strict(False)``.)"""

    model_config = ConfigDict(strict=True)


class _Answer(BaseModel):
    """What the scheduler answers. Clients (and operators) of earlier releases read it
    too: a field a later scheduler adds is ignored, not a failed call. Requests stay
    strict: a misspelt field is an error naming it."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


Id = Annotated[str, Field(pattern=ID_PATTERN, description="letters, digits, _ . -; ≤ 128")]


def _printable_key(key: str) -> str:
    # A newline or other control character in a key cannot be named in a URL path (the
    # cancel route, DELETE /v1/actions/key:KEY, would look up another key).
    if _CONTROL.search(key):
        raise ValueError("no control characters (a newline, a tab, ...) in a key")
    return key


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_KEY_CHARS = 200  # an idempotency key's length, at most
IdempotencyKey = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_KEY_CHARS,
        description="a retried submission with the same key never runs the action twice",
    ),
    AfterValidator(_printable_key),
]


class ActionStatus(StrEnum):
    OK = "ok"  # ran and ended (whatever its exit code)
    ERROR = "error"  # could not run or ended abnormally (see ``error``)
    TIMEOUT = "timeout"  # killed at its execution timeout
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # never admitted or never started (see ``error``)


# ---- trajectories ----------------------------------------------------------------
class OpenTrajectory(_Request):
    env: Annotated[str, Field(min_length=1, description="TrajectoryEnv name in the pool")]
    id: Annotated[Id | None, Field(description="chosen by the server when absent")] = None
    labels: dict[str, str] = Field(default_factory=dict)
    expected_steps: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_STEPS,
            description="remaining actions, for the trajectory-priority and "
            "shortest-remaining orderings",
        ),
    ] = None
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables of each of its commands (a command's own env "
        "overrides a variable of the same name); its agent keeps them, so they outlast a "
        "scheduler restart",
        json_schema_extra={"propertyNames": {"pattern": _ENV_NAME.pattern}},
    )
    idempotency_key: Annotated[
        IdempotencyKey | None,
        Field(description="a retry with the same key answers with the trajectory it opened"),
    ] = None

    @field_validator("env_vars")
    @classmethod
    def _env_vars(cls, env: dict[str, str]) -> dict[str, str]:
        if (problem := env_vars_problem(env)) is not None:
            raise PydanticCustomError("invalid", problem)  # (its location names the field)
        return env

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        if (problem := carried_problem(labels)) is not None:
            raise PydanticCustomError("invalid", problem)
        return labels

    def digest(self) -> str:
        """What a retry under the same key must repeat: the request less its key, fields
        left at their defaults out (a release that adds one reads the same)."""
        fields = self.model_dump(mode="json", exclude={"idempotency_key"}, exclude_defaults=True)
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


class TrajectoryState(StrEnum):
    OPEN = "open"
    # Its node's agent went away; the environment may still live (a sandbox pod outlives
    # its agent). Actions answer 503 (retry) until the agent is back, or LOST after the
    # pool's grace period.
    AWAY = "away"
    LOST = "lost"  # its environment is gone: it ended by itself, or its node left for good
    CLOSING = "closing"  # its actions are being cancelled and its environment removed
    CLOSED = "closed"

    @property
    def closed(self) -> bool:
        """Its owner closed it (it may still be closing): nothing is done on it any more."""
        return self in (TrajectoryState.CLOSING, TrajectoryState.CLOSED)


class TrajectoryInfo(_Answer):
    id: str
    env: str
    node: str | None
    state: TrajectoryState
    labels: dict[str, str] = Field(default_factory=dict)
    opened_at: float  # unix seconds
    actions: int = 0  # submitted so far
    open_s: float | None = None  # how long opening the environment took
    warm: bool | None = None  # the environment came from the warm pool


# ---- actions -----------------------------------------------------------------------
class Session(_Request):
    kind: Literal["bash", "python"]
    name: Annotated[str, Field(pattern=ID_PATTERN)] = "main"


class ExecRequest(_Request):
    """A command in the trajectory's environment: an argv, a named action profile of
    the TrajectoryEnv (plus ``args``), or ``code`` for a persistent session."""

    argv: Annotated[list[str] | None, Field(min_length=1)] = None
    profile: Annotated[str | None, Field(description="TrajectoryEnv action profile")] = None
    args: list[str] = Field(default_factory=list, description="appended to the profile's command")
    session: Session | None = None
    code: Annotated[str | None, Field(description="what a session runs")] = None
    cpu: Annotated[Demand | None, Field(description="cores: fixed, {min,max} or {choices}")] = None
    t1_s: Annotated[
        float | None, Field(gt=0, le=MAX_T1_S, description="duration on one core, if known")
    ] = None
    efficiency: Efficiency | None = None
    type: Annotated[
        str | None,
        Field(
            max_length=MAX_TYPE_CHARS,
            description="action type for learned profiles (the scheduler keeps the most run)",
        ),
    ] = None
    timeout_s: Annotated[
        float | None, Field(gt=0, description="execution time limit; queueing does not count")
    ] = None
    queue_timeout_s: Annotated[
        float | None, Field(gt=0, description="give up (rejected) if not started by then")
    ] = None
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables of the command",
        json_schema_extra={"propertyNames": {"pattern": _ENV_NAME.pattern}},
    )
    output_cap: Annotated[int, Field(ge=0, le=MAX_OUTPUT)] = 1 << 20
    stdin: Annotated[
        str | None, Field(max_length=MAX_OUTPUT, description="its standard input, then closed")
    ] = None
    pty: bool = Field(
        default=False,
        description="under a pseudo-terminal, as an interactive tool expects (stdout and "
        "stderr are then one stream, returned as stdout)",
    )
    idempotency_key: IdempotencyKey | None = None

    @model_validator(mode="after")
    def _one_command(self) -> Self:
        for name, texts in (("argv", self.argv or []), ("args", self.args)):
            if any("\0" in a for a in texts):
                raise ValueError(f"{name}: arguments cannot contain NUL bytes")
        if (problem := env_problem(self.env)) is not None:
            raise ValueError(f"env: {problem}")
        given = [n for n in ("argv", "profile", "session") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of argv, profile or session")
        if (self.session is None) != (self.code is None):
            raise ValueError("code: a session action needs code, and only it takes code")
        if self.args and self.profile is None:
            raise ValueError("args: only a profile action takes args")
        if self.session is not None and (self.stdin is not None or self.pty):
            raise ValueError("session: a session step takes neither stdin nor pty")
        if self.stdin is not None and "\0" in self.stdin:
            raise ValueError("stdin: cannot contain NUL bytes (send them over the stream)")
        return self


# What the exec server in an environment takes of one command (node-agent's exec_server.c,
# MAX_ARGS and MAX_FRAME): 4,096 arguments and 4,096 environment variables, and 1 MiB for
# the request that starts it, each argument and ``K=V`` with a NUL (and Linux 128 KiB for one
# of them). Admission holds every command to them, whatever the runtime: one over them
# would take its cores, and only then fail (``exec_failed``).
EXEC_MAX_ENTRIES = 4096
EXEC_MAX_BYTES = 1 << 20
# Linux's own bound on one argument or ``K=V`` of execve, its NUL included (MAX_ARG_STRLEN,
# 32 pages of 4 KiB): over it execve fails with E2BIG whatever the total.
EXEC_MAX_ENTRY_BYTES = 32 * 4096
_DOP_VARIABLE = "TANGRAM_DOP"  # the agent adds it to each command's environment


def exec_server_problem(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """``(field, why)`` when the exec server (or Linux) cannot start ``argv`` with the variables
    ``environ`` (a trajectory's ``env_vars`` and the command's ``env``): ``argv`` or
    ``env``, the larger part for their bytes together; None when it may. Only what must
    fail is refused: ``{dop}`` counts as the one digit it becomes at least, and the rest of
    the request (its directory, the counts) not at all."""
    if len(argv) > EXEC_MAX_ENTRIES:
        return "argv", f"{len(argv)} entries, over the exec server's {EXEC_MAX_ENTRIES}"
    variables = len(environ) + (_DOP_VARIABLE not in environ)
    if variables > EXEC_MAX_ENTRIES:
        return "env", (
            f"{variables} variables with the trajectory's env_vars and {_DOP_VARIABLE}, over "
            f"the exec server's {EXEC_MAX_ENTRIES}"
        )
    arg_bytes = [_nul_terminated(a.replace("{dop}", "1")) for a in argv]
    env_bytes = {k: _nul_terminated(f"{k}={v}") for k, v in environ.items()}
    if (longest := max(arg_bytes, default=0)) > EXEC_MAX_ENTRY_BYTES:
        return "argv", f"an argument of {longest} bytes, {_OVER_ENTRY}"
    for k, n in env_bytes.items():
        if n > EXEC_MAX_ENTRY_BYTES:
            return "env", f"variable {k!r}: {n} bytes, {_OVER_ENTRY}"
    args, env = sum(arg_bytes), sum(env_bytes.values())
    if args + env > EXEC_MAX_BYTES:
        return "argv" if args >= env else "env", (
            f"argv and env: {args} + {env} bytes (a NUL after each entry), over the "
            f"{EXEC_MAX_BYTES} the exec server takes of a command (pass large inputs as "
            "stdin or a file)"
        )
    return None


_OVER_ENTRY = (
    f"over the {EXEC_MAX_ENTRY_BYTES} Linux takes of one (MAX_ARG_STRLEN, with its NUL; pass "
    "large inputs as stdin or a file)"
)


def _nul_terminated(text: str) -> int:
    return len(text.encode(errors="surrogatepass")) + 1


# Units of other quotas an API action holds with its own, all granted together (a step
# that calls two rate-limited APIs): quota name -> units.
OtherQuotas = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=253)], Annotated[int, Field(ge=1, le=1024)]],
    Field(
        max_length=16,
        description="units of other quotas held with it, all granted together (quota -> units)",
    ),
]


class ApiLeaseRequest(_Request):
    units: Annotated[int, Field(ge=1, le=1024)] = 1
    quotas: OtherQuotas = Field(default_factory=dict)
    hold_s: Annotated[
        float, Field(gt=0, le=3600, description="the lease ends by itself after this long")
    ] = 300.0
    queue_timeout_s: Annotated[float | None, Field(gt=0)] = None
    idempotency_key: IdempotencyKey | None = None


_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")


def _under_endpoint(path: str) -> str:
    """Refuse a path with a '.' or '..' segment, as written or once its percent-escapes
    are decoded (the HTTP client normalises ``%2e%2e`` as ``..``; a server may decode
    ``%2f`` as ``/``; a servlet container takes ``..;x`` for ``..``): the call would leave
    its endpoint's base path, credential and all."""
    head = re.split(r"[?#]", path, maxsplit=1)[0]
    for segment in head.split("/"):
        decoded = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), segment)
        parts = re.split(r"[/\\]", decoded)
        if any(part.split(";", 1)[0] in (".", "..") for part in parts):
            raise ValueError(
                "'.' and '..' segments (also percent-encoded) are refused: a call stays "
                "under its endpoint's URL, which its credential is for"
            )
    return path


class ApiCallRequest(_Request):
    """A request the service makes for the caller against a quota's endpoint, with the
    credential it holds (never returned, never logged)."""

    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    path: Annotated[
        str, Field(pattern=r"^/[^\s]*$", max_length=2048), AfterValidator(_under_endpoint)
    ] = "/"
    query: dict[str, str] = Field(default_factory=dict)
    body: Any = None  # sent as JSON when given
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="HTTP headers: token names, values without line breaks or NUL",
        json_schema_extra={
            "propertyNames": {"pattern": _HEADER_NAME.pattern},
            "additionalProperties": {"type": "string", "pattern": "^[^\\r\\n\\x00]*$"},
        },
    )
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 60.0
    queue_timeout_s: Annotated[float | None, Field(gt=0)] = None
    idempotency_key: IdempotencyKey | None = None
    quotas: OtherQuotas = Field(default_factory=dict)

    @model_validator(mode="after")
    def _no_credentials(self) -> Self:
        bad = [h for h in self.headers if h.lower() in ("authorization", "cookie", "host")]
        if bad:
            raise ValueError(f"headers: {bad[0]} is set by the service")
        for name, value in self.headers.items():
            if not _HEADER_NAME.match(name) or any(c in value for c in "\r\n\0"):
                raise ValueError(f"headers: {name!r} is not a header name, or its value has "
                                 "line breaks or NUL")  # fmt: skip
        return self


class ServiceCallRequest(_Request):
    """One call of a RewardService: its ``inputs`` are scored together (a batch) on the
    GPUs the scheduler gives the call, the model restored there first if it is not."""

    inputs: Annotated[
        list[Any], Field(min_length=1, max_length=100_000, description="one entry per sample")
    ]
    input_size: Annotated[
        int | None,
        Field(ge=0, description="size of the call (e.g. tokens): picks the matching profile"),
    ] = None
    gpu: Annotated[
        Demand | None, Field(description="DoP choices, within the service's dopChoices")
    ] = None
    t1_s: Annotated[
        float | None,
        Field(gt=0, le=MAX_T1_S, description="duration on one GPU, if the profiles lack it"),
    ] = None
    timeout_s: Annotated[
        float | None, Field(gt=0, description="give up waiting for the result after this long")
    ] = None
    queue_timeout_s: Annotated[float | None, Field(gt=0)] = None
    idempotency_key: IdempotencyKey | None = None


class ServiceStats(_Answer):
    """What a service call found on its GPUs and what making the model resident cost."""

    service: str
    resident: bool = Field(description="the instance was already in GPU memory (a hit)")
    restore_s: float = 0.0
    evict_s: float = 0.0
    restored_bytes: int = 0
    evicted: list[str] = Field(default_factory=list, description="instances evicted for it")


class Allocation(_Answer):
    node: str | None = None
    cores: list[int] = Field(default_factory=list)
    gpus: list[int] = Field(default_factory=list)
    dop: int = 0
    path: str | None = None  # how an exec ran: fast, portable, process, bash, python
    fallback: str | None = None  # why the fast path was not taken


class Timings(_Answer):
    queued_s: float = 0.0  # submitted until its units were allocated
    overhead_s: float = 0.0  # the system's share: dispatch, cgroup writes, start, return
    restore_s: float = 0.0  # service calls: evicting and restoring the model on its GPUs
    exec_s: float = 0.0  # the command itself
    act_s: float = 0.0  # action completion time: queued + overhead + restore + exec


class ErrorInfo(_Answer):
    code: str
    message: str
    retryable: bool = False


class ActionResult(_Answer):
    id: str
    trajectory: str | None = None
    kind: Literal["exec", "service", "api"]
    status: ActionStatus
    exit_code: int | None = None
    # The signal that killed the command; its exit_code is then 128 + it, as a shell's
    # (an exit with that code, a shell's own for a child killed, has none).
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    output: Any = None  # service calls and proxied API requests
    lease: str | None = None  # api leases: release it when done
    service: ServiceStats | None = None  # service calls
    error: ErrorInfo | None = None
    allocation: Allocation = Field(default_factory=Allocation)
    timings: Timings = Field(default_factory=Timings)
    # The idempotency key it was submitted under, the caller's or one its client made
    # (None: submitted without one): a retry under it never runs the action a second
    # time, and ``DELETE /v1/actions/key:<it>`` cancels it. Added later: a scheduler of
    # an earlier release leaves it out, and a client of one ignores it.
    idempotency_key: str | None = None


# A batch item's kinds: the fields each one gives (the first names what it acts on).
_BATCH_KINDS = (("trajectory", "exec"), ("api", "lease"), ("api", "call"), ("service", "score"))
_ACTIONS = tuple(action for _, action in _BATCH_KINDS)


def _batch_kinds(schema: dict[str, Any]) -> None:
    """State in the OpenAPI document what ``_one_action`` checks: exactly one kind, each
    with its own fields given and every other field absent or null."""
    schema["oneOf"] = [
        {
            "required": list(kind),
            "properties": {
                f: ({"type": "string"} if f == kind[0] else {"type": "object"})
                if f in kind
                else {"type": "null"}
                for f in schema["properties"]
            },
        }
        for kind in _BATCH_KINDS
    ]


class BatchItem(_Request):
    """One action of a batch: ``exec`` on a ``trajectory``, a ``lease`` or ``call`` of an
    ``api`` quota, or a ``score`` call of a RewardService named by ``service``."""

    model_config = ConfigDict(json_schema_extra=_batch_kinds)

    trajectory: Id | None = None
    exec: ExecRequest | None = None
    api: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    lease: ApiLeaseRequest | None = None
    call: ApiCallRequest | None = None
    service: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    score: ServiceCallRequest | None = None

    @model_validator(mode="after")
    def _one_action(self) -> Self:
        given = [n for n in _ACTIONS if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of exec, lease, call or score")
        if self.exec is not None and self.trajectory is None:
            raise ValueError("trajectory: an exec item names its trajectory")
        if self.exec is None and self.trajectory is not None:
            raise ValueError("trajectory: only an exec item names a trajectory")
        if (self.lease is not None or self.call is not None) and self.api is None:
            raise ValueError("api: a lease or call item names its quota")
        if self.score is not None and self.service is None:
            raise ValueError("service: a score item names its RewardService")
        if self.service is not None and self.score is None:
            raise ValueError("service: only a score item names a RewardService")
        if self.api is not None and self.lease is None and self.call is None:
            raise ValueError("api: only a lease or call item names a quota")
        return self


class BatchRequest(_Request):
    actions: Annotated[list[BatchItem], Field(min_length=1, max_length=1000)]


class BatchResponse(_Answer):
    results: list[ActionResult]


class Problem(_Strict):
    """Why sandboxes failed, or why a node cannot run actions."""

    reason: Annotated[
        str, Field(description="the cause in one CamelCase word (docs/node-agent.md)")
    ]
    message: str


class ProblemFigure(_Answer):
    """Failures of one cause about one TrajectoryEnv or node, over the recent window."""

    reason: str
    subject: str = Field(description="what failed: TrajectoryEnv <name>, or node <name>")
    count: int = Field(ge=1)
    message: str = Field(description="the latest one's message")
    last_s: float = Field(ge=0, description="seconds since the latest one")


class PoolFigures(_Answer):
    """A scheduler's live figures (``GET /v1/admin/status``, for the operator's CR status;
    the operator and the schedulers it runs are upgraded apart)."""

    pool: str
    epoch: str = Field(description="changes when the scheduler restarts")
    accepting: bool = Field(description="admitting actions (false while stopping)")
    draining: bool = Field(description="refusing new trajectories (the pool is being deleted)")
    nodes: int = Field(ge=0, description="node agents connected")
    stopping: int = Field(
        0, ge=0, description="of them, agents that said they stop (a roll): given no new work"
    )
    cores: int = Field(ge=0, description="cores for actions, all nodes")
    cores_in_use: int = Field(ge=0)
    gpus: int = Field(ge=0)
    gpus_in_use: int = Field(ge=0)
    queue_depth: int = Field(ge=0, description="actions waiting for units")
    running: int = Field(ge=0)
    trajectories: int = Field(ge=0, description="trajectories open or opening")
    apis: dict[str, int] = Field(description="quota name -> calls in flight")
    environments: int = Field(ge=0, description="TrajectoryEnvs served")
    problems: list[ProblemFigure] = Field(
        default_factory=list,
        description="sandbox and node failures of the recent window, latest first",
    )


class ErrorDetail(_Answer):
    field: str
    message: str


class ErrorBody(_Answer):
    class Inner(_Answer):
        code: str
        message: str
        details: list[ErrorDetail] = Field(default_factory=list)

    error: Inner


# The action stream (``/v1/stream``): a client's execs multiplexed on one WebSocket in the
# agent link's framing (``AGENT_SUBPROTOCOL``: a frame holds messages one a line). Under
# load a request per action costs the client and the scheduler more than the action.
STREAM_PATH = "/v1/stream"
AGENTS_PATH = "/v1/agents"  # the node agents' links (WebSocket)


StreamId = Annotated[int, Field(ge=0, le=1 << 53)]
SIGNALS = {"SIGINT": 2, "SIGTERM": 15, "SIGKILL": 9}  # what a caller may send a command


class StreamExec(_Request):
    """What ``POST /v1/trajectories/{trajectory}/exec`` takes, with an id of the caller's
    choosing that the answer carries."""

    id: StreamId
    trajectory: str
    exec: ExecRequest
    stream: bool = Field(
        default=False, description="its output in StreamOutput messages as it is produced"
    )
    interactive: bool = Field(
        default=False, description="its stdin stays open for StreamInput messages until eof"
    )

    @model_validator(mode="after")
    def _not_a_session(self) -> Self:
        if (self.stream or self.interactive) and self.exec.session is not None:
            raise ValueError("stream: a session step is not streamed (run a command instead)")
        return self


class StreamInput(_Request):
    """More standard input for a running interactive exec (by the id it was sent with)."""

    id: StreamId
    stdin: Annotated[str, Field(max_length=MAX_OUTPUT)] = ""
    eof: bool = False  # then its stdin is closed


class StreamSignal(_Request):
    """A signal for a streamed exec's command (its process group); queued ones get it
    when they start."""

    id: StreamId
    signal: Literal["SIGINT", "SIGTERM", "SIGKILL"]


class StreamOutput(_Answer):
    """Output of a streamed exec as it is produced, before its answer."""

    id: int
    stdout: str | None = None
    stderr: str | None = None


class StreamAnswer(_Answer):
    """The answer to one ``StreamExec``: what the HTTP route would have answered."""

    id: int | None  # None: a message too broken to read its id from
    status: int  # the HTTP status the route would give
    result: ActionResult | None = None  # status 200
    error: ErrorBody.Inner | None = None  # otherwise
    retry_after: float | None = None  # 429 and 503: seconds before trying again
    # "input": the refusal of a StreamInput or StreamSignal, not the answer to the exec
    about: Literal["input"] | None = None


# ---- files of a trajectory's environment (``/v1/trajectories/{trajectory}/files``) ----
FileType = Literal["file", "dir", "symlink", "other"]
MAX_PATH = 4096


class FileEntry(_Answer):
    """A file, directory or symlink in a trajectory's environment (symlinks not followed)."""

    name: str
    path: str = Field(description="absolute, inside the environment")
    type: FileType
    size: int = Field(ge=0)
    mode: int = Field(ge=0, le=0o7777, description="permission bits (e.g. 420 = 0o644)")
    mtime: float = Field(description="last modified, unix seconds")
    uid: int = Field(ge=0)
    gid: int = Field(ge=0)
    target: str | None = Field(default=None, description="a symlink's target, as written")


class FileList(_Answer):
    path: str
    entries: list[FileEntry]


class FileWritten(_Answer):
    path: str
    size: int = Field(ge=0, description="bytes written")


class Unpacked(_Answer):
    """A tar extracted into a directory."""

    path: str = Field(description="the directory it was extracted into")
    members: int = Field(ge=0, description="files, directories and links extracted")
    size: int = Field(ge=0, description="bytes of file content written")


class MakeDir(_Request):
    path: Annotated[str, Field(min_length=1, max_length=MAX_PATH)]


class MadeDir(_Answer):
    path: str
    created: bool = Field(description="false: it was a directory already")


class RenameFile(_Request):
    path: Annotated[str, Field(min_length=1, max_length=MAX_PATH)]
    to: Annotated[str, Field(min_length=1, max_length=MAX_PATH)]


# ---- the node-agent protocol (JSON messages over one WebSocket per agent) -------------
class TrajectoryMeta(_Strict):
    """What the agent keeps of a trajectory so a restarted scheduler can take it back."""

    # Inside AgentOpen and AgentHello, between agents and schedulers upgraded apart: a
    # field a newer release adds is ignored, and ``name`` is sent only when it is set.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    id: str  # the pool-wide key the agent knows it by
    tenant: str
    env: str
    labels: dict[str, str] = Field(default_factory=dict)
    opened_at: float = 0.0
    name: str | None = None  # its tenant's id for it, when that is not the key
    # The idempotency key of the open that made it, and that request's digest
    # (OpenTrajectory.digest): a restarted scheduler answers the open's retry with it.
    # Given only to agents that say they keep it (OPEN_KEYS_FEATURE).
    open_key: str | None = None
    open_digest: str | None = None
    # OpenTrajectory.env_vars: kept here so a restarted scheduler gives them to its
    # commands still (an agent of an earlier release drops them; the open still works).
    env_vars: dict[str, str] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _optional_when_set(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Releases before ``name`` refuse unknown fields here: leave these out unless set.
        data: dict[str, Any] = dump(self)
        for optional in ("name", "open_key", "open_digest", "env_vars"):
            if not data.get(optional):
                data.pop(optional, None)
        return data


class RunningAction(_Strict):
    """An action still running on an agent whose scheduler went away."""

    # Part of the hello: a field a newer agent adds is ignored, as the hello's own are.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    key: str  # tenant-scoped idempotency key ("tenant" + US + key)
    trajectory: str
    cores: list[int]
    running_s: float
    digest: str | None = None  # its request's, as its scheduler sent it (_Command.digest)
    # Its time limit as sent (None: none, or from an agent older than this field), so that
    # a timeout of the run says after how long it was killed.
    timeout_s: float | None = None


class RunningCall(_Strict):
    """A keyed RewardService call still running on an agent whose scheduler went away."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    key: str  # tenant-scoped idempotency key ("tenant" + US + key)
    service: str
    gpus: list[int]  # device indexes of its chunk
    running_s: float
    digest: str | None = None  # its request's, as its scheduler sent it (AgentCall.digest)


class GpuWorkerInfo(_Strict):
    """The GPUs an agent's worker serves RewardService calls on."""

    backend: Literal["cuda", "cpu"] = Field(description="cpu: devices stand in for GPUs")
    devices: Annotated[list[int], Field(min_length=1, description="device indexes")]
    memory_bytes: list[int] = Field(description="per device: what service instances may use")
    h2d_gbps: float = Field(gt=0, description="measured host-to-device copy bandwidth")

    @model_validator(mode="after")
    def _one_memory_per_device(self) -> Self:
        if len(self.memory_bytes) != len(self.devices):
            raise ValueError(
                f"memory_bytes: {len(self.memory_bytes)} entries for {len(self.devices)} devices"
            )
        return self


class ServiceDef(_Strict):
    """The node side of a RewardService: what the worker loads."""

    name: str
    entrypoint: str  # package.module:function -> (torch module, score)
    weights: str
    gpu_memory_gb: float  # per GPU of an instance when replicated, else over its GPUs
    replicated: bool = True
    max_batch: int = 16  # inputs per forward pass


class ServiceLoad(_Strict):
    ok: bool
    bytes: int = 0  # weights held in host memory
    load_s: float = 0.0
    error: str | None = None


class ResidentInstance(_Strict):
    """A service instance in GPU memory on a worker: the service, on these devices."""

    service: str
    devices: list[int]


class ServiceOutcome(_Strict):
    outputs: list[Any]
    stats: ServiceStats
    exec_s: float


class AgentHello(_Strict):
    """First message of an agent: who it is and what it holds."""

    # Upgraded apart from the scheduler (see AgentReply): a newer agent's field is ignored.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    node: Annotated[str, Field(min_length=1)]
    inventory: NodeInventory
    runtime: Annotated[
        str, Field(min_length=1, description="where its environments live (its --runtime)")
    ]
    action_cores: Annotated[list[int], Field(description="cores it runs actions on")]
    idle_cores: list[int]
    fast_path: str = ""  # why the fast path is unavailable ('' when it is)
    # Why its commands cannot have input, a terminal or streamed output ('' when they can):
    # a Docker agent without the exec server. Such requests are refused before they queue.
    no_io: str = ""
    trajectories: list[TrajectoryMeta] = Field(
        default_factory=list, description="environments it holds (re-adopted included)"
    )
    running: list[RunningAction] = Field(default_factory=list)
    calls: list[RunningCall] = Field(
        default_factory=list, description="keyed service calls its GPU worker still runs"
    )
    gpu: GpuWorkerInfo | None = None  # a GPU worker for RewardService calls
    problem: Problem | None = None  # why this node cannot run actions (None: it can)
    features: list[str] = Field(
        default_factory=list, description="what it serves beyond actions (files)"
    )
    agent: str = Field(
        "",
        description="which agent: its state directory's digest, the same across its "
        "restarts ('' from agents before it)",
    )


class EnvSpec(_Strict):
    """What an environment is built from: the node side of a TrajectoryEnv."""

    name: str
    image: str
    memory_gb: float = 1.0
    disk_gb: float | None = None  # writable disk limit, GiB (None: none)
    workdir: str = "/work"
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[list[str]] = Field(default_factory=list)  # argv lists run once at open
    network: str = "none"
    read_only_root: bool = False
    user: str | None = None  # None: the image's non-root user when it has one
    pids_limit: int = 512
    runtime_class_name: str | None = None  # the sandbox pods' RuntimeClass (runc-based)
    pool: str = "default"
    warm: int = 0  # ready containers kept for this environment


def json_bytes(model: BaseModel) -> bytes:
    """``model.model_dump_json()`` as the bytes the serializer made, without the decode and
    encode around it (two copies of up to 16 MiB of output, on every keyed action)."""
    return model.__pydantic_serializer__.to_json(model)


# The agent link's subprotocol: a WebSocket frame may hold several messages, one a line
# (JSON as pydantic writes it never holds a raw newline). Each side offers or accepts it
# at the handshake and packs only when the other has said it reads packed frames, so an
# agent and a scheduler of different releases still talk, one message a frame.
AGENT_SUBPROTOCOL = "tangram.lines.v1"
# What an agent sends when it stops on purpose (SIGTERM: a DaemonSet pod deleted), before
# its grace for running commands: the scheduler logs its leaving as a stop, not a loss. A
# heartbeat with one more field, so that a scheduler of an earlier release, which skips
# every message starting as a heartbeat does, reads it as one.
AGENT_LEAVING = '{"heartbeat":true,"leaving":true}'
# An agent whose link drops tries again after 0.1 s, doubling up to this: a scheduler
# that has just started knows its agents are all back within a few times this.
AGENT_BACKOFF_MAX_S = 5.0


FRAME_BYTES = 1 << 20  # a packed frame stops growing here, far below either side's limit


def pack(messages: list[AnyStr], limit: int = FRAME_BYTES) -> list[AnyStr]:
    """Frames for messages queued in the same loop tick: a send per tick, not per message,
    is most of the link's cost under load. A frame holds messages up to ``limit`` bytes in
    all; a larger message goes alone (each message fits the link on its own). Text
    messages make text frames, bytes make bytes."""
    frames: list[AnyStr] = []
    batch: list[AnyStr] = []
    size = 0
    for text in messages:
        if batch and size + len(text) + 1 > limit:
            frames.append(_joined(batch))
            batch, size = [], 0
        batch.append(text)
        size += len(text) + 1
    if batch:
        frames.append(_joined(batch))
    return frames


def _joined(batch: list[AnyStr]) -> AnyStr:
    first = batch[0]
    return first if len(batch) == 1 else ("\n" if isinstance(first, str) else b"\n").join(batch)


def unpack(frame: str) -> list[str]:
    return frame.split("\n")


class _AgentOp(BaseModel):
    # Agents (a DaemonSet) and the scheduler (a Deployment) are upgraded apart, and older
    # schedulers sent every field of every op: fields another op (or a newer scheduler)
    # sends are ignored, not a refused request.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    rid: int = 0  # request id, set by the link that sends it; the reply carries it


class _Command(_AgentOp):
    """What an exec and a session step share: where, on which cores, within what."""

    trajectory: str
    cores: list[int] = Field(default_factory=list)
    timeout_s: float | None = None
    environ: dict[str, str] = Field(default_factory=dict)
    output_cap: int = 1 << 20
    key: str | None = None  # runs at most once per key; a repeat gets the first result
    # The digest of the request its key was admitted with (the scheduler's), handed back
    # in the hello while it runs: a restarted scheduler that adopts it then refuses another
    # request under its key as the first one did. None from an older scheduler.
    digest: str | None = None


class AgentOpen(_AgentOp):
    op: Literal["open"] = "open"
    trajectory: str
    env: EnvSpec
    meta: TrajectoryMeta | None = None  # kept by the agent for a restarted scheduler


class AgentClose(_AgentOp):
    op: Literal["close"] = "close"
    trajectory: str


class AgentExec(_Command):
    op: Literal["exec"] = "exec"
    argv: list[str]
    stdin: str | None = None  # given, then closed (unless ``interactive``)
    pty: bool = False
    # Streamed (a request with chunks): its output as chunk replies while it runs, and its
    # stdin open for AgentInput data until eof (``interactive``); signals either way.
    stream: bool = False
    interactive: bool = False


class AgentSession(_Command):
    op: Literal["session"] = "session"
    session: Session
    code: str


class AgentCancel(_AgentOp):
    """By the rid of the request that started it, or by key (an adopted run)."""

    op: Literal["cancel"] = "cancel"
    target: int | None = None
    key: str | None = None
    # The scheduler reads a cancelled exec's result: the agent kills the command as at its
    # deadline and answers with what it wrote and how long it ran (``cancelled``), instead
    # of cancelling the run. Unset (older schedulers): the run is cancelled, its output lost.
    output: bool = False


class AgentWarm(_AgentOp):
    """The full set of environments the node keeps warm sandboxes of, each topped up to its
    ``warm``; the warm sandboxes of any other environment (removed, or no longer kept
    warm) are removed."""

    op: Literal["warm"] = "warm"
    envs: list[EnvSpec] = Field(default_factory=list)


class AgentServices(_AgentOp):
    """The full set of services the node's GPU worker should hold."""

    op: Literal["services"] = "services"
    services: list[ServiceDef] = Field(default_factory=list)


class AgentCall(_AgentOp):
    op: Literal["call"] = "call"
    service: str
    gpus: list[int] = Field(default_factory=list)  # device indexes
    inputs: list[Any] = Field(default_factory=list)
    # Only make the instance resident, ahead of its calls, without holding the devices (an
    # older agent, which ignores this, runs it as a call without inputs: a restore too).
    ahead: bool = False
    # A call's tenant-scoped idempotency key: the agent runs it at most once while it keeps
    # the key's reply, and a call whose link dropped goes on and is reported unasked.
    key: str | None = None
    digest: str | None = None  # its request's, for a scheduler that adopts it (_Command's)


FileOp = Literal["read", "write", "list", "stat", "mkdir", "remove", "rename", "tar", "untar"]


class AgentFiles(_AgentOp):
    """A file operation in a trajectory's environment, by its exec server: no core. A
    read or a tar answers in chunks (replies with ``more``), a write or an untar takes
    its data in ``AgentInput`` messages; both within ``STREAM_WINDOW`` chunks
    unacknowledged."""

    op: Literal["files"] = "files"
    trajectory: str
    action: FileOp
    path: str  # absolute inside the environment, or relative to its workdir
    to: str | None = None  # rename
    mode: int = 0o644  # write


class AgentInput(_AgentOp):
    """Data for a running request (a write's bytes), and how many of the request's chunks
    the scheduler has taken (``credit``): sent without a reply, in order."""

    op: Literal["input"] = "input"
    target: int  # the rid of the request
    data: str = ""  # base64
    eof: bool = False
    credit: int = 0
    signal: int | None = None  # for a streamed exec's command


AgentRequest = Annotated[
    AgentOpen | AgentClose | AgentExec | AgentSession | AgentCancel | AgentWarm
    | AgentServices | AgentCall | AgentFiles | AgentInput,
    Field(discriminator="op"),
]  # fmt: skip
_AGENT_REQUEST: TypeAdapter[AgentRequest] = TypeAdapter(AgentRequest)


def parse_agent_request(text: str | bytes) -> AgentRequest:
    return _AGENT_REQUEST.validate_json(text)


class ExecOutcome(_Strict):
    # Inside AgentReply, upgraded apart as it is: a later field is ignored, not a broken
    # link. (A scheduler before this ignoring refuses one: the signal travels beside it.)
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    setup_s: float
    exec_s: float
    teardown_s: float
    path: str
    fallback: str = ""


class FilesOutcome(_Strict):
    """What a file operation answers besides data."""

    entry: FileEntry | None = None  # stat, and read (the file read)
    entries: list[FileEntry] = Field(default_factory=list)  # list
    written: int | None = None  # write, untar: bytes of file content
    members: int | None = None  # untar: files, directories and links extracted
    created: bool | None = None  # mkdir


# The chunks a streamed request may have unacknowledged, each way (``credit`` counts
# chunks): a slow reader holds its own request, never the link every request shares.
STREAM_WINDOW = 8
STREAM_CHUNK = 1 << 20  # bytes a chunk carries at most (before base64)
# Runtimes whose environments have no terminals (ExecRequest.pty): the process runtime
# runs commands on the host, with no exec server to make a pty in.
NO_TERMINALS = frozenset({"process"})
NO_TERMINALS_WHY = "the process runtime has no terminals (docker or pod have)"
# Runtimes without persistent sessions (ExecRequest.session): they are processes an
# environment's exec server keeps.
NO_SESSIONS = frozenset({"process", "noop"})
NO_SESSIONS_WHY = "persistent sessions need the Docker or pod runtime"
FILES_FEATURE = "files"  # an agent that serves AgentFiles says so in its hello
TAR_FEATURE = "files-tar"  # and one that serves its tar and untar actions
OPEN_KEYS_FEATURE = "open-keys"  # one that keeps TrajectoryMeta.open_key for its scheduler


# A chunk's JSON written directly: base64 needs no escaping, and a serializer's pass over
# a megabyte of it cost as much as encoding it.
def input_json(target: int, data: bytes) -> str:
    """The ``AgentInput`` that carries ``data`` for request ``target``."""
    return f'{{"op":"input","target":{target},"data":"{base64.b64encode(data).decode()}"}}'


def credit_json(target: int) -> str:
    """The ``AgentInput`` that acknowledges one chunk of request ``target``."""
    return f'{{"op":"input","target":{target},"credit":1}}'


def chunk_json(rid: int, data: bytes, fd: int = 1) -> str:
    """The chunk reply (``AgentReply`` with ``more``) that carries ``data`` of ``rid``."""
    encoded = base64.b64encode(data).decode()
    return f'{{"rid":{rid},"ok":true,"more":true,"fd":{fd},"data":"{encoded}"}}'


class AgentReply(_Strict):
    # Agents (a DaemonSet) and the scheduler (a Deployment) are upgraded apart: a field a
    # newer agent adds to its replies is ignored by an older scheduler, not a broken link.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    rid: int  # 0: an action that finished after its scheduler went away (see ``key``)
    ok: bool
    error: str | None = None
    retryable: bool = False
    reason: str | None = None  # a sandbox failure's cause in one CamelCase word
    # rid 0: this trajectory's environment ended by itself (``reason``, ``error`` say why)
    lost: str | None = None
    # rid 0: a warm sandbox of this TrajectoryEnv could not be made (``reason``, ``error``
    # say why): no open failed yet, but the next will.
    warm_failed: str | None = None
    result: ExecOutcome | None = None
    opened_s: float | None = None
    warm: bool | None = None
    key: str | None = None
    replayed: bool = False  # the result of an earlier run with the same key
    digest: str | None = None  # rid 0: the scheduler's digest of the run's request
    # The signal that killed the command of ``result`` (its exit_code: 128 + it); here,
    # not in ExecOutcome, which schedulers before it refuse unknown fields of.
    signal: int | None = None
    # that signal was the kernel's OOM killer's: its sandbox's memory ran out
    oom_killed: bool = False
    # a command that failed (``ok`` false) once started: how long it ran
    ran_s: float | None = Field(default=None, ge=0)
    # a keyed run that an earlier agent started and never ended: it may have run, and it
    # is not run again
    unknown: bool = False
    loaded: dict[str, ServiceLoad] = Field(default_factory=dict)  # services: per service
    # services: the worker's instances in GPU memory after the sync, least recently used
    # first; the scheduler's residency view of the node starts from them
    resident: list[ResidentInstance] = Field(default_factory=list)
    call: ServiceOutcome | None = None
    # A streamed request's chunk: ``more`` until its last reply. ``data`` (base64) is a
    # piece of its output, ``credit`` how many chunks of its input the agent has taken.
    more: bool = False
    data: str | None = None
    fd: int = 1  # whose output ``data`` is: 1 stdout, 2 stderr
    credit: int = 0
    errno: int | None = None  # a file operation's failure, as the environment's errno
    files: FilesOutcome | None = None
    cancelled: bool = False  # ``result`` is of a command killed by a cancel (``output``)
    # came after the agent's stop began: not taken, nothing of it ran (a retry runs it);
    # ``retryable`` too, for a scheduler that predates this field
    not_taken: bool = False
