"""A directory as a tar stream, the agent's half (the exec server's is ``exec_tar.c``).

Out: the server walks the directory and sends each member's entry and bytes; the tar
headers are written here, by the standard library's ``tarfile`` (ustar, with pax
records for long or non-UTF-8 names, large sizes and ids), so the C side holds no
format. In: the tar goes to the server as it comes; a gzipped one (``.tar.gz``) is
inflated here first, a bounded piece at a time.
"""

from __future__ import annotations

import errno
import tarfile
from collections.abc import AsyncIterable, AsyncIterator

from tangram.api.gunzip import GzipError, inflated
from tangram.node_agent.execution import ExecError

BLOCK = tarfile.BLOCKSIZE
END = bytes(2 * BLOCK)  # the end-of-archive marker
_GZIP = b"\x1f\x8b"
_TYPES = {b"f": tarfile.REGTYPE, b"d": tarfile.DIRTYPE, b"l": tarfile.SYMTYPE}


def header(entry: bytes) -> tuple[bytes, int]:
    """The tar header of a member, from its entry as the server sends it (type, mode,
    size, mtime in ns, uid, gid, path relative to the tar's root, symlink target), and
    how many bytes of content follow it."""
    kind, mode, size, mtime, uid, gid, name, target = entry.split(b"\0")[:8]
    info = tarfile.TarInfo(name.decode("utf-8", "surrogateescape"))  # names are bytes
    info.type = _TYPES[kind]
    info.mode = int(mode, 8)
    info.size = int(size) if kind == b"f" else 0
    info.mtime = int(mtime) // 1_000_000_000
    info.uid, info.gid = int(uid), int(gid)
    if kind == b"l":
        info.linkname = target.decode("utf-8", "surrogateescape")
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"), info.size


def padding(size: int) -> bytes:
    """The zeros that fill a member's content to a whole block."""
    return bytes(-size % BLOCK)


async def gunzipped(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` as they are, or inflated if they begin as gzip does; no piece comes
    out larger than ``STREAM_CHUNK``, however well the input compresses."""
    source = aiter(chunks)
    first = b""
    async for chunk in source:
        first += chunk
        if len(first) >= len(_GZIP):
            break
    if not first.startswith(_GZIP):
        if first:
            yield first
        async for chunk in source:
            yield chunk
        return
    try:
        async for out in inflated(_after(first, source)):
            yield out
    except GzipError as e:
        raise ExecError(f"the body: {e}", errno=errno.EINVAL) from None


async def _after(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk
