"""The agent's side of the link to the scheduler: one WebSocket, reconnected when lost.

Register with a hello, answer each request on its own task (replies carry the request's
``rid``), send a heartbeat every second. When the connection drops, every request in
flight is cancelled — a command nobody waits for holds cores nobody accounts for — and
the agent reconnects with backoff; its environments stay, and the hello of the next
connection lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from tangram.api.wire import AgentReply, AgentRequest
from tangram.node_agent.agent import NodeAgent

log = logging.getLogger("tangram.agent")
HEARTBEAT_S = 1.0


async def serve(agent: NodeAgent, url: str, token: str, stop: asyncio.Event) -> None:
    """Serve the scheduler at ``url`` (ws://host:port/v1/agents) until ``stop`` is set."""
    backoff = 0.1
    while not stop.is_set():
        try:
            async with websockets.connect(
                url,
                additional_headers={"Authorization": f"Bearer {token}"},
                max_size=64 << 20,
                ping_interval=None,  # our heartbeats do it, at the pool's pace
                compression=None,  # small JSON messages: deflate costs more than it saves
                open_timeout=10,
            ) as ws:
                backoff = 0.1
                gc.collect()
                gc.freeze()  # start-up objects are forever: keep collections short
                await ws.send(agent.hello().model_dump_json())
                log.info("connected to %s as %s", url, agent.node)
                await _session(agent, ws, stop)
        except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError) as e:
            if stop.is_set():
                break
            log.warning("scheduler link: %s; retrying in %.1fs", e, backoff)
        except Exception:  # a bug in one session must not end the agent: reconnect
            log.exception("scheduler link failed; retrying in %.1fs", backoff)
        if not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, 5.0)


async def _session(agent: NodeAgent, ws: websockets.ClientConnection, stop: asyncio.Event) -> None:
    tasks: set[asyncio.Task[None]] = set()
    lock = asyncio.Lock()

    async def send(text: str) -> None:
        async with lock:
            await ws.send(text)

    async def answer(req: AgentRequest) -> None:
        reply = await agent.handle(req)
        with contextlib.suppress(ConnectionClosed):
            await send(reply.model_dump_json())

    async def heartbeat() -> None:
        while True:
            await send('{"heartbeat":true}')
            await asyncio.sleep(HEARTBEAT_S)

    def orphan(reply: AgentReply) -> None:  # a run that finished after its link dropped
        task = asyncio.ensure_future(send(reply.model_dump_json()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    beats = asyncio.create_task(heartbeat())
    stopping = asyncio.create_task(stop.wait())
    agent.attach(orphan)
    try:
        while True:
            recv = asyncio.ensure_future(ws.recv())
            done, _ = await asyncio.wait(
                {recv, stopping, beats}, return_when=asyncio.FIRST_COMPLETED
            )
            if recv not in done:
                recv.cancel()
                if beats in done:
                    beats.result()  # re-raises why the heartbeat stopped
                return
            req = AgentRequest.model_validate_json(recv.result())
            task = asyncio.create_task(answer(req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        agent.detach()
        beats.cancel()
        stopping.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, beats, return_exceptions=True)
