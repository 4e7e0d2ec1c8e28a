"""The action stream (``/v1/stream``): a client's execs multiplexed on one WebSocket.

A rollout worker runs many trajectories at once. Over HTTP each of their actions is a
request of its own (parsing, a task, a response written in two sends), which under load
costs the worker and the scheduler more than scheduling the action does
(docs/benchmarks.md). On the stream each message is an exec as the HTTP route takes it
plus an id of the caller's (``StreamExec``); each answer carries that id and what the
route would have answered (``StreamAnswer``): the result, or the same error with the same
status. Answers leave as actions end, in any order, what one loop tick finished in one
frame, a message a line (the agent link's framing).

The caller's tenant is the one its bearer token names at the handshake, and every frame
is admitted as an HTTP request is (``refusal``: the token file, or the cached review and
the pool's live access list); a frame that is not gets each of its messages refused with
the status HTTP would give, and the stream goes on answering what it admitted. A stream
that drops loses only its answers: keyed actions go on, and a retry with the same
idempotency key gets the result; what it sent without a key is cancelled (``_abandon``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol

from pydantic import Discriminator, Tag, TypeAdapter, ValidationError

from tangram.api.wire import FRAME_BYTES, SIGNALS, StreamExec, StreamInput, StreamSignal
from tangram.client.outbox import Outbox
from tangram.service.answers import RETRY_AFTER_S, RETRY_STATUS, engine_error, error_body, payload
from tangram.service.answers import invalid as invalid_body
from tangram.service.engine import Engine
from tangram.service.live import LiveExec
from tangram.service.records import ActionRecord, EngineError

log = logging.getLogger("tangram.service")
# Answers not yet sent beyond which the stream reads nothing more until they are: a client
# that submits and never reads holds its own stream, not the scheduler's memory.
BACKLOG_BYTES = 64 << 20
# Answers of actions admitted before that keep coming. Past this many bytes unsent with
# not one byte taken by the client for STALL_S, it is taken for one that will never read: the
# stream ends (1008), its unsent answers dropped (a keyed action's result stays for a retry
# under its key), and its connection with them (``_close``). A client that reads, however
# slowly, may have more waiting (many large answers at once), up to UNREAD_LIMIT_BYTES.
UNREAD_BYTES = 4 * BACKLOG_BYTES
STALL_S = 30.0
UNREAD_LIMIT_BYTES = 2 * UNREAD_BYTES  # the memory a client's unsent answers may hold
TRANSPORT_EXTENSION = "tangram.transport"  # the ASGI scope's extension holding the connection
CLOSE_WAIT_S = 5.0  # for the close frame of a client cut off, before its connection drops
FRAME_SLACK = 64 << 10  # beyond twice the largest frame a client sends (below)
_ID = re.compile(rb'\s*\{\s*"id"\s*:\s*(\d{1,16})\s*[,}]')  # of a message we cannot parse
_EXEC = re.compile(rb'"exec"\s*:')  # an exec message (not input or a signal)


def _control_kind(message: Any) -> str:
    """A control message is a signal when it gives one, else input: it is checked as
    that alone (a bad signal's error is the signal's, not also "signal: extra input" from
    reading it as input)."""
    if isinstance(message, dict):
        return "signal" if "signal" in message else "input"
    return "signal" if isinstance(message, StreamSignal) else "input"


_Control = Annotated[
    Annotated[StreamInput, Tag("input")] | Annotated[StreamSignal, Tag("signal")],
    Discriminator(_control_kind),
]
_CONTROL: TypeAdapter[StreamInput | StreamSignal] = TypeAdapter(_Control)


def frame_limit(max_request_bytes: int) -> int:
    """The largest frame (or fragmented message) a client's stream may send, in bytes;
    a larger one ends the stream (1009) as it arrives, never assembled. A client packs
    messages into frames of up to ``FRAME_BYTES`` (``wire.pack``), a larger message alone,
    so frames of messages within the pool's ``max_request_bytes`` stay under the larger of
    the two; twice that leaves a message somewhat over the limit its 413 answer, the stream
    going on. The agents' link (``/v1/agents``) has a limit of its own (``embedded``)."""
    return 2 * max(max_request_bytes, FRAME_BYTES) + FRAME_SLACK


class Socket(Protocol):
    """What the stream needs of a WebSocket (Starlette's has it)."""

    async def receive(self) -> Any: ...
    async def send_bytes(self, data: bytes) -> None: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class ActionStream:
    """One client's stream, from the accepted handshake to its end. ``refusal`` admits
    a frame as an HTTP request is admitted: None, or the status and error body to refuse
    its messages with (a token no longer valid, an account the pool no longer admits, a
    review that failed)."""

    def __init__(
        self,
        engine: Engine,
        tenant: str,
        socket: Socket,
        *,
        refusal: Callable[[], Awaitable[tuple[int, dict[str, Any]] | None]],
    ) -> None:
        self.engine, self.tenant, self.socket = engine, tenant, socket
        self._refusal = refusal
        self._outbox: Outbox[bytes] = Outbox(socket.send_bytes, self._send_failed, packed=True)
        self.in_flight = 0  # admitted actions not answered yet
        self._live: dict[int, LiveExec] = {}  # streamed execs running or queued, by id
        self._unkeyed: dict[str, ActionRecord] = {}  # admitted without a key, not ended
        self.closed = False  # (``_abandon``)
        self._watch: asyncio.TimerHandle | None = None  # (``_watch_progress``)
        self._idle = asyncio.Event()
        self._idle.set()

    async def serve(self) -> None:
        try:
            while not self.closed:
                if self._outbox.backlog > BACKLOG_BYTES:
                    await self._outbox.flushed()
                    continue
                msg = await self.socket.receive()
                if msg["type"] == "websocket.disconnect" or self.closed:
                    return  # gone, or its answers can no longer be sent
                data = msg.get("bytes")
                if data is None:
                    data = (msg.get("text") or "").encode()
                lines = [line for line in data.split(b"\n") if line.strip()]
                self._admit(lines, await self._refusal())
        finally:
            self._abandon()

    def _abandon(self) -> None:
        """The client is gone (or taken for gone): nothing more is sent. What it sent
        without a key can never be collected, so it is cancelled while queued, as an HTTP
        request's is, and a streamed exec of it even while it runs (its output has nowhere
        to go, its input no writer: left, an endless one would hold its cores and its
        trajectory for good). A keyed one goes on for the retry under its key, an
        interactive one's input ended."""
        if self.closed:
            return
        self.closed = True
        self._idle.set()
        self._outbox.close()
        if self._watch is not None:
            self._watch.cancel()
        for rec in list(self._unkeyed.values()):
            if rec.started is None or rec.live is not None:  # (ended ones are gone from it)
                self.engine.cancel(self.tenant, rec.id)
        self._unkeyed.clear()
        for live in self._live.values():  # nobody can end their input any more
            if live.interactive:
                live.close_stdin()

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every admitted action is answered and the answers are
        sent, then close: the scheduler is stopping, and admits nothing new."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
                await self._outbox.flushed()
        await self._close(1001, "the scheduler is stopping")

    def _admit(self, lines: list[bytes], refused: tuple[int, dict[str, Any]] | None) -> None:
        """A frame's messages, each admitted or refused as ``refused`` says."""
        for line in lines:
            if self.closed:  # (abandoned while it was admitted: the rest would run for nobody)
                return
            if refused is None:
                self._take(line)
            else:
                self._answer(_line_id(line), *refused)

    def _take(self, line: bytes) -> None:
        """Admit one message, or answer at once why not."""
        limit = self.engine.config.max_request_bytes
        if _EXEC.search(line) is None:  # input or a signal for a streamed exec
            self._control(line, limit)
            return
        if len(line) > limit:
            self._too_large(line, limit)
            return
        try:
            msg = StreamExec.model_validate_json(line)
        except ValidationError as e:
            # Fields named as the HTTP route names them: from the exec body's root, and
            # the body itself "body"; the message's own fields by their names.
            errors = [
                {**err, "loc": ("body", *err["loc"][1:])}
                if err["loc"][:1] == ("exec",)
                else {**err, "loc": ("message", *err["loc"])}
                for err in e.errors(include_url=False)
            ]
            self._answer(_line_id(line), 400, invalid_body(errors, skip=1))
            return
        live = None
        if msg.stream or msg.interactive:
            mid = msg.id
            out = (lambda fd, text: self._output(mid, fd, text)) if msg.stream else None
            live = LiveExec(out, interactive=msg.interactive, room=self._room)
        try:
            rec = self.engine.submit_exec(self.tenant, msg.trajectory, msg.exec, live)
        except EngineError as e:
            self._answer(msg.id, *engine_error(e))
            return
        except Exception:  # one bad message must not end everyone's answers
            log.exception("stream of %s: message %d failed", self.tenant, msg.id)
            self._answer(msg.id, 500, error_body("internal", "the scheduler failed"))
            return
        self.in_flight += 1
        self._idle.clear()
        if live is not None and rec.live is live:  # (a repeat's key keeps the first's)
            self._live[msg.id] = live
        if msg.exec.idempotency_key is None:
            self._unkeyed[rec.id] = rec
        rec.done.add_done_callback(lambda _: self._ended(msg.id, rec))

    def _too_large(self, line: bytes, limit: int) -> None:
        self._answer(_line_id(line), 413, error_body("too_large", f"message over {limit} bytes"))

    def _control(self, line: bytes, limit: int) -> None:
        """Input or a signal for a streamed exec of this stream, by its id. Input is held
        only to the frame's bound, not to ``limit`` (maxRequestBytes): it was read whole
        already, and goes to its command's stdin as that takes it (the client's parts stay
        under a frame, whatever the pool's limit); anything else over ``limit`` is 413."""
        try:
            msg = _CONTROL.validate_json(line)
        except ValidationError as e:
            if len(line) > limit:
                self._too_large(line, limit)
                return
            errors = [  # (its location's first part is the tag: input or signal)
                {**err, "loc": ("message", *err["loc"][1:])} for err in e.errors(include_url=False)
            ]
            self._answer(_line_id(line), 400, invalid_body(errors, skip=1), about="input")
            return
        live = self._live.get(msg.id)
        if live is None:
            body = error_body("not_found", f"id: {msg.id} is no streamed exec running here")
            self._answer(msg.id, 404, body, about="input")
            return
        if isinstance(msg, StreamSignal):
            live.signal(SIGNALS[msg.signal])
            return
        if not live.interactive:
            body = error_body("invalid", f"id: exec {msg.id} was not sent interactive")
            self._answer(msg.id, 400, body, about="input")
            return
        try:
            if msg.stdin:
                live.write(msg.stdin.encode())
        except EngineError as e:
            self._answer(msg.id, *engine_error(e), about="input")
            return
        if msg.eof:
            live.close_stdin()

    async def _room(self) -> None:
        """Until this client's answers waiting to be sent are under the bound again."""
        if self._outbox.backlog > BACKLOG_BYTES:
            await self._outbox.flushed()

    def _output(self, mid: int, fd: str, text: str) -> None:
        if not self.closed:
            self._post(json.dumps({"id": mid, fd: text}, separators=(",", ":")).encode())

    def _post(self, message: bytes) -> None:
        """Queue a message for the client; past ``UNREAD_BYTES`` unsent, watch that it
        reads; past ``UNREAD_LIMIT_BYTES``, end the stream whether it reads or not."""
        self._outbox.post(message)
        backlog = self._outbox.backlog
        if backlog <= UNREAD_BYTES or self.closed:
            return
        if backlog > UNREAD_LIMIT_BYTES:
            self._cut_off(f"over {UNREAD_LIMIT_BYTES >> 20} MiB of answers unread")
        elif self._watch is None:
            self._watch_progress()

    def _watch_progress(self) -> None:
        """Look again in ``STALL_S`` whether any of the answers left meanwhile."""
        taken = self._taken()
        self._watch = asyncio.get_running_loop().call_later(STALL_S, self._looked, taken)

    def _looked(self, taken: int) -> None:
        """Still over ``UNREAD_BYTES`` and nothing taken since ``taken``: the client does
        not read (a slow one takes some bytes now and then, and is watched on)."""
        self._watch = None
        if self.closed or self._outbox.backlog <= UNREAD_BYTES:
            return
        if self._taken() <= taken:
            self._cut_off(f"over {UNREAD_BYTES >> 20} MiB of answers unread for {STALL_S:g} s")
        else:
            self._watch_progress()

    def _taken(self) -> int:
        """How far the client has read: the bytes of the frames written to its connection
        less what the connection still holds of them, so that a large answer read slowly
        counts as it goes (a frame is written whole, and the next waits until it has
        mostly left). Where the server lends no connection, the frames written."""
        transport = _transport(self.socket)
        held = transport.get_write_buffer_size() if transport is not None else 0
        return self._outbox.sent - held

    def _cut_off(self, why: str) -> None:
        log.warning("stream of %s: %s; closing it", self.tenant, why)
        self._abandon()
        self.engine.state.background(self._close(1008, why))

    async def _close(self, code: int, reason: str) -> None:
        """Close, and drop the connection if the close cannot leave: a client that does
        not read keeps the close waiting for room to write it, and the connection open
        behind the answers it never takes, for as long as it likes."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.socket.close(code=code, reason=reason), CLOSE_WAIT_S)
        transport = _transport(self.socket)
        if transport is not None and transport.get_write_buffer_size() > 0:
            transport.abort()  # (unsent bytes dropped, the close frame among them)

    def _ended(self, mid: int, rec: ActionRecord) -> None:
        self._unkeyed.pop(rec.id, None)
        self._live.pop(mid, None)
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()
        if self.closed:
            return  # kept for a retry under its key, if it had one
        if rec.done.cancelled():
            body = error_body("unavailable", "the action was dropped; retry it")
            self._answer(mid, 503, body)
            return
        answer = payload(rec, rec.done.result())
        self._post(b'{"id":%d,"status":200,"result":%b}' % (mid, answer))

    def _answer(
        self, mid: int | None, status: int, body: dict[str, Any], about: str | None = None
    ) -> None:
        """``about``: "input" for a refused input or signal (not the exec's answer)."""
        msg: dict[str, Any] = {"id": mid, "status": status, **body}
        if about is not None:
            msg["about"] = about
        if status in RETRY_STATUS:
            msg["retry_after"] = RETRY_AFTER_S
        self._post(json.dumps(msg, separators=(",", ":")).encode())

    async def _send_failed(self, e: Exception) -> None:
        log.info("stream of %s: send failed (%s); closing it", self.tenant, e)
        self._abandon()
        await self.socket.close(code=1011, reason="send failed")


class _Transport(Protocol):
    def get_write_buffer_size(self) -> int: ...
    def abort(self) -> None: ...


def _transport(socket: Socket) -> _Transport | None:
    """The connection under ``socket``, where the server lends it (``embedded``)."""
    scope = getattr(socket, "scope", None) or {}
    transport = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)
    if hasattr(transport, "abort") and hasattr(transport, "get_write_buffer_size"):
        return transport  # type: ignore[no-any-return]
    return None


def _line_id(line: bytes) -> int | None:
    """The id of a message too broken to validate, when its start says it."""
    match = _ID.match(line[:64])
    return int(match.group(1)) if match else None
