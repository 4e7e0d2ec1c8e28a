"""The scheduler's side of the node-agent protocol: one WebSocket per agent.

An agent connects, says hello (its node, inventory, cores, re-adopted environments), then
answers ``AgentRequest``s with ``AgentReply``s carrying the same ``rid`` and sends a
heartbeat every second. The hub keeps one ``AgentLink`` per node; a link that stops
talking for the pool's heartbeat timeout is closed and its node drained.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import Any, Protocol

from starlette.websockets import WebSocketDisconnect

from tangram.api.wire import (
    AGENT_LEAVING,
    STREAM_CHUNK,
    STREAM_WINDOW,
    AgentCancel,
    AgentExec,
    AgentFiles,
    AgentHello,
    AgentInput,
    AgentReply,
    AgentRequest,
    credit_json,
    input_json,
    unpack,
)
from tangram.client.outbox import Outbox

log = logging.getLogger("tangram.service")
HEARTBEAT = '{"heartbeat"'  # how an agent's heartbeat message starts
CANCEL_WAIT_S = 5.0  # how long a cancelled request waits for its command to be gone
# The action the requests sent from this context are for (an action's task sets it for
# itself): what a leaving agent's link says it answered (``AgentLink.answered``).
ACTION: ContextVar[str | None] = ContextVar("tangram_action", default=None)


class Socket(Protocol):
    """What the link needs of a WebSocket (Starlette's has it)."""

    async def send_text(self, data: str) -> None: ...
    async def receive_text(self) -> str: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class AgentGoneError(RuntimeError):
    """The agent's connection ended while a request was outstanding."""


class RequestNotTakenError(AgentGoneError):
    """The agent answered that it took the request not: its stop had begun before the
    request came (its heartbeat saying so crossed the request). Nothing of it ran."""


class RunCancelled(asyncio.CancelledError):
    """A request cancelled whose agent answered with what it ran (``reply``: an exec's
    output so far and how long it ran, ``reply.cancelled``)."""

    def __init__(self, reply: AgentReply) -> None:
        super().__init__("cancelled")
        self.reply = reply


class NodeRefusedError(RuntimeError):
    """A node that cannot run actions, by its agent's own account (its hello's problem):
    the pool does not take it; the cause shows on the pool's status."""


def _answered(fut: asyncio.Future[AgentReply]) -> AgentReply | None:
    return fut.result() if fut.done() and not fut.cancelled() and not fut.exception() else None


class AgentLink:
    """One agent's connection. Requests are queued and written by one writer task, a
    frame per loop tick when the agent reads packed frames (``packed``, ``Outbox``)."""

    def __init__(
        self,
        hello: AgentHello,
        socket: Socket,
        on_orphan: Callable[[str, AgentReply], None] = lambda node, reply: None,
        *,
        packed: bool = False,
        on_leaving: Callable[[AgentLink], None] = lambda link: None,
    ) -> None:
        self.hello = hello
        self.on_orphan = on_orphan
        self.on_leaving = on_leaving  # told once, when its agent says it stops
        self.node = hello.node
        self.socket = socket
        self.packed = packed
        self.last_seen = time.monotonic()
        self._rid = 0
        self._pending: dict[int, asyncio.Future[AgentReply]] = {}
        self._owners: dict[int, str] = {}  # the action each request is for, if any
        # The actions whose replies came once its agent said it leaves (and those it
        # answered not taken, its stop begun): its last replies, which may still be on
        # their way to their waiters as the link closes (a shield, a stream, a call's own
        # task, a busy loop). Its node's leave leaves these actions to their waiters,
        # which end them with the reply, not as lost with it.
        self.answered: set[str] = set()
        self._streams: dict[int, LinkStream] = {}
        self._outbox: Outbox[str] = Outbox(self._send, self._send_failed, packed=packed)
        self.closed = False
        self.leaving = False  # its agent said it stops on purpose (``AGENT_LEAVING``)

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    async def request(self, req: AgentRequest) -> AgentReply:
        """Send ``req`` under this link's next request id and wait for its reply."""
        rid, fut = self._start(req)
        try:
            # Shielded: cancelling this request must not cancel ``fut``, which the wait
            # below still needs.
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self.cancel(rid, fut, CANCEL_WAIT_S)
            if (reply := _answered(fut)) is not None and reply.cancelled:
                raise RunCancelled(reply) from None
            raise
        finally:
            self._forget(rid)

    def _start(self, req: AgentRequest) -> tuple[int, asyncio.Future[AgentReply]]:
        """Send ``req`` under the next request id: the id, and the future of its reply."""
        req = req.model_copy(update={"rid": self.next_rid()})
        fut: asyncio.Future[AgentReply] = asyncio.get_running_loop().create_future()
        self._post(req.model_dump_json())
        self._pending[req.rid] = fut
        if (owner := ACTION.get()) is not None:
            self._owners[req.rid] = owner
        return req.rid, fut

    async def cancel(self, rid: int, reply: asyncio.Future[AgentReply], wait_s: float) -> None:
        """Cancel request ``rid`` and wait (bounded) for its reply, the agent's word that
        what it ran is gone: its cores must not be handed out while it still runs. The
        wait runs its course even if the caller is cancelled again meanwhile (a second
        cancel of the action): it is what keeps the cores held, and it is bounded."""
        if reply.done() or self.closed:
            return
        with contextlib.suppress(Exception):  # (an exec's agent answers with its output)
            self.send(AgentCancel(rid=self.next_rid(), target=rid, output=True))
        await _uninterrupted(_bounded(reply, wait_s))

    def stream(self, req: AgentFiles | AgentExec) -> LinkStream:
        """Send ``req``, a streamed request: its chunks and its reply come through the
        ``LinkStream``, which must be closed."""
        rid, fut = self._start(req)
        stream = self._streams[rid] = LinkStream(self, rid, fut)
        return stream

    def _forget(self, rid: int) -> None:
        self._pending.pop(rid, None)
        self._streams.pop(rid, None)
        self._owners.pop(rid, None)

    def send(self, req: AgentCancel | AgentInput) -> None:
        """Fire and forget (cancel requests, a stream's input): queued in order, sent by
        the writer."""
        self._post(req.model_dump_json())

    def _post(self, text: str) -> None:
        if self.closed:
            raise AgentGoneError(f"node {self.node}: its agent is gone")
        self._outbox.post(text)

    async def _send(self, frame: str) -> None:
        await self.socket.send_text(frame)

    async def _send_failed(self, e: Exception) -> None:
        """Nothing sent will be answered: end the link, drain the node."""
        log.warning("node %s: the link failed while sending: %s", self.node, e)
        self.fail_pending()
        await self.socket.close(code=1011, reason="send failed")

    async def receive_forever(self) -> None:
        """Route replies to their requests until the connection ends."""
        try:
            while True:
                frame = await self.socket.receive_text()
                self.last_seen = time.monotonic()
                for text in unpack(frame):  # an agent that does not pack sends one a frame
                    if text.startswith(HEARTBEAT):
                        if text == AGENT_LEAVING:
                            self._stops()
                        continue
                    reply = AgentReply.model_validate_json(text)
                    stream = self._streams.get(reply.rid)
                    if reply.more:  # a streamed request's chunk (or credit)
                        if stream is not None:
                            stream.arrived(reply)
                        continue
                    fut = self._pending.get(reply.rid)
                    if fut is not None and not fut.done() and reply.not_taken:
                        self._stops()  # (its word that it stops may still be on its way)
                        why = f"node {self.node}: {reply.error or 'its agent is stopping'}"
                        fut.set_exception(RequestNotTakenError(why))
                        if owner := self._owners.get(reply.rid):
                            self.answered.add(owner)
                        if stream is not None:
                            stream.ended()
                    elif fut is not None and not fut.done():
                        fut.set_result(reply)
                        if self.leaving and (owner := self._owners.get(reply.rid)):
                            self.answered.add(owner)
                        if stream is not None:
                            stream.ended()
                    elif reply.rid == 0 and (reply.key or reply.lost or reply.warm_failed):
                        # A run that outlived the link that asked for it, an environment
                        # that ended by itself, or a warm one that could not be made.
                        self.on_orphan(self.node, reply)
        finally:
            self.fail_pending()

    def _stops(self) -> None:
        """Its agent stops on purpose (it said so, or answered a request not taken):
        once, its node takes no new work."""
        if not self.leaving:
            self.leaving = True
            self.on_leaving(self)

    def fail_pending(self) -> None:
        self.closed = True
        self._outbox.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(AgentGoneError(f"node {self.node}: the agent disconnected"))
        for stream in self._streams.values():
            stream.ended()


class LinkStream:
    """A streamed request on an agent link: the chunks it sends (each acknowledged once
    taken, so more may come) and the input it takes, within ``STREAM_WINDOW`` chunks
    unacknowledged each way; then its reply."""

    def __init__(self, link: AgentLink, rid: int, reply: asyncio.Future[AgentReply]) -> None:
        self.link, self.rid, self._reply = link, rid, reply
        self._chunks: asyncio.Queue[AgentReply | None] = asyncio.Queue()
        self._window = asyncio.Semaphore(STREAM_WINDOW)  # input chunks not yet taken
        self._ended = False
        self._closed = False

    def arrived(self, chunk: AgentReply) -> None:
        for _ in range(chunk.credit):
            self._window.release()
        if chunk.data is not None or chunk.files is not None:
            self._chunks.put_nowait(chunk)

    def ended(self) -> None:
        """The reply came (or the link went): wake whoever waits on this stream."""
        self._ended = True
        self._chunks.put_nowait(None)
        self._window.release()

    async def reply(self) -> AgentReply:
        return await self._reply

    def answered(self) -> AgentReply | None:
        """Its reply, if it has come (None: not yet, or the link went)."""
        return _answered(self._reply)

    async def next(self) -> AgentReply | None:
        """The next chunk with a head or data (its data acknowledged); None at the end."""
        chunk = await self._chunks.get()
        if chunk is None:
            self._chunks.put_nowait(None)  # stays ended for the next caller
        elif chunk.data is not None and not self.link.closed:
            self.link._post(credit_json(self.rid))  # (once a chunk: no model's serializer)
        return chunk

    async def data(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next()) is not None:
            if chunk.data is not None:
                yield base64.b64decode(chunk.data)

    async def send(self, data: bytes) -> bool:
        """Input, in chunks within the window; False once the request has ended (it
        failed: its reply says why)."""
        for start in range(0, len(data), STREAM_CHUNK):
            await self._window.acquire()
            if self._ended:
                return False
            self.link._post(input_json(self.rid, data[start : start + STREAM_CHUNK]))
        return not self._ended

    def end_input(self) -> None:
        self.link.send(AgentInput(target=self.rid, eof=True))

    def signal(self, number: int) -> None:
        """A signal for a streamed exec's command."""
        self.link.send(AgentInput(target=self.rid, signal=number))

    async def close(self, wait_s: float = 0.0) -> None:
        """Done with it: a request still running is cancelled, once, and waited for up to
        ``wait_s`` (the agent's word that what it ran is gone); later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.link.cancel(self.rid, self._reply, wait_s)
        finally:
            self.link._forget(self.rid)


class AgentHub:
    """Live links by node; tells the engine when nodes come and go."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.links: dict[str, AgentLink] = {}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._on_join: Callable[[AgentLink], Awaitable[None]] = _nothing
        self._on_leave: Callable[[AgentLink], Awaitable[None]] = _nothing
        self._on_orphan: Callable[[str, AgentReply], None] = lambda node, reply: None
        self._on_second: Callable[[str, str], None] = lambda node, why: None
        self._on_leaving: Callable[[AgentLink], None] = lambda link: None

    def attach(
        self,
        on_join: Callable[[AgentLink], Awaitable[None]],
        on_leave: Callable[[AgentLink], Awaitable[None]],
        on_orphan: Callable[[str, AgentReply], None],
        on_second: Callable[[str, str], None] | None = None,
        on_leaving: Callable[[AgentLink], None] | None = None,
    ) -> None:
        """Who hears of nodes joining (it may refuse one by raising) and leaving, of
        replies no request awaits (runs that outlived their link, lost environments), of
        a second agent refused for a node another one serves (``on_second``: node, why),
        and of an agent that says it stops (``on_leaving``: its link, still open, whose
        node then leaves as the link closes)."""
        self._on_join, self._on_leave, self._on_orphan = on_join, on_leave, on_orphan
        if on_second is not None:
            self._on_second = on_second
        if on_leaving is not None:
            self._on_leaving = on_leaving

    async def serve(self, socket: Socket, *, packed: bool = False) -> None:
        """Run one agent's connection from its hello to its end; ``packed``: the agent
        took the subprotocol that lets a frame hold several messages."""
        hello = AgentHello.model_validate_json(await socket.receive_text())
        old = self.links.get(hello.node)
        if old is not None and old.hello.agent and hello.agent and old.hello.agent != hello.agent:
            # Another agent for the same node (a pool's CPU and GPU agents on one node): the
            # two would take each other's place at every reconnect. The one serving stays.
            why = (
                f"node {hello.node}: agent {hello.agent} refused, agent {old.hello.agent} "
                "of this pool serves the node (a pool's CPU and GPU agents on one node: give "
                "spec.cpu.nodeSelector and spec.gpu.nodeSelector different nodes)"
            )
            log.warning("%s", why)
            self._on_second(hello.node, why)
            await socket.close(code=1008, reason="another agent of this pool serves the node")
            return
        if old is not None:  # a reconnect: the old link is dead even if TCP has not noticed
            await self._leave(old)
        link = AgentLink(hello, socket, self._on_orphan, packed=packed,
                         on_leaving=self._on_leaving)  # fmt: skip
        self.links[hello.node] = link
        try:
            await self._on_join(link)
        except Exception as e:  # a node the pool cannot take: refuse it, keep no dead link
            if isinstance(e, NodeRefusedError):  # by its own account: its log says why
                log.warning("node %s refused: %s", hello.node, e)
                code, reason = 1008, "the node cannot run actions: see its agent's log"
            else:
                log.exception("node %s could not join", hello.node)
                code, reason = 1011, "could not join the pool"
            del self.links[hello.node]
            link.fail_pending()
            await socket.close(code=code, reason=reason)
            return
        try:
            await link.receive_forever()
        except WebSocketDisconnect:
            pass  # the agent went away: drained below
        except Exception:  # a message we cannot read: drop the link, drain the same way
            log.exception("node %s: bad message from its agent; dropping the link", link.node)
        finally:
            if self.links.get(hello.node) is link:
                await self._leave(link)

    async def watch(self) -> None:
        """Drain nodes whose agents went silent (a partition, a hung agent)."""
        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 4)
            now = time.monotonic()
            for link in list(self.links.values()):
                if now - link.last_seen > self.heartbeat_timeout_s:
                    await self._leave(link)
                    with contextlib.suppress(Exception):
                        await link.socket.close(code=1011, reason="heartbeat timeout")

    async def _leave(self, link: AgentLink) -> None:
        if self.links.get(link.node) is link:
            del self.links[link.node]
        link.fail_pending()
        await self._on_leave(link)


async def _nothing(link: AgentLink) -> None:
    return None


async def _bounded(reply: asyncio.Future[AgentReply], wait_s: float) -> None:
    """Wait up to ``wait_s`` for ``reply`` (left as it is), whatever it ends with."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(reply), wait_s)


async def _uninterrupted(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` to its end even if the caller is cancelled meanwhile, once or many
    times; a cancel that came is raised once ``work`` has ended."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
