"""A TCP proxy on 127.0.0.1 in front of the service, for the client's tests: what a
network does to a connection (goes silent, stalls mid-answer, is cut off), on cue."""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    """Forwards 127.0.0.1:port to the service at ``upstream``, a connection each.

    ``silence()`` stops every connection open now, both ways, holding it open: what
    arrives is read and never passed on (later connections go through). ``stall_after``
    bytes of answers on a connection, the rest is held back (``stalled`` is set once one
    is): an answer stuck mid-body. ``cut_after`` bytes of an answer, the connection is
    aborted, for the next ``cuts`` answers that get that far: an answer cut off. (An
    answer's bytes: those that come back after the last bytes sent on its connection.)
    ``abort()`` aborts every connection open now."""

    def __init__(self, upstream: str) -> None:
        self.up_port = int(upstream.rsplit(":", 1)[1])
        self.silenced: list[asyncio.Event] = []  # one per connection
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []
        self.closing = asyncio.Event()
        self.stall_after: int | None = None
        self.stalled = asyncio.Event()
        self.cut_after: int | None = None
        self.cuts = 0  # connections still to cut at cut_after
        self.cut = 0  # connections cut so far

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.close()
        self.closing.set()
        self.abort()  # every pipe's read ends
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def silence(self) -> None:
        for quiet in self.silenced:
            quiet.set()

    def abort(self) -> None:
        for writer in self.writers:
            writer.transport.abort()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.up_port)
        self.writers += [cw, uw]
        quiet = asyncio.Event()
        self.silenced.append(quiet)
        answered = [0]  # bytes of the answer coming back now

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, answers: bool) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await r.read(65536):
                    if quiet.is_set():
                        await self.closing.wait()  # silent from now on, closing nothing
                        return
                    if not answers:  # a request: what comes back next is its answer
                        answered[0] = 0
                    sent, cut, stall = answered[0], self.cut_after, self.stall_after
                    if answers and self.cuts and cut is not None and sent + len(data) > cut:
                        self.cuts -= 1
                        self.cut += 1
                        w.write(data[: cut - sent])
                        await w.drain()
                        cw.transport.abort()
                        uw.transport.abort()
                        return
                    if answers and stall is not None and sent + len(data) > stall:
                        w.write(data[: stall - sent])
                        await w.drain()
                        self.stalled.set()
                        await self.closing.wait()  # the rest held back
                        return
                    w.write(data)
                    await w.drain()
                    if answers:
                        answered[0] += len(data)

        try:
            await asyncio.gather(pipe(cr, uw, False), pipe(ur, cw, True))
        finally:
            cw.transport.abort()
            uw.transport.abort()
