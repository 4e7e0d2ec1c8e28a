"""E2B's control-plane API (``api.e2b.app`` in E2B's cloud): create, find, list, extend
and kill sandboxes. The API key is a tenant token of this service.

No ``from __future__ import annotations``: FastAPI reads the routes' annotations.
"""

import base64
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal
from urllib.parse import unquote_plus

from fastapi import APIRouter, Depends, Header, Query, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tangram.api.demand import allowed_units
from tangram.api.wire import carried_problem, env_vars_problem
from tangram.service.e2b.errors import ERRORS, E2BError, E2BRoute
from tangram.service.e2b.sandboxes import (
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    Sandbox,
    Sandboxes,
    sandbox_labels,
)

ENVD_VERSION = "0.5.7"  # the envd whose API is served: octet-stream uploads, stdin control
Admit = Callable[[str | None], Awaitable[str]]  # a token to its tenant, or E2BError

Timeout = Annotated[int, Field(ge=1, le=MAX_TIMEOUT_S, description="seconds from now")]
PAGE = 100  # sandboxes a page of the list holds by default and at most, as E2B's API
STATES = ("running", "paused")  # E2B's; these sandboxes are only ever running


class _Body(BaseModel):
    # E2B's clients send more than is served (autoPause, network, mcp...): not refused.
    # What is served is taken only as the JSON type it is, as /v1's requests are
    # (``wire._Request``) and E2B's own API (Go) takes it: ``"timeout": "30"``, ``true``
    # or ``30.0`` is a 400 naming ``timeout``, not a sandbox of 30 s, or of 1. Strict in
    # the model, not by validating the raw body: FastAPI hands the route the parsed JSON.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1,
                             description="the TrajectoryEnv to open")  # fmt: skip
    timeout: Timeout = DEFAULT_TIMEOUT_S
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")

    @field_validator("env_vars")
    @classmethod
    def _variables(cls, env: dict[str, str]) -> dict[str, str]:
        """Refused here, or every command of the sandbox would be refused for them."""
        if (problem := env_vars_problem(env)) is not None:
            raise _invalid(problem)  # (the error names envVars)
        return env

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str]) -> dict[str, str]:
        """The trajectory's labels, its timeout's among them: bounded as labels are."""
        if (problem := carried_problem(sandbox_labels(metadata, MAX_TIMEOUT_S))) is not None:
            raise _invalid(problem)  # (the error names metadata)
        return metadata


class SetTimeout(_Body):
    timeout: Timeout


class ConnectSandbox(_Body):
    timeout: Timeout = DEFAULT_TIMEOUT_S


class SandboxOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    envd_version: str = Field(alias="envdVersion")
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    domain: str | None = None


class SandboxDetail(SandboxOut):
    alias: str | None = None
    started_at: str = Field(alias="startedAt")
    end_at: str = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    state: str
    metadata: dict[str, str]


def control_routes(sandboxes: Sandboxes, admit: Admit) -> APIRouter:
    router = APIRouter(route_class=E2BRoute, tags=["e2b"], responses=ERRORS)

    async def caller(
        x_api_key: Annotated[str | None, Header()] = None,
    ) -> str:
        return await admit(x_api_key)

    tenant = Annotated[str, Depends(caller)]
    api_key = Annotated[str, Header(alias="X-API-KEY")]  # (checked by ``caller``)

    def sandbox(box: Sandbox, key: str) -> SandboxOut:
        return SandboxOut(
            template_id=box.trajectory.env, sandbox_id=box.id,
            client_id=box.trajectory.node or "", envd_version=ENVD_VERSION, envd_access_token=key,
        )  # fmt: skip

    def detail(box: Sandbox) -> SandboxDetail:
        rec = box.trajectory
        spec = rec.env_config.spec
        end = sandboxes.shown_end(box)
        return SandboxDetail(
            template_id=rec.env, sandbox_id=box.id, client_id=rec.node or "",
            envd_version=ENVD_VERSION, started_at=iso(rec.opened_at), end_at=iso(end),
            cpu_count=allowed_units(rec.env_config.cpu)[-1], memory_mb=round(spec.memory_gb * 1024),
            disk_size_mb=round((spec.disk_gb or 0) * 1024), state="running",
            metadata=box.metadata,
        )  # fmt: skip

    for path in ("/sandboxes", "/v2/sandboxes"):

        @router.post(path, status_code=201)
        async def create(req: NewSandbox, who: tenant, key: api_key) -> SandboxOut:
            """Open a trajectory of the TrajectoryEnv ``templateID`` as a sandbox; it is
            killed ``timeout`` seconds from now unless extended."""
            box = await sandboxes.create(who, req.template_id, req.timeout, req.metadata,
                                         req.env_vars)  # fmt: skip
            return sandbox(box, key)

    @router.get("/sandboxes")
    async def list_sandboxes(
        who: tenant,
        metadata: Annotated[str | None, Query(description=_METADATA)] = None,
    ) -> list[SandboxDetail]:
        """The caller's sandboxes (all running: those made through this API; its
        trajectories opened through /v1 are not listed, though each is a sandbox by its
        id), newest first, those whose metadata has every pair of ``metadata`` only."""
        return [detail(box) for box in _listed(sandboxes.mine(who), _pairs(metadata))]

    @router.get("/v2/sandboxes")
    async def list_sandboxes_v2(
        who: tenant,
        response: Response,
        *,
        metadata: Annotated[str | None, Query(description=_METADATA)] = None,
        state: Annotated[
            list[str] | None, Query(description="running, paused (comma separated or repeated)")
        ] = None,
        template: Annotated[str | None, Query(description="its TrajectoryEnv")] = None,
        started_after: Annotated[dt.datetime | None, Query(alias="startedAfter")] = None,
        order: Literal["asc", "desc"] = "desc",
        limit: Annotated[int, Query(ge=1, description=f"at most {PAGE} are given")] = PAGE,
        next_token: Annotated[str | None, Query(alias="nextToken")] = None,
    ) -> list[SandboxDetail]:
        """The caller's sandboxes (those made through this API, not its trajectories
        opened through /v1) that match every filter given, a page of ``limit`` at a time
        (newest first unless ``order=asc``); the ``X-Next-Token`` header, when more
        follow, is the next page's ``nextToken``. All are running: a query for paused
        ones only answers none."""
        wanted = {s.strip() for given in state or [] for s in given.split(",") if s.strip()}
        if unknown := wanted - set(STATES):
            raise E2BError(400, f"state: {sorted(unknown)} (known: {', '.join(STATES)})")
        boxes = _listed(sandboxes.mine(who), _pairs(metadata), order == "asc")
        if wanted and "running" not in wanted:
            boxes = []
        if template is not None:
            boxes = [box for box in boxes if box.trajectory.env == template]
        if started_after is not None:
            if started_after.tzinfo is None:  # (E2B's SDK sends one with its zone)
                started_after = started_after.astimezone()
            since = started_after.timestamp()
            boxes = [box for box in boxes if box.trajectory.opened_at >= since]
        if next_token is not None:
            after = _cursor(next_token, order)
            boxes = [box for box in boxes if _key(box, order == "asc") > after]
        page = boxes[: min(limit, PAGE)]
        if len(boxes) > len(page):
            response.headers["X-Next-Token"] = _token(page[-1], order)
        return [detail(box) for box in page]

    # Registered before /sandboxes/{sandbox_id}, which would take "metrics" for an id.
    no_metrics = _unserved_get("metrics", tenant, per_sandbox=False)
    router.get("/sandboxes/metrics", name="no_metrics_of_all", include_in_schema=False)(no_metrics)

    @router.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str, who: tenant) -> SandboxDetail:
        return detail(sandboxes.find(who, sandbox_id))

    @router.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(sandbox_id: str, who: tenant) -> Response:
        """Close the sandbox's trajectory: its commands are cancelled, its environment
        removed."""
        await sandboxes.kill(who, sandbox_id)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(sandbox_id: str, req: SetTimeout, who: tenant) -> Response:
        """Kill the sandbox ``timeout`` seconds from now (shorter or longer than before)."""
        sandboxes.set_timeout(sandboxes.find(who, sandbox_id), req.timeout)
        return Response(status_code=204)

    for path in ("/sandboxes/{sandbox_id}/connect", "/v2/sandboxes/{sandbox_id}/connect"):

        @router.post(path)
        async def connect(
            sandbox_id: str, req: ConnectSandbox, who: tenant, key: api_key
        ) -> SandboxOut:
            """A running sandbox, its timeout extended to ``timeout`` from now if that is
            later."""
            box = sandboxes.find(who, sandbox_id)
            sandboxes.set_timeout(box, req.timeout, extend_only=True)
            return sandbox(box, key)

    unserved = {
        "pause": "paused", "resume": "resumed", "fork": "forked", "snapshots": "snapshotted",
        "refreshes": "refreshed",
    }  # fmt: skip
    for what, done in unserved.items():
        router.post(f"/sandboxes/{{sandbox_id}}/{what}", name=f"not_{done}",
                    include_in_schema=False)(_not_served(done, tenant))  # fmt: skip
    for path, what in (("/sandboxes/{sandbox_id}/metrics", "metrics"),
                       ("/sandboxes/{sandbox_id}/logs", "logs"),
                       ("/v2/sandboxes/{sandbox_id}/logs", "logs")):  # fmt: skip
        router.get(path, name=f"no_{what}", include_in_schema=False)(_unserved_get(what, tenant))

    return router


def _unserved_get(what: str, tenant: Any, *, per_sandbox: bool = True) -> Callable[..., Any]:
    """Metrics and logs: 501 saying so. Not 404, which E2B's SDK reads as the sandbox gone
    ("Sandbox ... not found", SandboxNotFoundException) without showing this message."""
    instead = {"metrics": "the scheduler's /metrics exports its pools'",
               "logs": "a command's output comes with its result"}[what]  # fmt: skip
    message = f"sandbox {what} are not served by ARL-Tangram's E2B endpoint ({instead})"

    if per_sandbox:

        async def for_one(sandbox_id: str, who: tenant) -> Response:
            raise E2BError(501, message)

        return for_one

    async def for_all(who: tenant) -> Response:
        raise E2BError(501, message)

    return for_all


def _not_served(done: str, tenant: Any) -> Callable[..., Awaitable[Response]]:
    async def not_served(sandbox_id: str, who: tenant) -> Response:
        raise E2BError(501, f"sandboxes cannot be {done} by ARL-Tangram's E2B endpoint "
                       f"(sandbox {sandbox_id} is unchanged)")  # fmt: skip

    return not_served


_METADATA = (
    "key=value pairs joined by '&', each key and value percent-encoded and then "
    "the whole once more (as E2B's SDK sends them): every pair must match"
)


def _pairs(query: str | None) -> dict[str, str]:
    """The metadata pairs a list asks for, read as E2B's API reads them: the whole
    unescaped, split at '&' and '=', each key and value unescaped again."""
    if not query:
        return {}
    pairs = {}
    for pair in unquote_plus(query).split("&"):
        parts = pair.split("=")
        if len(parts) != 2:
            raise E2BError(400, f"metadata: {pair!r} is no key=value pair")
        pairs[unquote_plus(parts[0])] = unquote_plus(parts[1])
    return pairs


def _listed(boxes: list[Sandbox], pairs: dict[str, str], ascending: bool = False) -> list[Sandbox]:
    """The sandboxes whose metadata has every pair, in the list's order (by start, the
    newest first unless ``ascending``; then by id)."""
    chosen = [box for box in boxes if all(box.metadata.get(k) == v for k, v in pairs.items())]
    return sorted(chosen, key=lambda box: _key(box, ascending))


def _key(box: Sandbox, ascending: bool) -> tuple[float, str]:
    opened = box.trajectory.opened_at
    return (opened if ascending else -opened, box.id)


def _token(box: Sandbox, order: str) -> str:
    """The next page's token: where this page ended, in the order it was listed by."""
    text = f"{box.trajectory.opened_at!r}__{box.id}__{order}"
    return base64.urlsafe_b64encode(text.encode()).decode()


def _cursor(token: str, order: str) -> tuple[float, str]:
    try:
        opened, rest = base64.urlsafe_b64decode(token.encode()).decode().split("__", 1)
        sid, made_for = rest.rsplit("__", 1)  # (an id of /v1 may hold "__")
        at = float(opened)
    except ValueError:  # (binascii's and the decoding's errors too)
        raise E2BError(400, "nextToken: not a token this list gave") from None
    if made_for != order:
        raise E2BError(400, f"nextToken: given for order={made_for}, not {order}")
    return (at if order == "asc" else -at, sid)


def _invalid(message: str) -> PydanticCustomError:
    """A validator's refusal, its message as it is (a ValueError's gets "Value error, ")."""
    return PydanticCustomError("invalid", message)


def iso(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).isoformat().replace("+00:00", "Z")
