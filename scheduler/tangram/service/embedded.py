"""Embedded mode: the scheduler service and a local node agent in one process.

The agent reaches the scheduler through the same WebSocket endpoint a DaemonSet agent
uses (on 127.0.0.1), so embedded mode runs the cluster's code paths end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request

from tangram.api.wire import AGENTS_PATH
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.link import serve as serve_agent
from tangram.service.app import create_app
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import PoolConfig
from tangram.service.engine import Engine
from tangram.service.learned_file import LearnedStore
from tangram.service.reviews import TokenReviewer
from tangram.service.stream import TRANSPORT_EXTENSION, frame_limit

log = logging.getLogger("tangram.service")


# A request's line and headers, at most: llhttp (httptools) has no bound of its own, and
# uvicorn keeps every header it is sent until the head ends, so one connection could grow
# the scheduler without limit before any token is checked. Far above any real client's.
HEAD_BYTES = 64 << 10
# The agents' link: a reply may be up to 16 MiB of output, escaped (as the agent's own).
AGENT_FRAME_BYTES = 64 << 20

_HTTP: type[asyncio.Protocol] | str  # the HTTP/1.1 protocol uvicorn is given
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools (uvicorn[standard] brings it): h11, bounded by h11 itself
    _HTTP = "h11"
else:

    class _HeadTooLargeError(Exception):
        """Raised from a parser callback: httptools stops parsing there."""

    class _BoundedHead(HttpToolsProtocol):
        """uvicorn's httptools protocol with the request head bounded (``HEAD_BYTES``):
        past it the answer is 431 and the connection closes. Counted twice, since neither
        count sees every head: the URL and header lines as the parser hands them over (a
        head that came in one read; parsing stops at the bound), and the bytes of each
        read from the one after the head began (a header that never ends, which httptools
        keeps growing without a callback: bounded at ``HEAD_BYTES`` plus one read).
        httptools' parsing, unlike h11's, stays."""

        _head = 0  # bytes of the open head: its URL, header names and values
        _read: int | None = None  # bytes read since the read it began in (None: none open)
        _over = False  # refused: the parse error uvicorn reports is this

        def data_received(self, data: bytes) -> None:
            if self._read is not None:
                self._read += len(data)
            super().data_received(data)
            if self._read is not None and self._read > HEAD_BYTES:
                self._over = True
                self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head, self._read = 0, 0

        def on_headers_complete(self) -> None:
            self._read = None
            super().on_headers_complete()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)  # ": " and CRLF
            super().on_header(name, value)

        def _count(self, size: int) -> None:
            self._head += size
            if self._head > HEAD_BYTES:
                self._over = True
                raise _HeadTooLargeError  # (uvicorn takes it for a parse error: below)

        def send_400_response(self, msg: str) -> None:
            if self._over:
                self._refuse_head()
            else:
                super().send_400_response(msg)

        def _refuse_head(self) -> None:
            self._read = None
            if self.transport.is_closing():
                return
            log.info("a request head over %d bytes: 431, connection closed", HEAD_BYTES)
            body = b"request header fields too large"
            head = [b"HTTP/1.1 431 Request Header Fields Too Large\r\n"]
            head += [b"%s: %s\r\n" % kv for kv in self.server_state.default_headers]
            head.append(b"content-type: text/plain; charset=utf-8\r\n")
            head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    _HTTP = _BoundedHead


def _set_frame_limit(conn: Any, size: int) -> None:
    """The largest message ``conn`` (websockets' sans-I/O protocol) reads from its next
    frame on: websockets reads the limit as each frame begins."""
    if hasattr(conn, "max_message_size"):  # later websockets: message and fragment limits
        conn.max_message_size = size
    else:
        conn.max_size = size


def _ws_protocol(engine: Engine) -> type[WebSocketsSansIOProtocol]:
    """uvicorn's websockets-sansio protocol with a frame limit by route: a client's action
    stream reads frames up to ``stream.frame_limit`` of the pool's ``maxRequestBytes`` (as
    the handshake found it), the agents' link up to ``AGENT_FRAME_BYTES``. websockets
    refuses a larger frame from its header, a larger fragmented message at the fragment
    that passes the limit (1009), so neither is ever held whole."""

    class Protocol(WebSocketsSansIOProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Until the path is known, the smaller: what a client pipelines behind its
            # handshake is read under it.
            _set_frame_limit(self.conn, frame_limit(engine.config.max_request_bytes))

        def handle_connect(self, event: Request) -> None:
            super().handle_connect(event)
            scope = getattr(self, "scope", None)  # (none: the handshake was refused)
            if scope is None:
                return
            if scope["path"] == AGENTS_PATH:
                _set_frame_limit(self.conn, AGENT_FRAME_BYTES)
            # The connection, for a stream to drop a client that never reads (ASGI has
            # no way to abort one).
            scope.setdefault("extensions", {})[TRANSPORT_EXTENSION] = self.transport

        async def send(self, message: Any) -> None:
            await super().send(message)
            # A refusal (401, 403, 429 as an HTTP answer) ends the handshake too: uvicorn
            # 0.54 does not count it so and logs an ERROR for each refused client.
            if message["type"] == "websocket.http.response.body" and self.close_sent:
                self.handshake_complete = True

    return Protocol


class _Server(uvicorn.Server):
    """Leaves signals to the caller, whose shutdown closes environments first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True, slots=True)
class Running:
    url: str
    engine: Engine


@dataclass(frozen=True, slots=True)
class Stopping:
    """What a stop waits for, as it begins (``run``'s ``on_stopping``)."""

    grace_s: float
    running: int  # actions in flight, which get up to ``grace_s`` to finish
    environments: int  # trajectories whose environments are removed then (0: kept)


CLOSE_MIN_S = 10.0  # removing the environments, when the actions took the whole grace


def url_host(host: str) -> str:
    """``host`` as the host part of a URL: an IPv6 address in brackets (RFC 3986)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def local_host(host: str) -> str:
    """Where a process of this host reaches a server listening on ``host``: a wildcard
    address is reached on the loopback of its family."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)


def quiet_gc() -> None:
    """Long-lived start-up objects never need collecting again. Young collections every
    10,000 net allocations: with nothing long-lived left tracked (finished actions are
    kept as bytes, ``keys.py``) each stays under ~4 ms at 2,000 actions/s; the default
    700 collected thousands of in-flight requests over and over (benchmarks.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 100)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def run(
    config: PoolConfig,
    tokens: TokenStore,
    agent: NodeAgent | None,
    stop: asyncio.Event,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    on_ready: Callable[[Running], None] | None = None,
    grace_s: float = 10.0,
    close_on_exit: bool = True,
    reviewer: TokenReviewer | None = None,
    learned: LearnedStore | None = None,
    hurry: asyncio.Event | None = None,
    on_stopping: Callable[[Stopping], None] | None = None,
) -> None:
    """Serve until ``stop`` is set; then stop admitting, let in-flight actions finish
    within ``grace_s``, stop the agent. With ``close_on_exit`` (embedded mode) every
    environment is removed, all at once, in what is left of ``grace_s`` (at least
    ``CLOSE_MIN_S``); without it (a scheduler alone) they stay on their nodes for the next
    scheduler to take back. ``hurry`` set (a second Ctrl-C) ends the wait for in-flight
    actions at once: they are cancelled. ``on_stopping`` is told, as the stop begins, what
    it waits for. ``stop`` set before the local agent has joined (one that never can: a
    scheduler it cannot reach) ends the start too. ``learned``: where the scheduler keeps
    what it learned across restarts (read now, saved while it runs and when it stops)."""
    engine = Engine(config)
    if learned is not None:
        engine.keep_learned(learned)
    app = create_app(engine, tokens, reviewer=reviewer)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            http=_HTTP,
            h11_max_incomplete_event_size=HEAD_BYTES,  # (h11: a 400 past it)
            ws=_ws_protocol(engine),
            ws_per_message_deflate=False,
            ws_max_size=AGENT_FRAME_BYTES,  # set again by route (_ws_protocol)
            proxy_headers=False,  # nothing reads the client's address: skip a wrapper a call
        )
    )
    server_task = asyncio.create_task(server.serve())
    while not server.started:
        if server_task.done():
            server_task.result()  # re-raises why it could not start (port in use, ...)
            return
        await asyncio.sleep(0.01)
    url = f"http://{url_host(host)}:{port}"
    agent_stop = asyncio.Event()
    agent_task = None
    hurry = hurry if hurry is not None else asyncio.Event()
    served = False
    try:
        if agent is not None:
            token = tokens.token_for(AGENT_TENANT)
            if token is None:
                raise ValueError(f"the token file has no {AGENT_TENANT} token for the local agent")
            ws_url = f"ws://{url_host(local_host(host))}:{port}/v1/agents"
            agent_task = asyncio.create_task(serve_agent(agent, ws_url, token, agent_stop))
            while agent.node not in engine.hub.links and not stop.is_set():
                if agent_task.done():
                    agent_task.result()  # why the agent ended (a URL it can never reach)
                    raise RuntimeError("the local agent stopped before it joined")
                await asyncio.sleep(0.01)
            engine.all_agents_joined()  # its only agent: nothing else will come
        if not stop.is_set():
            quiet_gc()
            if on_ready is not None:
                on_ready(Running(url, engine))
            served = True
            await stop.wait()
    finally:
        told = on_stopping if served else None
        await _stop(engine, app, grace_s, close=close_on_exit, hurry=hurry, told=told)
        agent_stop.set()
        if agent_task is not None:
            await asyncio.gather(agent_task, return_exceptions=True)
        if agent is not None:
            await agent.shutdown()
        server.should_exit = True
        await server_task


async def _stop(
    engine: Engine,
    app: Any,
    grace_s: float,
    *,
    close: bool,
    hurry: asyncio.Event,
    told: Callable[[Stopping], None] | None,
) -> None:
    """In-flight actions get their grace before their trajectories close (a close cancels
    what still runs in it); the closes run together; ``hurry`` cuts the grace short."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    if told is not None:
        told(Stopping(grace_s, engine.running(), len(engine.trajectories) if close else 0))
    await engine.wind_down(grace_s, hurry)
    closing = list(engine.trajectories.values()) if close else []
    if closing:
        closes = [asyncio.create_task(engine.close_trajectory(r.tenant, r.id)) for r in closing]
        _, late = await asyncio.wait(closes, timeout=max(deadline - loop.time(), CLOSE_MIN_S))
        for task in late:
            task.cancel()
        await asyncio.gather(*closes, return_exceptions=True)
        if late:
            log.warning("%d environment(s) were not removed in time", len(late))
    # Streamed actions get their answers as HTTP requests do (the server waits for those):
    # each stream closes once it has answered what it admitted.
    left = max(deadline - loop.time(), 0.0)
    await asyncio.gather(*(s.drain(left) for s in list(app.streams)), return_exceptions=True)
