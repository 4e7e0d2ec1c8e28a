"""The Connect protocol (connectrpc.com) as E2B's envd clients speak it: JSON messages,
unary calls as plain JSON bodies, server streams as enveloped messages.

An envelope is one flag byte, a 4-byte big-endian length and the message. The last
envelope of a stream has the ``END_STREAM`` flag and holds ``{}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

END_STREAM = 0x02
COMPRESSED = 0x01
STREAM_TYPE = "application/connect+json"
MAX_MESSAGE = 16 << 20  # a request message larger than this is refused
MAX_UINT32 = (1 << 32) - 1
# A JSON number, the only text proto JSON reads as a quoted integer (no sign but "-", no
# spaces, no "0x", no "_", no "Infinity").
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")

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


def uint32(msg: dict[str, Any], field: str, name: str) -> int | None:
    """``msg[field]``, a ``uint32`` of envd's proto, read as protobuf's canonical JSON
    mapping reads one (None when absent): a JSON number or a decimal string of one
    (``123``, ``"123"``, ``1e2``), of an integer value from 0 to 2**32 - 1. Anything else
    is ``invalid_argument`` naming the field, never converted: ``true`` (not pid 1),
    ``1.5``, ``-1``, ``2**32``, ``"one"``, ``" 1"``, ``"0x1"``, ``""``."""
    value = msg.get(field)
    if value is None:
        return None
    # A number is read as the JSON it came as (1e2 as "100.0"; inf, nan match no number).
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    text = json.dumps(value) if is_number else value if isinstance(value, str) else ""
    # (Decimal: exact, so "4294967296.0" is out of range, not rounded into it)
    number = Decimal(text) if _JSON_NUMBER.fullmatch(text) else None
    if number is None or number != number.to_integral_value() or not 0 <= number <= MAX_UINT32:
        raise ConnectError("invalid_argument", f"{name}: an integer from 0 to {MAX_UINT32} "
                           f"(a number or a decimal string) is required, not "
                           f"{json.dumps(value)}")  # fmt: skip
    return int(number)


def timeout_s(header: str | None) -> float | None:
    """``Connect-Timeout-Ms``: the caller's deadline for the whole call, in seconds."""
    if header is None:
        return None
    if not (header.isascii() and header.isdigit()) or len(header) > 10:  # ("²".isdigit())
        raise ConnectError("invalid_argument", f"Connect-Timeout-Ms: {header!r} is not a number")
    return int(header) / 1000 or None
