"""E2B's error answers, and the route class that gives every E2B route them.

E2B's API and envd answer errors as ``{"code": <HTTP status>, "message": ...}`` (its SDK
reads ``message``); the service's own shape would lose the message in the SDK's errors.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from tangram.service.answers import RETRY_AFTER_S, RETRY_STATUS, STATUS, invalid
from tangram.service.files import NoSpaceError
from tangram.service.records import EngineError


class E2BError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class E2BErrorBody(BaseModel):
    code: int = Field(description="the HTTP status")
    message: str


def answer(status: int, message: str) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in RETRY_STATUS else None
    return JSONResponse({"code": status, "message": message}, status, headers=headers)


def from_engine(e: EngineError) -> JSONResponse:
    """The engine's error in E2B's shape; a full disk is envd's 507 (the SDK's
    ``NotEnoughSpaceException``)."""
    return answer(e.status if isinstance(e, NoSpaceError) else STATUS[e.kind], str(e))


ENVD_PORT = "49983"  # the port E2B's SDK names (E2b-Sandbox-Port) for envd
CODE_INTERPRETER_PORT = "49999"  # the port of e2b_code_interpreter's Jupyter server
# The paths of E2B's API and of envd as E2B's SDKs call them: any answer under them, of a
# route not served too, is in E2B's shape (its SDK fails on another: KeyError 'code').
E2B_PATHS = (
    "/sandboxes", "/v2/sandboxes", "/templates", "/v2/templates", "/v3/templates",
    "/default-templates", "/snapshots", "/volumes", "/secrets", "/files", "/health", "/envs",
    "/init", "/process.Process", "/filesystem.Filesystem",
)  # fmt: skip
NOT_SERVED = "is not served by ARL-Tangram's E2B endpoint"


def is_e2b_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in E2B_PATHS)


def port_problem(headers: Mapping[str, str]) -> str | None:
    """Why a request for a sandbox's port other than envd's (E2B's proxy routes by the
    header) is refused: none is served, the code interpreter's included. Answered 501,
    whose body E2B's SDK and the code interpreter both show (a 404 the code interpreter
    showed as a bare Not Found; a 502 it reads as the sandbox's timeout)."""
    port = headers.get("e2b-sandbox-port")
    if port is None or port == ENVD_PORT:
        return None
    if port == CODE_INTERPRETER_PORT:
        what = f"the code interpreter (port {port}: e2b_code_interpreter's run_code, contexts)"
        return f"{what} {NOT_SERVED}: run code with commands.run"
    return f"port {port!r} of a sandbox {NOT_SERVED}: only envd's ({ENVD_PORT}) is"


def unrouted(
    method: str, path: str, headers: Mapping[str, str], status: int, allow: str | None = None
) -> JSONResponse | None:
    """The framework's answer for no route (404) or no such method (405) in E2B's shape,
    for a path of E2B's or a sandbox's port; None for any other path."""
    if (problem := port_problem(headers)) is not None:
        return answer(501, problem)
    if not is_e2b_path(path):
        return None
    if status == 405:
        refused = answer(405, f"{method} {path} {NOT_SERVED} (it serves {allow})")
        refused.headers["Allow"] = allow or ""
        return refused
    return answer(status, f"{method} {path} {NOT_SERVED} (docs/service.md says what is)")


class E2BRoute(APIRoute):
    """A route whose every refusal is in E2B's shape: bad input (400, naming the field),
    the engine's errors (their status) and ``E2BError``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:  # (its locations start at query, body...)
                return answer(400, invalid(e.errors(), skip=1)["error"]["message"])
            except EngineError as e:
                return from_engine(e)
            except E2BError as e:
                return answer(e.status, e.message)
            except HTTPException as e:  # the framework's (a body grown over its limit: 413)
                return answer(e.status_code, str(e.detail))

        return handle


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": E2BErrorBody}
    for code in (400, 401, 403, 404, 409, 413, 429, 502, 503, NoSpaceError.status)
}
