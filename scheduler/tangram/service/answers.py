"""How the service answers, whatever carried the question (an HTTP request, a message on
the action stream): the status of each engine error, the error body, a result's JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tangram.api.field_errors import field_path
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


def invalid(errors: Sequence[Any], skip: int) -> dict[str, Any]:
    """The 400 body for pydantic's ``errors``, fields named from the body's root (the
    first ``skip`` parts of each location say where the body was)."""
    details = [
        {"field": field_path(e["loc"][skip:] or e["loc"]), "message": e["msg"]} for e in errors
    ]
    first = details[0] if details else {"field": "body", "message": "invalid"}
    return error_body("invalid", f"{first['field']}: {first['message']}", details)


def payload(rec: ActionRecord, result: ActionResult) -> bytes:
    """A result's JSON: the bytes the engine kept for its key if any (a keyed action is
    serialized once)."""
    return rec.answer or json_bytes(result)
