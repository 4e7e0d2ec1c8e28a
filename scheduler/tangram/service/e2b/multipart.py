"""envd's multipart upload read as it comes: each ``file`` part's bytes go on to its write
piece by piece, as the body arrives, the parts one after another. Nothing of the body is
kept beyond the piece in hand, in memory or on the scheduler's disk (a form parsed whole
first would hold every part of a body as large as ``admission.maxFileBytes``, which the
service holds the body to). Parsed by python-multipart, as Starlette's forms are.

Parts not named ``file`` are read past, as envd does, but each held to a few KiB (E2B's
SDK sends none): a larger one is refused at once, naming it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any, cast

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from tangram.service.e2b.errors import E2BError

MAX_PARTS = 1000  # parts in one multipart upload, of any name
MAX_FIELD_BYTES = 4096  # a part other than ``file`` (read past, never kept)
MAX_HEADER_BYTES = 16384  # a part's headers
_DONE = "done"


async def file_parts(
    body: AsyncIterable[bytes], content_type: str
) -> AsyncGenerator[tuple[str, AsyncIterator[bytes]], None]:
    """The ``file`` parts of the multipart ``body``, in order: each its filename ("" for
    none) and its bytes as they come, to be read before the next part is asked for
    (whatever is left of it is read past then). A body that is not multipart, or ends
    before its closing boundary, is 400 naming ``body``."""
    reader = _Reader(body, _boundary(content_type))
    count = 0
    while part := await reader.next_part():
        count += 1
        if count > MAX_PARTS:
            raise E2BError(400, f"body: over {MAX_PARTS} parts in one multipart upload")
        name, filename = part
        if name == "file":
            yield filename, reader.data()
            async for _ in reader.data():  # what its reader left
                pass
            continue
        size = 0
        async for piece in reader.data():
            size += len(piece)
            if size > MAX_FIELD_BYTES:
                raise E2BError(400, f"{name}: over {MAX_FIELD_BYTES} bytes; an upload's "
                               "parts other than 'file' are read past, not kept")  # fmt: skip


def _boundary(content_type: str) -> bytes:
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise E2BError(400, "body: multipart/form-data needs a boundary in its Content-Type")
    return boundary


def _text(raw: bytes) -> str:
    """A name as Starlette decodes it: UTF-8, else Latin-1."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")


class _Reader:
    """python-multipart's parser pulled, one piece of the body at a time, as the parts
    are read: its callbacks leave events (a part's headers read, a piece of its data, its
    end, the body's end) for ``next_part`` and ``data`` to take."""

    def __init__(self, body: AsyncIterable[bytes], boundary: bytes) -> None:
        self._body = aiter(body)
        self._events: deque[tuple[str, Any]] = deque()
        self._ended = False  # the body (the parser has seen all of it)
        self._in_part = False
        self._header = [b"", b""]
        self._disposition = b""
        self._header_bytes = 0
        try:
            self._parser = MultipartParser(boundary, {
                "on_part_begin": self._begin,
                "on_header_field": lambda d, s, e: self._add(0, d[s:e]),
                "on_header_value": lambda d, s, e: self._add(1, d[s:e]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": lambda d, s, e: self._events.append(("data", d[s:e])),
                "on_part_end": lambda: self._events.append(("end", None)),
                "on_end": lambda: self._events.append((_DONE, None)),
            })  # fmt: skip
        except FormParserError as e:
            raise E2BError(400, f"body: {e}") from None

    async def next_part(self) -> tuple[str, str] | None:
        """The next part's name and filename, once its headers are read; None at the
        body's end."""
        assert not self._in_part
        kind, value = await self._next()
        if kind == _DONE:
            return None
        assert kind == "part", kind
        self._in_part = True
        return cast("tuple[str, str]", value)

    async def data(self) -> AsyncIterator[bytes]:
        """The rest of the current part's bytes, as they come."""
        while self._in_part:
            kind, value = await self._next()
            if kind == "end":
                self._in_part = False
            else:
                yield value

    async def _next(self) -> tuple[str, Any]:
        while not self._events:
            if self._ended:
                raise E2BError(400, "body: the multipart body ends before its closing boundary")
            chunk = await anext(self._body, None)
            if chunk is None:
                self._ended = True
                continue
            try:
                self._parser.write(chunk)
            except FormParserError as e:
                raise E2BError(400, f"body: not multipart/form-data as it says ({e})") from None
        return self._events.popleft()

    def _begin(self) -> None:
        self._disposition, self._header_bytes = b"", 0

    def _add(self, which: int, piece: bytes) -> None:
        self._header_bytes += len(piece)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise E2BError(400, f"body: a part's headers over {MAX_HEADER_BYTES} bytes")
        self._header[which] += piece

    def _header_end(self) -> None:
        name, value = self._header
        if name.strip().lower() == b"content-disposition":
            self._disposition = value
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise E2BError(400, "body: a part's Content-Disposition has no name")
        name, filename = (_text(options.get(k, b"")) for k in (b"name", b"filename"))
        self._events.append(("part", (name, filename)))
