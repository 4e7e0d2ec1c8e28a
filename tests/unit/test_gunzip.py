"""gzip inflated as it streams (``tangram.api.gunzip``), as envd's gzip uploads and the
agent's gzipped tars read it: bounded pieces, concatenated members, and nothing that is
not whole gzip."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator

import pytest

from tangram.api.gunzip import GzipError, inflated

PIECE = 4096


def _inflate(*chunks: bytes) -> list[bytes]:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def run() -> list[bytes]:
        return [piece async for piece in inflated(source(), PIECE)]

    return asyncio.run(run())


def test_members_are_one_stream_in_bounded_pieces_whatever_the_chunks() -> None:
    zeros = bytes(1 << 20)  # 1 MiB of zeros: 1 KiB of gzip
    body = gzip.compress(zeros) + gzip.compress(b"") + gzip.compress(b"tail")
    for cut in (1, 10, 500, len(body) - 3):
        pieces = _inflate(body[:cut], b"", body[cut:])  # (an empty chunk ends nothing)
        assert max(map(len, pieces)) <= PIECE
        assert b"".join(pieces) == gzip.decompress(body) == zeros + b"tail"


def test_a_member_split_at_every_byte_is_read_whole() -> None:
    body = gzip.compress(b"some text " * 100)
    assert b"".join(_inflate(*(body[i : i + 1] for i in range(len(body))))) == b"some text " * 100


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "empty"),
        (gzip.compress(b"x" * 1000, mtime=0)[:-9], "cut short"),
        (gzip.compress(b"x" * 1000, mtime=0)[:10], "cut short"),
        (gzip.compress(b"ok", mtime=0) + gzip.compress(b"more", mtime=0)[:5], "cut short"),
        (gzip.compress(b"ok", mtime=0) + b"GARBAGE", "not valid gzip"),
        (zlib.compress(b"zlib, not gzip"), "not valid gzip"),
    ],
    ids=["empty", "no trailer", "header only", "second member cut", "trailing garbage", "zlib"],
)
def test_what_is_not_whole_gzip_is_refused_saying_how(body: bytes, why: str) -> None:
    with pytest.raises(GzipError, match=why):
        _inflate(body)
