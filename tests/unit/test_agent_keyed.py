"""A keyed run whose requester is cancelled in the very tick the run ends: its result is
still reported, unasked, on the next link (it used to raise KeyError: the run was done
but its done-callback, which keeps the result, had not run yet)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tangram.api.wire import AgentReply, AgentRequest
from tangram.node_agent.agent import NodeAgent


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
