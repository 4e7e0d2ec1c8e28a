"""The client's side of the action stream (``/v1/stream``, ``tangram.service.stream``).

One WebSocket per client carries every exec its trajectories submit: a message per exec
(``StreamExec``), an answer per message (``StreamAnswer``), matched by id. What one loop
tick queued leaves in one frame, a message a line. The service's side has the same
writer; the client may not import it (it needs only the wire models).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tangram.api.wire import (
    AGENT_SUBPROTOCOL,
    FRAME_BYTES,
    STREAM_PATH,
    ActionResult,
    StreamAnswer,
    StreamOutput,
)
from tangram.client.common import (
    ClientClosedError,
    StreamClosedError,
    TangramError,
    encode_json,
    stream_error,
)
from tangram.client.outbox import Outbox

log = logging.getLogger("tangram.client")
# A larger exec goes over HTTP: the service reads a stream's frames up to about twice the
# larger of this and the pool's maxRequestBytes, and a frame over that ends the stream
# (1009), not just its message with a 413.
MAX_MESSAGE_BYTES = FRAME_BYTES
# A live exec's input goes in messages of at most this many characters: escaped as JSON
# (12 bytes a character at worst: one beyond the BMP, as two escapes) each stays under
# MAX_MESSAGE_BYTES, its id and field names included.
STDIN_CHARS = (MAX_MESSAGE_BYTES - 1024) // 12
_OUTPUT = re.compile(rb'\{"id":\d+,"(stdout|stderr)"')  # how the service writes output
# A stream silent this long is pinged; no pong within half of it and the stream is taken
# for dead (a scheduler host gone, a partition: nothing, not even a FIN, arrives), its
# execs retried under their keys. Any frame received counts as a sign of life.
HEARTBEAT_S = 15.0
HANDSHAKE_S = 30.0  # an unanswered handshake is given up (and retried) after this
# Output of a live exec that ``output()`` has not given out yet, kept at most (characters).
# The stream carries every exec of the client, so it is always read (an unread one would
# hold up the others' answers, and ``result()`` behind its own output): past this,
# output is dropped, with a marker where it was, until the caller catches up.
LIVE_BUFFER_CHARS = 16 << 20


class LiveAction:
    """A streamed exec on the action stream: its output as it is produced, its stdin
    (``interactive``), signals for its command, then its result. Its cores are held only
    while it runs, as for any exec."""

    def __init__(
        self,
        stream: ExecStream,
        mid: int,
        answer: asyncio.Future[StreamAnswer],
        *,
        interactive: bool,
    ) -> None:
        self._stream, self.id, self._answer = stream, mid, answer
        self.interactive = interactive
        self._output: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue()
        self._buffered = 0  # characters queued in _output
        self._dropping: dict[str, int] = {}  # by fd: characters dropped since the last kept
        self.dropped = 0  # characters of output dropped, output() not read in time
        self.refused: list[TangramError] = []  # input or signals the service refused
        # Bytes written are UTF-8 read across writes: a character split between two
        # writes (a reader's chunks) is whole in the second.
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    async def output(self) -> AsyncIterator[tuple[str, str]]:
        """``("stdout" or "stderr", text)`` as the command writes it, until it ends.
        Output not taken here is kept up to ``LIVE_BUFFER_CHARS``; past that it is
        dropped, and a line ``[tangram: N characters of output dropped ...]`` takes its
        place (``dropped`` counts them). The result holds the output either way, up to
        ``output_cap``. Output cut off — the stream dropped (``StreamClosedError``), the
        client closed (``ClientClosedError``) — raises that error, as ``result()`` does,
        once what came is given out: it does not end as if the command had."""
        while (piece := await self._output.get()) is not None:
            self._buffered -= len(piece[1])
            yield piece
        self._output.put_nowait(None)  # ended for a second reader too
        if self._answer.done() and not self._answer.cancelled():
            cut = self._answer.exception()
            if isinstance(cut, StreamClosedError | ClientClosedError):
                raise cut

    def _arrived(self, fd: str, text: str) -> None:
        full = self._buffered > 0 and self._buffered + len(text) > LIVE_BUFFER_CHARS
        # Once dropping, on until the reader took half: one gap and marker, not one a piece.
        if full or (self._dropping and self._buffered > LIVE_BUFFER_CHARS // 2):
            if not self.dropped:
                log.warning("live exec %d: its output is not read; dropping it", self.id)
            self._dropping[fd] = self._dropping.get(fd, 0) + len(text)
            self.dropped += len(text)
            return
        self._mark_dropped()
        self._buffered += len(text)
        self._output.put_nowait((fd, text))

    def _mark_dropped(self) -> None:
        for fd, n in self._dropping.items():
            marker = f"\n[tangram: {n} characters of output dropped: output() was not read]\n"
            self._buffered += len(marker)
            self._output.put_nowait((fd, marker))
        self._dropping.clear()

    def _ended(self) -> None:
        self._mark_dropped()
        self._output.put_nowait(None)

    async def write(self, text: str | bytes) -> None:
        """More of its standard input (it was started ``interactive``): text, or bytes of
        UTF-8. A long text goes in several messages, in order: one over a frame would end
        the whole stream."""
        if not self.interactive:
            raise TangramError(0, "invalid", "write: the exec was not started interactive", [])
        if not isinstance(text, str):
            try:
                text = self._utf8.decode(bytes(text))
            except UnicodeDecodeError as e:
                raise ValueError(f"write: bytes that are not UTF-8 ({e.reason}); the "
                                 "service takes text") from None  # fmt: skip
        self._running("write")
        for start in range(0, len(text), STDIN_CHARS):
            self._stream._post({"id": self.id, "stdin": text[start : start + STDIN_CHARS]})

    async def close_stdin(self) -> None:
        try:
            self._utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError("close_stdin: the bytes written end inside a character") from None
        self._running("close_stdin")
        self._stream._post({"id": self.id, "eof": True})

    def _running(self, what: str) -> None:
        """Input for an exec that has ended reaches nothing: said here (the service's
        404 for it would come on the stream, after the caller moved on)."""
        if self._answer.done():
            raise TangramError(
                0, "conflict", f"{what}: the exec has ended (result() has its outcome)", []
            )

    async def signal(self, name: str = "SIGINT") -> None:
        """SIGINT, SIGTERM or SIGKILL for its command's process group."""
        self._stream._post({"id": self.id, "signal": name})

    async def result(self) -> ActionResult:
        answer = await asyncio.shield(self._answer)
        if answer.status == 200 and answer.result is not None:
            return answer.result
        raise stream_error(answer)


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
        self._live: dict[int, LiveAction] = {}
        self._ids = 0
        self._outbox: Outbox[bytes] = Outbox(ws.send_bytes, self._send_failed, packed=True)
        self.closed = False
        self._by_client = False  # closed by its client (aclose), not dropped
        self._reader = asyncio.create_task(self._read_forever())

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, headers: dict[str, str]) -> ExecStream:
        try:
            async with asyncio.timeout(HANDSHAKE_S) as limit:
                ws = await session.ws_connect(
                    STREAM_PATH,
                    protocols=(AGENT_SUBPROTOCOL,),
                    headers=headers,
                    max_msg_size=64 << 20,  # a frame of answers, each up to 16 MiB of output
                    compress=0,  # small JSON messages: deflate costs more than it saves
                    heartbeat=HEARTBEAT_S,
                )
        except aiohttp.WSServerHandshakeError as e:
            raise NoStreamError(e.status) from None
        except TimeoutError:
            if not limit.expired():
                raise  # the client's own timeout_s
            why = f"no answer to the stream's handshake in {HANDSHAKE_S:g} s"
            raise StreamClosedError(why) from None
        if ws.protocol != AGENT_SUBPROTOCOL:  # not a service that answers a line each
            await ws.close()
            raise NoStreamError(400)
        return cls(ws)

    async def exec(self, trajectory: str, body: dict[str, Any]) -> StreamAnswer:
        """Submit one exec (``body`` as ``POST .../exec`` takes it); its answer."""
        mid, fut = self._submit({"trajectory": trajectory, "exec": body})
        try:
            return await fut
        finally:
            self._pending.pop(mid, None)

    def live(self, trajectory: str, body: dict[str, Any], *, interactive: bool) -> LiveAction:
        """Submit one exec whose output comes as it is produced and whose stdin stays open
        if ``interactive``; a signal can reach it either way."""
        mid, fut = self._submit({"trajectory": trajectory, "exec": body, "stream": True,
                                 "interactive": interactive})  # fmt: skip
        action = self._live[mid] = LiveAction(self, mid, fut, interactive=interactive)
        fut.add_done_callback(lambda _: self._live_ended(mid))
        return action

    def _submit(self, msg: dict[str, Any]) -> tuple[int, asyncio.Future[StreamAnswer]]:
        """Send a message under a new id; the future its answer resolves."""
        if self.closed:
            raise StreamClosedError("the action stream is closed")
        self._ids += 1
        mid = self._ids
        line = encode_json({"id": mid, **msg})
        if len(line) > MAX_MESSAGE_BYTES:
            raise NoStreamError(413)
        fut: asyncio.Future[StreamAnswer] = asyncio.get_running_loop().create_future()
        self._pending[mid] = fut
        self._outbox.post(line)  # (sent by the writer: the caller registers before any reply)
        return mid, fut

    def _live_ended(self, mid: int) -> None:
        self._pending.pop(mid, None)
        action = self._live.pop(mid, None)
        if action is not None:
            action._ended()

    def _post(self, msg: dict[str, Any]) -> None:
        if self.closed:
            raise StreamClosedError("the action stream is closed")
        self._outbox.post(encode_json(msg))

    async def aclose(self) -> None:
        """Close it: what still waits on it (a live exec) raises ``ClientClosedError``."""
        self._by_client = True
        self._outbox.close()
        await self._ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    def _route(self, line: bytes) -> None:
        """One answer to its waiter; one this client cannot read fails only its own.
        Output of a streamed exec goes to its ``LiveAction``."""
        if (out := _OUTPUT.match(line)) is not None:
            with contextlib.suppress(ValueError):
                got = StreamOutput.model_validate_json(line)
                action = self._live.get(got.id)
                if action is not None:
                    action._arrived(out.group(1).decode(), got.stdout or got.stderr or "")
                return
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
        if answer.about == "input":  # input or a signal refused: the exec goes on
            action = self._live.get(answer.id or -1)
            if action is not None:
                action.refused.append(stream_error(answer))
            log.warning("action stream: input refused: %s", answer.error)
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
                    fut.set_exception(
                        ClientClosedError("the client was closed while this call waited")
                        if self._by_client
                        else StreamClosedError(f"the action stream closed ({why})")
                    )
