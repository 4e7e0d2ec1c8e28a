"""The client's side of the action stream (``/v1/stream``, ``tangram.service.stream``).

One WebSocket per client carries every exec its trajectories submit: a message per exec
(``StreamExec``), an answer per message (``StreamAnswer``), matched by id. What one loop
tick queued leaves in one frame, a message a line. The service's side has the same
writer; the client may not import it (it needs only the wire models).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aiohttp

from tangram.api.wire import AGENT_SUBPROTOCOL, STREAM_PATH, StreamAnswer
from tangram.client.outbox import Outbox

log = logging.getLogger("tangram.client")
# A larger exec goes over HTTP: the service reads frames of up to 64 MiB, and a message
# over that would end the stream, not get a 413.
MAX_MESSAGE_BYTES = 32 << 20


class StreamClosedError(aiohttp.ClientConnectionError):
    """The stream ended before the answer came: retry under the same idempotency key."""


class NoStreamError(Exception):
    """Not for the stream: the service refused its handshake (``status``; 404: it has
    none), or a message is too large for it (413)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"the service refused the action stream ({status})")
        self.status = status


class ExecStream:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._pending: dict[int, asyncio.Future[StreamAnswer]] = {}
        self._ids = 0
        self._outbox: Outbox[bytes] = Outbox(ws.send_bytes, self._send_failed, packed=True)
        self.closed = False
        self._reader = asyncio.create_task(self._read_forever())

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, headers: dict[str, str]) -> ExecStream:
        try:
            ws = await session.ws_connect(
                STREAM_PATH,
                protocols=(AGENT_SUBPROTOCOL,),
                headers=headers,
                max_msg_size=64 << 20,  # a frame of answers, each up to 16 MiB of output
                compress=0,  # small JSON messages: deflate costs more than it saves
            )
        except aiohttp.WSServerHandshakeError as e:
            raise NoStreamError(e.status) from None
        if ws.protocol != AGENT_SUBPROTOCOL:  # not a service that answers a line each
            await ws.close()
            raise NoStreamError(400)
        return cls(ws)

    async def exec(self, trajectory: str, body: dict[str, Any]) -> StreamAnswer:
        """Submit one exec (``body`` as ``POST .../exec`` takes it); its answer."""
        if self.closed:
            raise StreamClosedError("the action stream is closed")
        self._ids += 1
        mid = self._ids
        msg = {"id": mid, "trajectory": trajectory, "exec": body}
        line = json.dumps(msg, separators=(",", ":")).encode()
        if len(line) > MAX_MESSAGE_BYTES:
            raise NoStreamError(413)
        fut: asyncio.Future[StreamAnswer] = asyncio.get_running_loop().create_future()
        self._pending[mid] = fut
        self._outbox.post(line)
        try:
            return await fut
        finally:
            self._pending.pop(mid, None)

    async def aclose(self) -> None:
        self._outbox.close()
        await self._ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    def _route(self, line: bytes) -> None:
        """One answer to its waiter; one this client cannot read fails only its own."""
        try:
            answer = StreamAnswer.model_validate_json(line)
        except ValueError as e:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                fut = self._pending.get(json.loads(line).get("id"))
                if fut is not None and not fut.done():
                    fut.set_exception(e)
                    return
            log.error("action stream: an answer this client cannot read: %.200r", line)
            return
        fut = self._pending.get(answer.id) if answer.id is not None else None
        if fut is not None and not fut.done():
            fut.set_result(answer)
        elif answer.id is None:  # a message of ours it could not read: a bug
            log.error("action stream: the service could not read a message: %s", answer.error)

    async def _send_failed(self, e: Exception) -> None:
        """Nothing queued will be answered: end the stream (its waiters fail, and retry)."""
        log.warning("action stream: send failed: %s", e)
        await self._ws.close()

    async def _read_forever(self) -> None:
        try:
            async for msg in self._ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    data = msg.data
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    data = msg.data.encode()
                else:
                    break
                for line in data.split(b"\n"):
                    self._route(line)
        except Exception as e:
            log.warning("action stream: %s", e)
        finally:
            self.closed = True
            self._outbox.close()
            with contextlib.suppress(Exception):
                await self._ws.close()
            why = self._ws.close_code
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(StreamClosedError(f"the action stream closed ({why})"))
