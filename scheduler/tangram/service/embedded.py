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

import uvicorn

from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.link import serve as serve_agent
from tangram.service.app import create_app
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import PoolConfig
from tangram.service.engine import Engine
from tangram.service.learned_file import LearnedStore
from tangram.service.reviews import TokenReviewer

log = logging.getLogger("tangram.service")


class _Server(uvicorn.Server):
    """Leaves signals to the caller, whose shutdown closes environments first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True, slots=True)
class Running:
    url: str
    engine: Engine


def quiet_gc() -> None:
    """Long-lived start-up objects never need collecting again. Young collections every
    10,000 net allocations: with nothing long-lived left tracked (finished actions are
    kept as bytes, ``keys.py``) each stays under ~4 ms at 2,000 actions/s; the default
    700 collected thousands of in-flight requests over and over (benchmarks.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 100)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
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
) -> None:
    """Serve until ``stop`` is set; then stop admitting, let in-flight actions finish
    within ``grace_s``, stop the agent. With ``close_on_exit`` (embedded mode) every
    environment is removed; without it (a scheduler alone) they stay on their nodes for
    the next scheduler to take back. ``learned``: where the scheduler keeps what it
    learned across restarts (read now, saved while it runs and when it stops)."""
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
            ws="websockets-sansio",
            ws_per_message_deflate=False,
            ws_max_size=64 << 20,  # as the agent's: a reply may be up to 16 MiB of output
            proxy_headers=False,  # nothing reads the client's address: skip a wrapper a call
        )
    )
    server_task = asyncio.create_task(server.serve())
    while not server.started:
        if server_task.done():
            server_task.result()  # re-raises why it could not start (port in use, ...)
            return
        await asyncio.sleep(0.01)
    url = f"http://{host}:{port}"
    agent_stop = asyncio.Event()
    agent_task = None
    if agent is not None:
        token = tokens.token_for(AGENT_TENANT)
        if token is None:
            raise ValueError(f"the token file has no {AGENT_TENANT} token for the local agent")
        ws_url = f"ws://{host}:{port}/v1/agents"
        agent_task = asyncio.create_task(serve_agent(agent, ws_url, token, agent_stop))
        while agent.node not in engine.hub.links:
            if agent_task.done():
                agent_task.result()
            await asyncio.sleep(0.01)
        engine.all_agents_joined()  # its only agent: nothing else will come
    quiet_gc()
    if on_ready is not None:
        on_ready(Running(url, engine))
    try:
        await stop.wait()
    finally:
        # In-flight actions get their grace before their trajectories close (a close
        # cancels what still runs in it).
        await engine.wind_down(grace_s)
        for rec in list(engine.trajectories.values()) if close_on_exit else []:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(engine.close_trajectory(rec.tenant, rec.id), grace_s)
        # Streamed actions get their answers as HTTP requests do (the server waits for
        # those): each stream closes once it has answered what it admitted.
        await asyncio.gather(*(s.drain(grace_s) for s in list(app.streams)), return_exceptions=True)
        agent_stop.set()
        if agent_task is not None:
            await asyncio.gather(agent_task, return_exceptions=True)
        if agent is not None:
            await agent.shutdown()
        server.should_exit = True
        await server_task
