"""A streamed request's two directions on the scheduler link, with flow control.

Most requests are answered by one reply. A streamed one (a file read or write, a
streamed exec) also sends its output as chunk replies (``more``) and takes its input
from ``AgentInput`` messages, each direction within ``STREAM_WINDOW`` chunks that the
other side has not acknowledged (``credit``): a slow reader stalls its own request,
never the link. A streamed exec's signals come in ``AgentInput`` too.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable

from tangram.api.wire import (
    STREAM_CHUNK,
    STREAM_WINDOW,
    AgentInput,
    AgentReply,
    FilesOutcome,
    chunk_json,
)


class Stream:
    """``post`` sends a message (JSON) on the link."""

    def __init__(self, rid: int, post: Callable[[str], None]) -> None:
        self.rid = rid
        self._post = post
        self._window = asyncio.Semaphore(STREAM_WINDOW)  # output chunks not yet taken
        self._input: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.signals: asyncio.Queue[int] = asyncio.Queue()  # for a streamed exec's command
        self.closed = False

    def close(self) -> None:
        """Nobody takes its output any more (the request was cancelled, or its link went):
        what would wait for credit is dropped, so a cancelled command's tree can be
        killed and its collection end rather than wait for a window that never opens."""
        self.closed = True
        self._window.release()
        self._input.put_nowait(None)

    def head(self, files: FilesOutcome) -> None:
        """What the scheduler needs before the data (a read's file entry)."""
        self._post(AgentReply(rid=self.rid, ok=True, more=True, files=files).model_dump_json())

    async def send(self, fd: int, data: bytes) -> None:
        """Output of ``fd`` (1 stdout, 2 stderr; a file's bytes are 1), in chunks, each
        once the window has room for it; dropped once the stream is closed."""
        for start in range(0, len(data), STREAM_CHUNK):
            await self._window.acquire()
            if self.closed:
                self._window.release()  # the next waiter drops its chunk too
                return
            self._post(chunk_json(self.rid, data[start : start + STREAM_CHUNK], fd))

    async def received(self) -> AsyncIterator[bytes]:
        """Input until its end; each chunk taken is acknowledged, so more may come."""
        while (data := await self._input.get()) is not None:
            yield data
            self._post(AgentReply(rid=self.rid, ok=True, more=True, credit=1).model_dump_json())

    def take(self, msg: AgentInput) -> None:
        """An ``AgentInput`` for this request, as the link read it."""
        if msg.data:
            self._input.put_nowait(base64.b64decode(msg.data))
        if msg.eof:
            self._input.put_nowait(None)
        for _ in range(msg.credit):
            self._window.release()
        if msg.signal is not None:
            self.signals.put_nowait(msg.signal)
