"""gzip inflated as it streams in, for the service (envd's gzip uploads) and the node agent
(gzipped tars) alike: no piece comes out larger than asked however well the input
compresses, concatenated members are one stream (as ``gzip.decompress`` and ``gunzip``
read them), and anything that is not whole gzip is refused: empty, cut short, or followed
by bytes that begin no member.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterable, AsyncIterator

from tangram.api.wire import STREAM_CHUNK

_WBITS = 16 + zlib.MAX_WBITS  # deflate in a gzip header and trailer


class GzipError(ValueError):
    """Not whole gzip; the message says how, naming no field (the caller knows which)."""


async def inflated(chunks: AsyncIterable[bytes], piece: int = STREAM_CHUNK) -> AsyncIterator[bytes]:
    """``chunks``, gzip, inflated a piece of at most ``piece`` bytes at a time."""
    source = _nonempty(chunks)
    pending = await anext(source, None)
    if pending is None:
        raise GzipError("empty, not gzip")
    inflate, begun = zlib.decompressobj(_WBITS), False  # begun: this member has input
    try:
        while True:
            begun = begun or bool(pending)
            out = inflate.decompress(pending, piece)
            if out:
                yield out
            pending = inflate.unconsumed_tail
            if inflate.eof:  # another member may follow (`cat a.gz b.gz`)
                pending, inflate, begun = inflate.unused_data, zlib.decompressobj(_WBITS), False
            elif len(out) == piece:
                continue  # more output may wait inside, with no input left
            if not pending and (pending := await anext(source, None)) is None:
                break
    except zlib.error as e:
        raise GzipError(f"not valid gzip ({e})") from None
    if begun:
        raise GzipError("gzip data cut short")


async def _nonempty(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """An empty chunk (an HTTP body's last may be) is no end of the stream."""
    async for chunk in chunks:
        if chunk:
            yield chunk
