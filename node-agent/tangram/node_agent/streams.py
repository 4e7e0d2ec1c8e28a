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
from tangram.node_agent.execution import InputCutOffError

_CUT = object()  # in the input queue: the stream closed before its input ended


class Stream:
    """``post`` sends a message (JSON) on the link."""

    def __init__(self, rid: int, post: Callable[[str], None]) -> None:
        self.rid = rid
        self._post = post
        self._window = asyncio.Semaphore(STREAM_WINDOW)  # output chunks not yet taken
        # Input until its end (None, the requester's) or its cut (``_CUT``, ``close``).
        self._input: asyncio.Queue[bytes | object | None] = asyncio.Queue()
        self.signals: asyncio.Queue[int] = asyncio.Queue()  # for a streamed exec's command
        self.closed = False  # its output is dropped

    def stop_output(self) -> None:
        """Its output is no longer waited for (its command is being killed, at its
        deadline or cancelled): what would wait for credit is dropped, so the kill gets
        through and the collection ends rather than wait for a window that may never
        open. Input goes on as it was."""
        if not self.closed:
            self.closed = True
            self._window.release()

    def close(self) -> None:
        """Nobody is at the other end any more (the request ended or was cancelled, or its
        link went): its output is dropped, and input its requester had not ended is cut
        off, never taken as its end (see ``received``)."""
        self.stop_output()
        self._input.put_nowait(_CUT)

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
        """Input until its end; each chunk taken is acknowledged, so more may come.
        ``InputCutOffError`` when the stream closed before its requester ended the input: what
        came is not all there was, so it must not be taken as whole (a command's EOF)."""
        while (data := await self._input.get()) is not None:
            if data is _CUT:
                self._input.put_nowait(_CUT)  # (stays cut for another reader)
                raise InputCutOffError(
                    "its input was cut off: the link to the scheduler dropped (or the "
                    "request ended) before its input ended"
                )
            assert isinstance(data, bytes)
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
