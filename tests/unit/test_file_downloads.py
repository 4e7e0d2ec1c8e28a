"""Downloads of the files API as HTTP responses: their name in ``Content-Disposition``
whatever it is, and their agent request closed whatever happens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from tangram.api.wire import FileEntry
from tangram.service.file_routes import attachment, download_response
from tangram.service.files import Download


def test_any_name_is_an_ascii_header_with_the_whole_name_in_utf8() -> None:
    assert attachment("x.tar") == "attachment; filename=\"x.tar\"; filename*=UTF-8''x.tar"
    odd = attachment('数据 "q"\\\n\udcff.tar')  # (a name not valid UTF-8 keeps a surrogate)
    assert odd.isascii() and "\n" not in odd
    assert odd.startswith('attachment; filename="__ _q____.tar"; ')
    assert odd.endswith("filename*=UTF-8''%E6%95%B0%E6%8D%AE%20%22q%22%5C%0A%3F.tar")


def test_a_response_that_cannot_be_made_closes_its_agent_request() -> None:
    closed: list[bool] = []

    async def data() -> AsyncGenerator[bytes, None]:
        yield b""

    async def close() -> None:
        closed.append(True)

    def broken(entry: FileEntry) -> dict[str, str]:
        raise UnicodeEncodeError("latin-1", entry.name, 0, 1, "not latin-1")

    entry = FileEntry(name="数据", path="/数据", type="dir", size=0, mode=0o755, mtime=0,
                      uid=0, gid=0)  # fmt: skip
    with pytest.raises(UnicodeEncodeError):
        asyncio.run(download_response(Download(entry, data(), close), broken, "application/x-tar"))
    assert closed == [True]
