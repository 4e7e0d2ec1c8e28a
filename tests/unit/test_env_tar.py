"""The agent's half of directory tars: headers from the exec server's entries, and gzip
inflated in bounded pieces."""

from __future__ import annotations

import asyncio
import errno
import gzip
import io
import tarfile
from collections.abc import AsyncIterator

import pytest

from tangram.api.wire import STREAM_CHUNK
from tangram.node_agent import env_tar
from tangram.node_agent.execution import ExecError


def _entry(kind: bytes, mode: int, size: int, name: bytes, target: bytes = b"") -> bytes:
    fields = [kind, b"%o" % mode, b"%d" % size, b"1700000000123456789", b"1000", b"70000000",
              name, target]  # fmt: skip
    return b"".join(f + b"\0" for f in fields)


def test_headers_carry_what_ustar_cannot_and_tarfile_reads_them_back() -> None:
    """A 300-byte name that is not UTF-8, a gid past ustar's 8 octal digits, a symlink:
    pax records carry them, and tarfile reads the stream as it was meant."""
    long_name = b"dir/" + b"\xff" * 296
    content = b"abc"
    out = bytearray()
    for entry, data in (
        (_entry(b"d", 0o755, 4096, b"dir"), b""),
        (_entry(b"f", 0o640, len(content), long_name), content),
        (_entry(b"l", 0o777, 5, b"dir/link", b"../up"), b""),
    ):
        head, size = env_tar.header(entry)
        out += head + data + env_tar.padding(size)
    out += env_tar.END
    with tarfile.open(fileobj=io.BytesIO(bytes(out)), errors="surrogateescape") as tar:
        members = tar.getmembers()
        assert [(m.type, m.size, m.mode) for m in members] == [
            (tarfile.DIRTYPE, 0, 0o755), (tarfile.REGTYPE, 3, 0o640), (tarfile.SYMTYPE, 0, 0o777)
        ]  # fmt: skip
        assert members[1].name.encode("utf-8", "surrogateescape") == long_name
        assert (members[1].gid, members[1].mtime) == (70000000, 1700000000)
        assert members[2].linkname == "../up"
        file = tar.extractfile(members[1])
        assert file is not None and file.read() == content


def _inflate(*pieces: bytes) -> list[bytes]:
    async def source() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    async def run() -> list[bytes]:
        return [out async for out in env_tar.gunzipped(source())]

    return asyncio.run(run())


def test_a_plain_body_passes_as_it_is_whatever_its_first_pieces() -> None:
    assert b"".join(_inflate(b"\x1f", b"", b"not gzip", b"!")) == b"\x1fnot gzip!"
    assert _inflate() == []


def test_gzip_is_inflated_in_bounded_pieces_across_concatenated_members() -> None:
    zeros = bytes(24 << 20)  # 24 MiB of zeros: 24 KiB of gzip
    packed = gzip.compress(zeros) + gzip.compress(b"tail")
    pieces = _inflate(packed[:1], packed[1:5000], packed[5000:])
    assert max(map(len, pieces)) <= STREAM_CHUNK
    assert b"".join(pieces) == zeros + b"tail"


@pytest.mark.parametrize(
    "body",
    [
        gzip.compress(b"x" * 1000, mtime=0)[:-9],
        gzip.compress(b"x", mtime=0) + b"garbage",
        b"\x1f\x8bnot deflate",
    ],
    ids=["cut short", "trailing garbage", "not deflate"],  # (ids the same in every worker)
)
def test_broken_gzip_is_refused_as_invalid(body: bytes) -> None:
    with pytest.raises(ExecError) as refused:
        _inflate(body)
    assert refused.value.errno == errno.EINVAL
    assert "gzip" in str(refused.value)
