"""The agent link over a real WebSocket to the real scheduler service: a current agent
takes the packing subprotocol and the execs of one scheduling round reach it in one frame;
an agent of an earlier release, which offers no subprotocol, still gets and sends one
message a frame, so a rolling upgrade of the DaemonSet keeps working."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import websockets

from tangram.api.wire import EnvSpec, parse_agent_request, unpack
from tangram.client import ActionStatus, Client
from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import EnvConfig, PoolConfig

from .service_harness import service, until

pytestmark = [pytest.mark.xdist_group("service")]
CONFIG = PoolConfig(envs={"noop": EnvConfig(spec=EnvSpec(name="noop", image="none"))})
N = 6  # execs in one batch: one round places them all


class Frames:
    """Wraps the scheduler's socket to the agent: what each frame it sent held."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.frames: list[list[str]] = []

    async def send_text(self, data: str) -> None:
        self.frames.append(unpack(data))
        await self.socket.send_text(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def _batch_of_execs(client: Client) -> list[str]:
    ids = [client.open("noop").id for _ in range(N)]
    results = client.batch([{"trajectory": t, "exec": {"argv": ["true"]}} for t in ids])
    assert [r.status for r in results] == [ActionStatus.OK] * N
    return ids


def test_a_current_agent_gets_the_execs_of_one_round_in_one_frame(tmp_path: Path) -> None:
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=N)
    with service(CONFIG, agent, tmp_path) as (running, token), Client(running.url, token) as c:
        link = running.engine.hub.links[agent.node]
        assert link.packed  # the real agent offered the subprotocol and the scheduler took it
        frames = Frames(link.socket)
        link.socket = frames
        _batch_of_execs(c)
        ops = [[parse_agent_request(m).op for m in f] for f in frames.frames]
        assert [f for f in ops if "exec" in f] == [["exec"] * N]


async def _old_agent(agent: NodeAgent, url: str, token: str, stop: threading.Event) -> None:
    """An agent link as releases before the subprotocol spoke it: no subprotocol offered,
    each request read as exactly one message, each reply sent in its own frame."""
    async with websockets.connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, compression=None
    ) as ws:
        assert ws.subprotocol is None  # the scheduler did not impose one
        await ws.send(agent.hello().model_dump_json())

        async def answer(text: str) -> None:
            reply = await agent.handle(parse_agent_request(text))
            await ws.send(reply.model_dump_json())

        tasks = set()
        while not stop.is_set():
            try:
                text = await asyncio.wait_for(ws.recv(), 0.2)
            except TimeoutError:
                await ws.send('{"heartbeat":true}')
                continue
            assert isinstance(text, str) and "\n" not in text  # one message a frame
            task = asyncio.create_task(answer(text))
            tasks.add(task)
            task.add_done_callback(tasks.discard)


def test_an_agent_of_an_earlier_release_gets_one_message_a_frame(tmp_path: Path) -> None:
    tokens = TokenStore.create(tmp_path / "tokens")
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=N)
    agent_token = tokens.token_for(AGENT_TENANT)
    assert agent_token is not None
    stop, failure = threading.Event(), []

    with service(CONFIG, None, tmp_path, tokens=tokens) as (running, token):
        url = running.url.replace("http://", "ws://") + "/v1/agents"

        def old() -> None:
            try:
                asyncio.run(_old_agent(agent, url, agent_token, stop))
            except BaseException as e:  # surfaced below
                failure.append(e)

        thread = threading.Thread(target=old, daemon=True)
        thread.start()
        until(lambda: agent.node in running.engine.hub.links or bool(failure), "no agent")
        assert not running.engine.hub.links[agent.node].packed
        with Client(running.url, token) as c:
            ids = _batch_of_execs(c)
            for t in ids:
                c.close(t)
        stop.set()
        thread.join(10)
    assert not failure, failure
