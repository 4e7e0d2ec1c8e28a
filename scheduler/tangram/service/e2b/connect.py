"""The Connect protocol (connectrpc.com) as E2B's envd clients speak it: JSON messages,
unary calls as plain JSON bodies, server streams as enveloped messages.

An envelope is one flag byte, a 4-byte big-endian length and the message. The last
envelope of a stream has the ``END_STREAM`` flag and holds ``{}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import json
from typing import Any

END_STREAM = 0x02
COMPRESSED = 0x01
STREAM_TYPE = "application/connect+json"
MAX_MESSAGE = 16 << 20  # a request message larger than this is refused

# Connect's codes and the HTTP status each is answered with in a unary call.
CODE_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

# The service's error kinds (``EngineError.kind``) as Connect codes.
KIND_CODE = {
    "invalid": "invalid_argument",
    "not_found": "not_found",
    "conflict": "already_exists",
    "overloaded": "resource_exhausted",
    "unavailable": "unavailable",
    "failed": "failed_precondition",
    "forbidden": "permission_denied",
    "too_large": "resource_exhausted",
}


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        assert code in CODE_STATUS, code
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def envelope(message: dict[str, Any], *, end: bool = False) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return bytes([END_STREAM if end else 0]) + len(data).to_bytes(4, "big") + data


def end_of_stream(error: ConnectError | None = None) -> bytes:
    return envelope({"error": error.body()} if error is not None else {}, end=True)


def first_message(body: bytes) -> dict[str, Any]:
    """The one message of a server-streaming call's request body."""
    if len(body) < 5:
        raise ConnectError("invalid_argument", "the request holds no enveloped message")
    flags, size = body[0], int.from_bytes(body[1:5], "big")
    if flags & COMPRESSED:
        raise ConnectError("unimplemented", "compressed messages are not accepted")
    if size > MAX_MESSAGE or len(body) < 5 + size:
        raise ConnectError("invalid_argument", "the enveloped message is cut short or too large")
    return message(body[5 : 5 + size])


def message(data: bytes) -> dict[str, Any]:
    try:
        got = json.loads(data or b"{}")
    except ValueError as e:
        raise ConnectError("invalid_argument", f"the message is not JSON: {e}") from None
    if not isinstance(got, dict):
        raise ConnectError("invalid_argument", "the message is not a JSON object")
    return got


def timeout_s(header: str | None) -> float | None:
    """``Connect-Timeout-Ms``: the caller's deadline for the whole call, in seconds."""
    if header is None:
        return None
    if not (header.isascii() and header.isdigit()) or len(header) > 10:  # ("²".isdigit())
        raise ConnectError("invalid_argument", f"Connect-Timeout-Ms: {header!r} is not a number")
    return int(header) / 1000 or None
