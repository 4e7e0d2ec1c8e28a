"""E2B's error answers, and the route class that gives every E2B route them.

E2B's API and envd answer errors as ``{"code": <HTTP status>, "message": ...}`` (its SDK
reads ``message``); the service's own shape would lose the message in the SDK's errors.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
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
