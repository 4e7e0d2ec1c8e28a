"""One writer per WebSocket, sending what a loop tick queued in as few frames as it can.

Messages are posted without waiting; the writer task wakes once per tick and sends the
batch, packed a message a line when the peer reads packed frames (``wire.pack``). A send
per tick rather than per message is most of a link's cost under load.

Both ends of the action stream use it, and the scheduler's agent links: it lives with the
client because the client may import only the wire models and itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import AnyStr, Generic

from tangram.api.wire import pack


class Outbox(Generic[AnyStr]):
    """``send`` writes one frame; ``on_failure`` runs once if a send raises (nothing
    queued after it will be written, so the connection is as good as gone)."""

    def __init__(
        self,
        send: Callable[[AnyStr], Awaitable[None]],
        on_failure: Callable[[Exception], Awaitable[None]],
        *,
        packed: bool,
    ) -> None:
        self._send: Callable[[AnyStr], Awaitable[None]] = send
        self._on_failure = on_failure
        self.packed = packed
        self._queue: list[AnyStr] = []
        self._queued = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self.backlog = 0  # bytes (or characters) posted and not sent yet
        self.sent = 0  # bytes (or characters) of frames sent: whether the peer reads at all
        self._empty = asyncio.Event()  # nothing posted is unsent
        self._empty.set()
        self._closed = False

    def post(self, message: AnyStr) -> None:
        if self._closed:
            return  # nothing more is written: dropped, as what was queued
        self._queue.append(message)
        self.backlog += len(message)
        self._empty.clear()
        self._queued.set()
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_forever())

    async def flushed(self) -> None:
        """Wait until everything posted so far is sent (a peer that does not read holds
        the writer, and so this, until it reads)."""
        if self._writer is not None and not self._writer.done():
            await self._empty.wait()

    def close(self) -> None:
        """Stop writing: what is still queued is dropped now, and what is posted later.
        Its callbacks are let go, so that an owner and its outbox (each holding the
        other) holding a peer's unread answers are freed as soon as the owner is
        dropped, not at a full collection that may not come for long."""
        self._closed = True
        if self._writer is not None and self._writer is not asyncio.current_task():
            self._writer.cancel()
        self._writer = None
        self._queue = []
        self.backlog = 0
        self._send, self._on_failure = _nothing, _nothing
        self._empty.set()

    async def _write_forever(self) -> None:
        try:
            while True:
                await self._queued.wait()
                self._queued.clear()
                batch, self._queue = self._queue, []
                for frame in pack(batch) if self.packed else batch:
                    await self._send(frame)
                    self.sent += len(frame)
                self.backlog -= sum(len(m) for m in batch)
                if not self._queue:
                    self._empty.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            with contextlib.suppress(Exception):
                await self._on_failure(e)
        finally:
            self._empty.set()  # nothing more will be sent: nobody may wait for it


async def _nothing(_: object) -> None:
    """A closed outbox's send and failure callback: nothing is written, nobody listens."""
