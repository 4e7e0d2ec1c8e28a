"""The agent's side of one scheduler link: a request it cannot read (a newer scheduler's,
say) is refused with why, and the link goes on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tangram.api.wire import AgentClose, AgentReply, unpack
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.link import _session


class _Scheduler:
    """A link that delivers ``frames`` then waits; what the agent sends is kept."""

    subprotocol = None  # one message a frame

    def __init__(self, frames: list[str]) -> None:
        self.frames = list(frames)
        self.sent: list[dict[str, object]] = []

    async def send(self, frame: str) -> None:
        self.sent.extend(json.loads(t) for t in unpack(frame))

    async def recv(self, decode: bool = True) -> str:
        if self.frames:
            return self.frames.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def replies(self) -> dict[object, dict[str, object]]:
        return {m["rid"]: m for m in self.sent if "rid" in m}


def test_a_request_the_agent_cannot_read_is_refused_and_the_link_goes_on(
    tmp_path: Path,
) -> None:
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    scheduler = _Scheduler([
        json.dumps({"op": "teleport", "rid": 7, "where": "mars"}),  # a later release's op
        "not json at all",
        AgentClose(rid=8, trajectory="t-none").model_dump_json(),  # read after them
    ])  # fmt: skip
    stop = asyncio.Event()

    async def go() -> None:
        session = asyncio.ensure_future(_session(agent, scheduler, stop))  # type: ignore[arg-type]
        while 8 not in scheduler.replies():
            assert not session.done(), session  # the link did not end
            await asyncio.sleep(0.01)
        stop.set()
        await session

    asyncio.run(asyncio.wait_for(go(), 30))  # (a guard against a hang)
    refused = AgentReply.model_validate(scheduler.replies()[7])
    assert not refused.ok and "cannot read the request" in (refused.error or "")
    assert AgentReply.model_validate(scheduler.replies()[8]).ok
