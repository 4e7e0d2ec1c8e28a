"""envd's multipart upload read as it comes (``tangram.service.e2b.multipart``): each
``file`` part's bytes are handed on while the body is still arriving, other parts are read
past but held to a few KiB, and a body that is not whole multipart is refused naming
``body``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from tangram.service.e2b.errors import E2BError
from tangram.service.e2b.multipart import MAX_FIELD_BYTES, MAX_HEADER_BYTES, MAX_PARTS, file_parts

B = "XyZbOuNdArY"
KIND = f"multipart/form-data; boundary={B}"


def _sdk_body(files: list[tuple[str, bytes]]) -> tuple[bytes, str]:
    """A body as E2B's SDK builds it: httpx's multipart, one ``file`` part per file, its
    filename the path."""
    request = httpx.Request("POST", "http://sandbox/files",
                            files=[("file", (name, data)) for name, data in files])  # fmt: skip
    return request.read(), request.headers["content-type"]


def _part(name: str, data: bytes, filename: str | None = None) -> bytes:
    named = f'; filename="{filename}"' if filename is not None else ""
    head = f'--{B}\r\nContent-Disposition: form-data; name="{name}"{named}\r\n\r\n'
    return head.encode() + data + b"\r\n"


END = f"--{B}--\r\n".encode()


class Source:
    """A body given in ``chunks``, counting those taken."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks, self.taken = chunks, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.taken += 1
            yield chunk


async def _read(body: Source | bytes, kind: str = KIND) -> list[tuple[str, bytes]]:
    source = Source(body) if isinstance(body, bytes) else body
    return [(name, b"".join([p async for p in data]))
            async for name, data in file_parts(source, kind)]  # fmt: skip


def _refused(body: Source | bytes, kind: str = KIND) -> str:
    with pytest.raises(E2BError) as refused:
        asyncio.run(_read(body, kind))
    assert refused.value.status == 400
    return refused.value.message


def test_the_sdks_files_come_whole_in_order_whatever_the_chunks() -> None:
    files = [("m/a.txt", b"A"), ("m/b.bin", bytes(range(256)) * 300), ("m/é.txt", b"")]
    body, kind = _sdk_body(files)
    for size in (1, 7, 4096, len(body)):
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        assert asyncio.run(_read(Source(*chunks), kind)) == files


def test_a_files_bytes_are_handed_on_before_the_body_ends() -> None:
    first = b"x" * 100_000
    source = Source(_part("file", first[:50_000], "a"), first[50_000:] + b"\r\n",
                    _part("file", b"second", "b"), END)  # fmt: skip
    seen: list[tuple[str, int, int]] = []  # (file, bytes so far, chunks of the body taken)

    async def run() -> None:
        async for name, data in file_parts(source, KIND):
            got = 0
            async for piece in data:
                got += len(piece)
                seen.append((name, got, source.taken))

    asyncio.run(run())
    # The first file's first bytes went on with only the first chunk of the body read.
    assert seen[0] == ("a", 50_000, 1)
    assert seen[-1] == ("b", 6, 3) and source.taken == 4


def test_other_parts_are_read_past_but_a_large_one_is_refused_at_once() -> None:
    small = _part("note", b"n" * MAX_FIELD_BYTES)
    body = small + _part("file", b"data", "f") + _part("other", b"") + END
    assert asyncio.run(_read(body)) == [("f", b"data")]
    # 900 fields of 1 MB: refused within the first, the rest never read.
    source = Source(_part("f0", b"a" * 1_000_000), *(_part(f"f{k}", b"a") for k in range(1, 900)))
    assert _refused(source).startswith(f"f0: over {MAX_FIELD_BYTES} bytes")
    assert source.taken == 1


def test_a_body_that_is_not_whole_multipart_is_refused_naming_body() -> None:
    whole = _part("file", b"data", "f") + END
    assert "ends before its closing boundary" in _refused(whole[: -len(END)])
    assert "ends before its closing boundary" in _refused(b"")
    assert _refused(b"not multipart at all").startswith("body: not multipart/form-data")
    assert "needs a boundary" in _refused(whole, "multipart/form-data")
    nameless = f"--{B}\r\nContent-Disposition: form-data\r\n\r\nx\r\n".encode() + END
    assert "has no name" in _refused(nameless)
    huge_line = f"--{B}\r\nX-{'h' * 5000}: v\r\n\r\n".encode()
    assert _refused(huge_line).startswith("body: ")
    many_lines = f"--{B}\r\n".encode() + f"X-H: {'v' * 3000}\r\n".encode() * 6
    assert _refused(many_lines).startswith(f"body: a part's headers over {MAX_HEADER_BYTES}")
    assert asyncio.run(_read(END)) == []  # no parts at all: the route says none is a file


def test_parts_are_held_to_a_count() -> None:
    assert len(asyncio.run(_read(_part("x", b"") * MAX_PARTS + END))) == 0
    assert "over 1000 parts" in _refused(_part("x", b"") * (MAX_PARTS + 1) + END)
