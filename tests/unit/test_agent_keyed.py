"""Results of keyed runs reported unasked (their requester's link dropped) reach the next
link: a run whose requester is cancelled in the very tick it ends (it used to raise
KeyError: the run was done but its done-callback, which keeps the result, had not run
yet), and a result a link took but could not send (it used to be lost)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tangram.api.wire import AGENT_SUBPROTOCOL, AgentReply, AgentRequest
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.link import _session


def test_a_requester_cancelled_as_its_keyed_run_ends_still_gets_it_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)

    async def go() -> list[AgentReply]:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def run(req: AgentRequest) -> AgentReply:
            await gate
            return AgentReply(rid=req.rid, ok=True)

        monkeypatch.setattr(agent, "_run", run)
        req = AgentRequest(op="exec", rid=7, trajectory="t", argv=["true"], key="k")
        requester = asyncio.create_task(agent._once(req, "k"))
        await asyncio.sleep(0)  # the run started and waits at the gate
        gate.set_result(None)  # the run ends in the next step ...
        requester.cancel()  # ... and its requester wakes, cancelled, right after it
        with pytest.raises(asyncio.CancelledError):
            await requester
        await asyncio.sleep(0)
        got: list[AgentReply] = []
        agent.attach(got.append)  # the next link
        return got

    (reply,) = asyncio.run(go())
    assert reply.ok and reply.key == "k" and reply.rid == 0


class _DroppingLink:
    """A scheduler link whose first send fails: the connection dropped under it."""

    subprotocol = AGENT_SUBPROTOCOL

    async def send(self, frame: str) -> None:
        raise ConnectionError("the link dropped")

    async def recv(self, decode: bool = True) -> str:
        await asyncio.Event().wait()  # the scheduler asks nothing
        raise AssertionError("unreachable")


def test_an_unasked_result_a_link_could_not_send_goes_to_the_next_link(tmp_path: Path) -> None:
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    orphan = AgentReply(rid=0, ok=True, key="k")

    async def go() -> list[AgentReply]:
        agent.keep_unsent(orphan)  # finished while no link was up
        with pytest.raises(ConnectionError):
            await _session(agent, _DroppingLink(), asyncio.Event())  # type: ignore[arg-type]
        got: list[AgentReply] = []
        agent.attach(got.append)  # the next link
        return got

    assert asyncio.run(go()) == [orphan]
