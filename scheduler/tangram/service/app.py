"""The HTTP API (``/v1``) and the agents' WebSocket endpoint: handlers only translate.

Errors are ``{"error": {"code", "message", "details"}}``: 400 for bad input (with the
offending fields), 401 without a valid token, 403 for a file path that would leave its
environment, 404 for what does not exist (or belongs to another tenant), 409 for
conflicts, 413 for oversized bodies, 429 with Retry-After when admission control sheds
load, 502 when a trajectory's environment cannot start as configured (its image is not on
the node), 503 while no node can take the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Header, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tangram.api.resent import RESENT_HEADER, resent_age
from tangram.api.wire import (
    AGENT_SUBPROTOCOL,
    AGENTS_PATH,
    STREAM_PATH,
    ActionResult,
    ActionStatus,
    ApiCallRequest,
    ApiLeaseRequest,
    BatchRequest,
    BatchResponse,
    ErrorBody,
    ErrorInfo,
    ExecRequest,
    IdempotencyKey,
    OpenTrajectory,
    ServiceCallRequest,
    TrajectoryInfo,
    json_bytes,
)
from tangram.service.answers import (
    RETRY_AFTER_S,
    RETRY_STATUS,
    UNAUTHORIZED,
    engine_error,
    error_body,
    invalid,
    payload,
)
from tangram.service.auth import AGENT_TENANT, OPERATOR_TENANT, TokenStore
from tangram.service.e2b import add_e2b_routes
from tangram.service.e2b.envd import is_upload as is_e2b_upload
from tangram.service.e2b.envd import too_large as e2b_too_large
from tangram.service.e2b.errors import E2BError, unrouted
from tangram.service.engine import Engine
from tangram.service.file_routes import add_file_routes, is_upload
from tangram.service.records import ActionRecord, EngineError
from tangram.service.reviews import NotAdmittedError, ReviewError, TokenReviewer
from tangram.service.stream import ActionStream

log = logging.getLogger("tangram.service")
# Reloads, applied or refused: shown at the default level (logs.LIFECYCLE), the operator's
# pushes as much as a SIGHUP's (which the CLI says itself).
reloads = logging.getLogger("tangram.service.reload")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 429, 502, 503)
}


def _error(
    status: int,
    code: str,
    message: str,
    details: list[dict[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(code, message, details), status_code=status, headers=headers)


def _refused(status: int, body: dict[str, Any]) -> JSONResponse:
    """An error answer with the headers its status takes."""
    headers = {}
    if status in RETRY_STATUS:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status, headers=headers or None)


def _engine_error(exc: EngineError) -> JSONResponse:
    return _refused(*engine_error(exc))


class BodyLimit:
    """Refuse request bodies over ``limit(scope)`` bytes (the pool's
    ``admission.maxRequestBytes``, or ``maxFileBytes`` for a file upload, as reloaded)
    with 413 before reading them whole."""

    def __init__(self, app: ASGIApp, limit: Callable[[Scope], int]) -> None:
        self.app, self.limit = app, limit

    @staticmethod
    def _refuse(scope: Scope, detail: str) -> ASGIApp:
        return e2b_too_large(scope, detail) or _error(413, "too_large", detail)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, _TooLargeError(limit).detail)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise _TooLargeError(limit)
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLargeError as e:  # (one no exception handler answered)
            await self._refuse(scope, e.detail)(scope, receive, send)


class _TooLargeError(HTTPException):
    """A body (chunked, so of no declared length) that grew over the limit as it was read.
    An HTTPException, which FastAPI lets through its body parsing (any other error there
    becomes a 400) to the handler that answers it with 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes")


# The operator's config push (``POST /v1/admin/reload``: the pool's ``pool.yaml``) is
# authenticated admin traffic, not a user's action: its own cap, not the pool's
# ``admission.maxRequestBytes``. The documents come from a ConfigMap, whose data the API
# server holds to 1 MiB, so any pool the operator can run fits.
RELOAD_MAX_BYTES = 4 * 1024 * 1024
RELOAD_PATH = "/v1/admin/reload"
_EXEC_PATH = re.compile(r"/v1/trajectories/([^/]+)/exec")
_JSON = [(b"content-type", b"application/json")]


class _Service(FastAPI):
    """FastAPI with its two hot paths taken before the middleware stack, which under load
    cost more than the scheduling itself (docs/benchmarks.md): a plain exec of a known
    tenant, and the agents' WebSocket (every dispatch is a send on it). Anything else about
    an exec (a bad body, an unknown token, an error from the engine, an Idempotency-Key
    header) is answered as the canonical route answers it (a bad body by that route, its
    body replayed)."""

    hot: tuple[Engine, TokenStore, TokenReviewer | None] | None = None
    agents_ws: Callable[[WebSocket], Awaitable[None]] | None = None
    stream_ws: Callable[[WebSocket], Awaitable[None]] | None = None
    streams: set[ActionStream]  # open action streams, drained when the service stops
    stream_count: Counter[str]  # streams open or opening, by tenant (maxStreams)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" and scope["method"] == "POST" and self.hot is not None:
            match = _EXEC_PATH.fullmatch(scope["path"])
            if match is not None:
                await self._exec(match.group(1), scope, receive, send)
                return
        elif kind == "websocket" and scope["path"] == AGENTS_PATH and self.agents_ws:
            await self.agents_ws(WebSocket(scope, receive, send))
            return
        elif kind == "websocket" and scope["path"] == STREAM_PATH and self.stream_ws:
            await self.stream_ws(WebSocket(scope, receive, send))
            return
        elif kind == "websocket" and scope["path"] not in (AGENTS_PATH, STREAM_PATH):
            # Starlette refuses a WebSocket no route takes with a bare 403, which reads as a
            # wrong token: say 404, and which paths take one.
            message = (
                f"no WebSocket endpoint at {scope['path']}: node agents connect to "
                f"{AGENTS_PATH}, action streams to {STREAM_PATH}"
            )
            log.warning("WebSocket refused (404): %s", message)
            await WebSocket(scope, receive, send).send_denial_response(
                _error(404, "not_found", message)
            )
            return
        await super().__call__(scope, receive, send)

    async def _exec(self, tid: str, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.hot is not None
        engine, tokens, reviewer = self.hot
        limit = engine.config.max_request_bytes
        length = auth = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"authorization" and auth is None:  # the first, as Starlette's
                auth = value.decode("latin-1")
            elif name in (b"idempotency-key", b"transfer-encoding"):
                length = None  # checked, or limited while it streams, the canonical way
                break
        who = None
        if length is not None and length.isdigit() and int(length) <= limit:
            try:
                who = await _who(tokens, reviewer, engine, auth)
            except NotAdmittedError:
                pass  # the canonical route says why (403), from the cached review
            except (ReviewError, OSError) as e:  # answered here: not asked twice
                await _engine_error(_unchecked(e))(scope, receive, send)
                return
        if who is None or who in (AGENT_TENANT, OPERATOR_TENANT):
            await super().__call__(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            rec = engine.submit_exec(who, tid, ExecRequest.model_validate_json(body))
        except ValidationError:  # nothing was admitted: the canonical route names the field
            await super().__call__(scope, _replay(body, receive), send)
            return
        except EngineError as e:  # answered here: submitting again would count it twice
            await _engine_error(e)(scope, receive, send)
            return
        answer = await _result(rec, engine, receive)
        headers = [*_JSON, (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given again first."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def create_app(
    engine: Engine,
    tokens: TokenStore,
    *,
    reviewer: TokenReviewer | None = None,
) -> _Service:
    """``reviewer``: in a cluster, clients' ServiceAccount tokens are checked with
    TokenReview and admitted by the pool's access list; the token file then holds only the
    agents' and the operator's tokens."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        sandboxes.start()
        yield
        await sandboxes.stop()
        await engine.stop()

    app = _Service(
        title="ARL-Tangram scheduler",
        version="v1",
        description="Submit actions of agentic RL rollouts; the scheduler pools the resources.",
        lifespan=lifespan,
    )

    def limit(scope: Scope) -> int:
        config = engine.config
        if scope.get("path") == RELOAD_PATH:  # (read only once the token is the operator's)
            return RELOAD_MAX_BYTES
        upload = is_upload(scope) or is_e2b_upload(scope)
        return config.max_file_bytes if upload else config.max_request_bytes

    app.add_middleware(BodyLimit, limit=limit)
    app.state.tokens = tokens
    app.state.reviewer = reviewer
    app.state.engine = engine
    app.openapi = lambda: _schema(app, [ExecRequest])  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if (wrong := _not_json(request, exc)) is not None:
            return _error(415, "unsupported_media_type", wrong)
        return JSONResponse(invalid(exc.errors(), skip=1), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The framework's own answers (unknown route, wrong method, unreadable body) in
        # the same error shape as ours.
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            exc.status_code, "invalid"
        )
        details = [{"field": "body", "message": str(exc.detail)}] if exc.status_code == 400 else []
        headers = dict(exc.headers) if exc.headers else None
        allow = None
        if exc.status_code == 405:  # every method of the path, not just its first route's
            # (the E2B routers' routes too: FastAPI lists an included router as one entry)
            allow = ", ".join(_methods([*app.router.routes, *e2b_routes], request.scope))
            headers = {**(headers or {}), "Allow": allow}
        if exc.status_code in (404, 405):  # (E2B's SDKs read only E2B's shape)
            e2b = unrouted(request.method, request.url.path, request.headers, exc.status_code,
                           allow)  # fmt: skip
            if e2b is not None:
                return e2b
        return _error(exc.status_code, code, str(exc.detail), details, headers)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        return _engine_error(exc)

    @app.exception_handler(NotAdmittedError)
    async def _forbidden(_: Request, exc: NotAdmittedError) -> JSONResponse:
        return _error(403, "forbidden", str(exc))

    @app.exception_handler(_UnauthorizedError)
    async def _unauth(_: Request, __: _UnauthorizedError) -> JSONResponse:
        return _refused(*UNAUTHORIZED)

    @app.post("/v1/trajectories", status_code=201, responses=_ERRORS)
    async def open_trajectory(req: OpenTrajectory, who: TenantId) -> TrajectoryInfo:
        return (await engine.open_trajectory(who, req)).info()

    @app.get("/v1/trajectories/{trajectory}", responses=_ERRORS)
    async def get_trajectory(trajectory: str, who: TenantId) -> TrajectoryInfo:
        return engine.trajectory(who, trajectory).info()

    # Before the route by id, which would take "key:k" as one (an id holds no ':'); :path:
    # a key may hold '/' (sent as %2F, which the path arrives decoded from).
    @app.delete("/v1/trajectories/key:{key:path}", responses=_ERRORS)
    async def close_opened(key: str, who: TenantId) -> TrajectoryInfo:
        return await engine.close_opened(who, key)

    @app.delete("/v1/trajectories/{trajectory}", responses=_ERRORS)
    async def close_trajectory(trajectory: str, who: TenantId) -> TrajectoryInfo:
        return (await engine.close_trajectory(who, trajectory)).info()

    # The hot path validates its own body and writes its own answer: FastAPI's parameter
    # machinery cost more than the whole scheduling decision (docs/benchmarks.md).
    @app.post(
        "/v1/trajectories/{trajectory}/exec",
        response_model=ActionResult,
        responses=_ERRORS,
        openapi_extra=_body(ExecRequest, "Idempotency-Key"),
    )
    async def exec_action(trajectory: str, request: Request) -> Response:
        who = await _tenant(request, request.headers.get("authorization"))
        req = _parse(ExecRequest, await request.body())
        key = request.headers.get("idempotency-key")
        if key:  # the header's key, checked as the field is
            req = _with_header_key(req, _header_key(key))
        return await _answer(engine.submit_exec(who, trajectory, req), engine, request.receive)

    @app.post("/v1/trajectories/{trajectory}/cancel", responses=_ERRORS)
    async def cancel_trajectory(trajectory: str, who: TenantId) -> dict[str, int]:
        return {"cancelled": engine.cancel_trajectory(who, trajectory)}

    @app.post("/v1/batch", response_model=BatchResponse, responses=_ERRORS,
              openapi_extra=_resent_header())  # fmt: skip
    async def batch(req: BatchRequest, who: TenantId, request: Request) -> Response:
        resent_s = _resent_s(request)
        unsure = {} if resent_s is None else {
            i: why for i, item in enumerate(req.actions)
            if item.call is not None and (why := engine.api.unsure(who, item.call, resent_s))
        }  # fmt: skip
        kept = [i for i in range(len(req.actions)) if i not in unsure]  # (refusals name these)
        recs = engine.submit_batch(who, [req.actions[i] for i in kept], kept)
        results = await _ended(recs, engine, request.receive)
        made = iter(payload(r, res) for r, res in zip(recs, results, strict=True))
        parts = b",".join(
            json_bytes(_not_made(unsure[i], req.actions[i].call)) if i in unsure else next(made)
            for i in range(len(req.actions))
        )
        return Response(b'{"results":[' + parts + b"]}", media_type="application/json")

    # :path: a key may hold '/' (sent as %2F, which the path arrives decoded from)
    @app.delete("/v1/actions/{action:path}", responses=_ERRORS)
    async def cancel_action(action: str, who: TenantId) -> dict[str, bool]:
        if action.startswith("key:"):
            rec = engine.state.idempotent.get(who, action[4:])
            action = rec.id if rec is not None else ""
        return {"cancelled": engine.cancel(who, action)}

    @app.post("/v1/apis/{api}/lease", response_model=ActionResult, responses=_ERRORS)
    async def lease(api: str, req: ApiLeaseRequest, who: TenantId, request: Request) -> Response:
        return await _answer(engine.lease_api(who, api, req), engine, request.receive)

    @app.post("/v1/apis/{api}/call", response_model=ActionResult, responses=_ERRORS,
              openapi_extra=_resent_header())  # fmt: skip
    async def call_api(api: str, req: ApiCallRequest, who: TenantId, request: Request) -> Response:
        resent_s = _resent_s(request)
        unsure = None if resent_s is None else engine.api.unsure(who, req, resent_s)
        if unsure is not None:
            return Response(json_bytes(_not_made(unsure, req)), media_type="application/json")
        return await _answer(engine.lease_api(who, api, req), engine, request.receive)

    @app.post("/v1/services/{service}/call", response_model=ActionResult, responses=_ERRORS)
    async def call_service(
        service: str, req: ServiceCallRequest, who: TenantId, request: Request
    ) -> Response:
        return await _answer(engine.submit_service(who, service, req), engine, request.receive)

    add_file_routes(app, engine, TenantId, _ERRORS)

    async def e2b_admit(token: str | None) -> str:
        """An E2B API key (or envd access token): a tenant token of this service."""
        try:
            return await _client(tokens, reviewer, engine, f"Bearer {token}" if token else None)
        except NotAdmittedError as e:
            raise E2BError(403, str(e)) from None
        except _UnauthorizedError:
            raise E2BError(401, "a valid API key is required: a tenant token of this service "
                           "(E2B_API_KEY)") from None  # fmt: skip

    sandboxes, e2b_routes = add_e2b_routes(app, engine, e2b_admit)

    @app.get("/e2b/openapi.json", include_in_schema=False)
    async def e2b_openapi() -> JSONResponse:
        """The E2B-compatible endpoint's routes (its Connect RPCs are in docs/service.md)."""
        return JSONResponse(_e2b_schema(e2b_routes))

    @app.delete("/v1/leases/{lease}", responses=_ERRORS)
    async def release(lease: str, who: TenantId) -> ActionResult:
        return engine.release(who, lease)

    def operator(request: Request) -> None:
        who = _bearer(tokens, request.headers.get("authorization"))
        if who is None:
            raise _UnauthorizedError
        if who != OPERATOR_TENANT:  # (a valid token, of another role: 403, not 401)
            raise NotAdmittedError(
                f"the /v1/admin routes take the operator's token ({OPERATOR_TENANT}), not "
                f"the token of {who}"
            )

    @app.post(RELOAD_PATH, include_in_schema=False)
    async def reload(request: Request) -> JSONResponse:
        """Apply new definitions: the pool's documents as a YAML body (the operator pushes
        its ConfigMap's ``pool.yaml``), or with no body re-read the files. The answer
        names what changed; all of it applies at once."""
        operator(request)
        if engine.reloader is None:
            return _error(409, "conflict", "this scheduler has no files to reload")
        text = (await request.body()).decode("utf-8", "replace") or None
        read = "body" if text is not None else "files"
        try:
            changes = await engine.reload(text)
        except ValueError as e:  # the definitions are wrong: keep running as before
            # One detail a problem (a line each), under what was read: the body, the files.
            reasons = [p for p in str(e).splitlines() if p]
            reloads.warning("reload refused: %s", e, extra={"via": RELOAD_PATH, "read": read,
                                                            "reasons": reasons})  # fmt: skip
            problems = [{"field": read, "message": p} for p in reasons]
            return _error(400, "invalid", f"reload refused: {e}", problems)
        reloads.info("reloaded: %s", "; ".join(changes) or "no changes",
                     extra={"via": RELOAD_PATH, "read": read, "changes": changes})  # fmt: skip
        return JSONResponse({"changes": changes})

    @app.get("/v1/admin/status", include_in_schema=False)
    async def status(request: Request) -> Response:
        operator(request)
        return _json(engine.figures())

    @app.post("/v1/admin/drain", include_in_schema=False)
    async def drain(request: Request) -> Response:
        """Refuse new trajectories (the ActionPool is being deleted); open ones go on until
        their owners close them or the operator's drain timeout passes. ``?end=true``: it
        passed; every action ends now, saying so, before the pool's objects go."""
        operator(request)
        if not engine.state.draining:
            engine.state.draining = True
            log.info("draining: no new trajectories")
        if request.query_params.get("end") == "true":
            await engine.end_drain()
        return _json(engine.figures())

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(engine.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> PlainTextResponse:
        if engine.ready:
            return PlainTextResponse("ready")
        if not engine.state.accepting:
            why = "stopping"
        elif engine.hub.links:
            why = "no agent connected takes new work: they are stopping"
        else:
            why = "no agent connected"
        return PlainTextResponse(why, 503)

    @app.websocket(AGENTS_PATH)
    async def agents(ws: WebSocket) -> None:
        refusal = _agent_refusal(_bearer(tokens, ws.headers.get("authorization")))
        if refusal is not None:
            # Refused with its status and the usual error body, before the accept (a close
            # there was a bare 403 the agent could not tell from any other), and logged:
            # a refused agent knocks every 30 s, and its operator looks here first.
            status, body = refusal
            peer = f"{ws.client.host}:{ws.client.port}" if ws.client else "an unknown peer"
            log.warning("agent link from %s refused (%d): %s", peer, status,
                        body["error"]["message"])  # fmt: skip
            await ws.send_denial_response(_refused(status, body))
            return
        packed = AGENT_SUBPROTOCOL in ws.scope.get("subprotocols", ())
        await ws.accept(subprotocol=AGENT_SUBPROTOCOL if packed else None)
        with contextlib.suppress(WebSocketDisconnect):
            await engine.hub.serve(ws, packed=packed)

    @app.websocket(STREAM_PATH)
    async def stream(ws: WebSocket) -> None:
        """Execs multiplexed on one WebSocket (``tangram.service.stream``)."""
        auth = ws.headers.get("authorization")

        async def admit() -> str | tuple[int, dict[str, Any]]:
            """As for a request: the token's tenant, or the status and body refusing it."""
            try:
                return await _client(tokens, reviewer, engine, auth)
            except NotAdmittedError as e:
                return 403, error_body("forbidden", str(e))
            except EngineError as e:
                return engine_error(e)
            except _UnauthorizedError:
                return UNAUTHORIZED

        tenant = await admit()
        if not isinstance(tenant, str):
            await ws.send_denial_response(_refused(*tenant))
            return
        if AGENT_SUBPROTOCOL not in ws.scope.get("subprotocols", ()):
            message = f"offer the subprotocol {AGENT_SUBPROTOCOL}: answers come a line each"
            await ws.send_denial_response(_error(400, "invalid", message))
            return
        first = tenant
        limit = engine.state.config.limits(first).max_streams
        if limit is not None and app.stream_count[first] >= limit:
            message = (
                f"tenant {first} has {limit} action streams open, its limit "
                "(spec.access.tenants[].maxStreams): close one, or submit over HTTP"
            )
            await ws.send_denial_response(_engine_error(engine.state.overloaded("stream", message)))
            return
        app.stream_count[first] += 1  # (counted before the accept's await: no race past it)

        async def refusal() -> tuple[int, dict[str, Any]] | None:
            now = await admit()
            if isinstance(now, str):
                return None if now == first else UNAUTHORIZED
            return now

        try:
            await ws.accept(subprotocol=AGENT_SUBPROTOCOL)
            link = ActionStream(engine, first, ws, refusal=refusal)
            app.streams.add(link)
            try:
                await link.serve()
            finally:
                app.streams.discard(link)
        finally:
            app.stream_count[first] -= 1
            if not app.stream_count[first]:
                del app.stream_count[first]

    app.hot = (engine, tokens, reviewer)
    app.agents_ws = agents
    app.stream_ws = stream
    app.streams = set()
    app.stream_count = Counter()
    return app


class _UnauthorizedError(Exception):
    pass


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], body: bytes) -> M:
    """Validate a JSON body; errors become the same 400 as FastAPI's own validation."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        ) from None


_KEY = TypeAdapter(IdempotencyKey)


def _header_key(key: str) -> str:
    try:
        return _KEY.validate_python(key)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("header", "Idempotency-Key")} for err in e.errors(include_url=False)]
        ) from None


def _not_json(request: Request, exc: RequestValidationError) -> str | None:
    """Why a body was not read, when the reason is its content type: the framework reads a
    body as JSON only when it says it is, and ``curl -d`` says it is a form. The answer
    was "body: Input should be a valid dictionary", which points nowhere near the header."""
    given = request.headers.get("content-type")
    if given is None or given.split(";")[0].strip().lower() in ("application/json", ""):
        return None
    if not any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
        return None
    return f"the body is read as JSON, sent with Content-Type: application/json (not {given!r})"


def _with_header_key(req: ExecRequest, key: str) -> ExecRequest:
    """The request under the header's key; one the body names otherwise is refused (which
    key a retry must repeat would be a guess)."""
    if req.idempotency_key is None:
        return req.model_copy(update={"idempotency_key": key})
    if req.idempotency_key != key:
        raise RequestValidationError([{
            "type": "value_error", "loc": ("header", "Idempotency-Key"),
            "msg": f"{key!r} is not the body's idempotency_key {req.idempotency_key!r}",
            "input": key,
        }])  # fmt: skip
    return req


def _json(model: BaseModel) -> Response:
    return Response(json_bytes(model), media_type="application/json")


def _resent_s(request: Request) -> float | None:
    """How long ago the earlier try of this request went out (``tangram.api.resent``), if
    the client says it sends it again."""
    value = request.headers.get(RESENT_HEADER)
    if value is None:
        return None
    try:
        return resent_age(value)
    except ValueError as e:
        raise EngineError("invalid", f"header {RESENT_HEADER}", str(e)) from None


def _resent_header() -> dict[str, Any]:
    """OpenAPI for the ``Tangram-Resent`` header a route reads."""
    why = "seconds since an earlier try of this request went out whose answer was lost"
    return {"parameters": [_header_param(RESENT_HEADER, 40, why)]}


def _header_param(name: str, max_length: int, description: str | None = None) -> dict[str, Any]:
    """OpenAPI for an optional request header a route reads."""
    param: dict[str, Any] = {"name": name, "in": "header", "required": False}
    if description:
        param["description"] = description
    param["schema"] = {"type": "string", "maxLength": max_length}
    return param


def _not_made(why: ErrorInfo, call: ApiCallRequest | None) -> ActionResult:
    """The answer to a proxied call not made again (``ApiCalls.unsure``), with its key."""
    key = call.idempotency_key if call is not None else None
    return ActionResult(
        id="", kind="api", status=ActionStatus.ERROR, error=why, idempotency_key=key
    )


async def _answer(rec: ActionRecord, engine: Engine, receive: Receive) -> Response:
    """The action's result once it ends, as JSON."""
    return Response(await _result(rec, engine, receive), media_type="application/json")


async def _result(rec: ActionRecord, engine: Engine, receive: Receive) -> bytes:
    """The action's result once it ends, as JSON (``_ended``)."""
    (result,) = await _ended([rec], engine, receive)
    return payload(rec, result)


async def _ended(
    recs: Sequence[ActionRecord], engine: Engine, receive: Receive
) -> list[ActionResult]:
    """The actions' results once all have ended. An unkeyed action whose client leaves
    before (``receive`` says the connection closed) could never be collected: it is
    cancelled if still queued, and a lease granted it is released (held, nobody could
    release it: its quota would be blocked for its whole hold). A keyed one goes on for
    the retry that collects it by its key."""
    every = asyncio.gather(*(asyncio.shield(r.done) for r in recs))
    unkeyed = {r.id: r for r in recs if r.request is not None and r.request.idempotency_key is None}
    if not unkeyed or all(r.done.done() for r in recs):
        return await every
    gone = asyncio.ensure_future(_closed(receive))
    waits: set[asyncio.Future[Any]] = {every, gone}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if gone.done() and not gone.cancelled():
        for rec in unkeyed.values():
            if not rec.done.done() and rec.started is None:
                engine.cancel(rec.tenant, rec.id)
            # each as it ends: a batch's lease is not held until its slowest item ends
            rec.done.add_done_callback(functools.partial(_release_lease, engine, rec))
    return await every


def _release_lease(engine: Engine, rec: ActionRecord, done: asyncio.Future[ActionResult]) -> None:
    """Release the lease granted to an action whose client left (``_ended``)."""
    if done.cancelled() or done.exception() is not None:
        return
    lease = done.result().lease
    if lease is not None:
        with contextlib.suppress(EngineError):  # (its hold ran out meanwhile)
            engine.release(rec.tenant, lease)


async def _closed(receive: Receive) -> None:
    """Returns once the client closed the connection (its body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _body(model: type[BaseModel], header: str | None = None) -> dict[str, Any]:
    """OpenAPI for a route that reads its body itself (the schema is added in ``_schema``)."""
    extra: dict[str, Any] = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        },
        "x-tangram-body": model.__name__,
    }
    if header:
        extra["parameters"] = [_header_param(header, 200)]
    return extra


def _schema(app: FastAPI, models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """The OpenAPI document, with the schemas of self-validated request bodies."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    _, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path in doc.get("paths", {}).values():
        for op in path.values():
            op.pop("x-tangram-body", None)
            op.get("responses", {}).pop("422", None)  # bad input is a 400 here, never 422
            params = [p for p in op.get("parameters", []) if p.get("name") != "authorization"]
            if params:
                op["parameters"] = params
            else:
                op.pop("parameters", None)
            op["security"] = [{"bearer": []}]
    app.openapi_schema = doc
    return doc


def _e2b_schema(routes: Sequence[BaseRoute]) -> dict[str, Any]:
    doc = get_openapi(
        title="ARL-Tangram's E2B-compatible endpoint", version="v1",
        description="E2B's control-plane API and envd's HTTP routes, served for trajectories.",
        routes=routes,
    )  # fmt: skip
    doc.setdefault("components", {})["securitySchemes"] = {
        "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-KEY"},
        "accessToken": {"type": "apiKey", "in": "header", "name": "X-Access-Token"},
    }
    for path, item in doc.get("paths", {}).items():
        for op in item.values():
            op.get("responses", {}).pop("422", None)  # bad input is a 400 here too
            envd = path in ("/files", "/health")
            op["security"] = [{"accessToken": []}] if envd else [{"apiKey": []}]
    return doc


async def _tenant(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    # async: a sync dependency would cost a thread-pool hop on every request
    """The caller's tenant from its bearer token; agents' tokens do not submit."""
    state = request.app.state
    return await _client(state.tokens, state.reviewer, state.engine, authorization)


async def _client(
    tokens: TokenStore, reviewer: TokenReviewer | None, engine: Engine, authorization: str | None
) -> str:
    """The tenant of a client's token. Raises _UnauthorizedError for no valid token,
    NotAdmittedError for an agent's or the operator's (they do not submit) and for a
    ServiceAccount the pool's access list does not admit, EngineError when the token
    cannot be checked."""
    try:
        who = await _who(tokens, reviewer, engine, authorization)
    except (ReviewError, OSError) as e:
        raise _unchecked(e) from None
    if who is None:
        raise _UnauthorizedError
    if who in (AGENT_TENANT, OPERATOR_TENANT):  # (valid, of another role: 403, not 401)
        use = "node agents' link" if who == AGENT_TENANT else "/v1/admin routes"
        raise NotAdmittedError(f"the token of {who} is for the {use}, not for submitting")
    return who


def _agent_refusal(who: str | None) -> tuple[int, dict[str, Any]] | None:
    """Why the agents' link refuses a token's holder (None: an agent's, taken), as the
    routes refuse: 401 for no valid token, 403 naming whose token it is. Never the token."""
    if who is None:
        return 401, error_body(
            "unauthorized",
            "a valid bearer token is required: the agent's --token-file holds no token this "
            f"scheduler knows (a {AGENT_TENANT} line of the pool's token file or Secret)",
        )
    if who != AGENT_TENANT:
        return 403, error_body(
            "forbidden",
            f"the token of {who} is not a node agent's: the agents' link takes the "
            f"{AGENT_TENANT} token",
        )
    return None


def _unchecked(e: Exception) -> EngineError:
    return EngineError("unavailable", "authorization", f"cannot check token: {e}")


async def _who(
    tokens: TokenStore, reviewer: TokenReviewer | None, engine: Engine, authorization: str | None
) -> str | None:
    """The token file's tenant, else (in a cluster) the reviewed ServiceAccount; None for
    no valid token. Raises what the review raises (NotAdmittedError, ReviewError)."""
    token = _token(authorization)
    if token is None:
        return None
    who = tokens.tenant(token)
    if who is None and reviewer is not None:
        who = await reviewer.tenant(token, engine.config)
    return who


TenantId = Annotated[str, Depends(_tenant)]


def _token(header: str | None) -> str | None:
    if not header or not header.lower().startswith("bearer "):
        return None
    return header[7:].strip() or None


def _bearer(tokens: TokenStore, header: str | None) -> str | None:
    token = _token(header)
    return tokens.tenant(token) if token is not None else None


def _methods(routes: Iterable[BaseRoute], scope: Scope) -> list[str]:
    """The methods the routes matching ``scope``'s path take, for a 405's Allow header
    (each method of a path is its own route)."""
    found: set[str] = set()
    for route in routes:
        if isinstance(route, APIRoute) and route.path_regex.match(scope["path"]):
            found.update(route.methods or ())
    return sorted(found)
