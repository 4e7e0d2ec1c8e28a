"""How the service answers, whatever carried the question (an HTTP request, a message on
the action stream): the status of each engine error, the error body, a result's JSON."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tangram.api.field_errors import error_message, field_path
from tangram.api.wire import ActionResult, json_bytes
from tangram.service.records import ActionRecord, EngineError

STATUS = {"invalid": 400, "not_found": 404, "conflict": 409, "overloaded": 429,
          "unavailable": 503, "failed": 502, "forbidden": 403, "too_large": 413}  # fmt: skip
RETRY_STATUS = (429, 503)  # answered with Retry-After: RETRY_AFTER_S
RETRY_AFTER_S = 1


def error_body(
    code: str, message: str, details: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details or []}}


UNAUTHORIZED = 401, error_body("unauthorized", "a valid bearer token is required")


def engine_error(exc: EngineError) -> tuple[int, dict[str, Any]]:
    details = [{"field": exc.field, "message": exc.message}]
    return STATUS[exc.kind], error_body(exc.kind, str(exc), details)


# A check across a model's fields says which one it found wrong first ("argv: ...").
_NAMED = re.compile(r"Value error, ([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*): (.+)", re.S)


def _detail(error: Any, skip: int) -> dict[str, str]:
    """One error as ``{"field", "message"}``: a whole body's names the field its message
    starts with (it was "body" for NUL bytes in ``argv``, a bad ``env``)."""
    loc = error["loc"][skip:]
    if not loc and (named := _NAMED.fullmatch(error["msg"])) is not None:
        return {"field": named[1], "message": named[2]}
    return {"field": field_path(loc or error["loc"]), "message": error_message(error)}


def invalid(errors: Sequence[Any], skip: int) -> dict[str, Any]:
    """The 400 body for pydantic's ``errors``, fields named from the body's root (the
    first ``skip`` parts of each location say where the body was)."""
    details = [_detail(e, skip) for e in errors]
    first = details[0] if details else {"field": "body", "message": "invalid"}
    return error_body("invalid", f"{first['field']}: {first['message']}", details)


def payload(rec: ActionRecord, result: ActionResult) -> bytes:
    """A result's JSON: the bytes the engine kept for its key if any (a keyed action is
    serialized once)."""
    return rec.answer or json_bytes(result)
