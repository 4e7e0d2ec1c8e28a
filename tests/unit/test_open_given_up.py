"""An open its client gave up on (cancelled, timed out) closed by its idempotency key,
``DELETE /v1/trajectories/key:<key>``, driven through the real hub, links and engine by a
fake agent socket: whatever that open made or makes is closed, and an open of the key
that comes later, or an environment an agent hands back under it, opens nothing."""

from __future__ import annotations

import asyncio

import pytest

from tangram.api.wire import AgentReply, OpenTrajectory, TrajectoryMeta, TrajectoryState
from tangram.service.engine import Engine
from tangram.service.records import EngineError
from tests.fixtures.fake_agent import Agent, answer_all, connect, hello, run, settle


def _memory_used(engine: Engine) -> float:
    return engine.core.cpu.nodes["n1"].memory_used_gb


def _keyed(key: str) -> OpenTrajectory:
    return OpenTrajectory(env="e", idempotency_key=key)


def test_an_open_under_way_is_closed_once_its_agent_has_made_it() -> None:
    async def scenario(engine: Engine) -> None:
        agent = Agent(hello(), lambda m: None if m["op"] == "open" else answer_all(m))
        await connect(engine, agent)
        opening = asyncio.ensure_future(engine.open_trajectory("u", _keyed("k/1")))
        assert await settle(lambda: bool(agent.ops("open")))
        info = await engine.close_opened("u", "k/1")  # answered at once: closing
        assert info.state is TrajectoryState.CLOSING
        assert not agent.ops("close")
        agent.push(AgentReply(rid=agent.ops("open")[0]["rid"], ok=True, opened_s=0.0))
        with pytest.raises(EngineError, match="closed while it opened"):
            await opening
        assert await settle(lambda: not engine.state.trajectories)
        made = agent.ops("open")[0]["trajectory"]
        assert [m["trajectory"] for m in agent.ops("close")] == [made]
        assert _memory_used(engine) == 0

    run(scenario)


def test_an_opened_trajectory_is_closed_and_its_key_opens_nothing_more() -> None:
    async def scenario(engine: Engine) -> None:
        agent = Agent(hello())
        await connect(engine, agent)
        rec = await engine.open_trajectory("u", _keyed("k"))
        info = await engine.close_opened("u", "k")
        assert (info.id, info.state) == (rec.id, TrajectoryState.CLOSED)
        assert [m["trajectory"] for m in agent.ops("close")] == [rec.key]
        again = await engine.close_opened("u", "k")  # a retry: the closed one again
        assert (again.id, again.state) == (rec.id, TrajectoryState.CLOSED)
        with pytest.raises(EngineError, match="has since ended"):
            await engine.open_trajectory("u", _keyed("k"))
        # Another tenant's key of that name is not this one's.
        with pytest.raises(EngineError) as other:
            await engine.close_opened("v", "k")
        assert (other.value.kind, other.value.field) == ("not_found", "idempotency_key")
        assert len(agent.ops("open")) == 1 and _memory_used(engine) == 0

    run(scenario)


def test_a_key_given_up_before_its_open_came_refuses_that_open() -> None:
    """The close by key can come first: the open was sent on another connection."""

    async def scenario(engine: Engine) -> None:
        agent = Agent(hello())
        await connect(engine, agent)
        with pytest.raises(EngineError) as unknown:
            await engine.close_opened("u", "late")
        assert (unknown.value.kind, unknown.value.field) == ("not_found", "idempotency_key")
        with pytest.raises(EngineError, match="given up by its client") as refused:
            await engine.open_trajectory("u", _keyed("late"))
        assert (refused.value.kind, refused.value.field) == ("conflict", "idempotency_key")
        assert not agent.ops("open") and not engine.state.trajectories
        await engine.open_trajectory("u", _keyed("other"))  # other keys open as before
        assert len(agent.ops("open")) == 1

    run(scenario)


def test_a_key_given_up_on_a_restarted_scheduler_closes_what_its_agent_brings_back() -> None:
    """The open's answer was lost with the scheduler, and its client gave the open up
    before the agent that made it was back: handed back, it is closed, not taken."""

    async def scenario(engine: Engine) -> None:
        made = TrajectoryMeta(id="t-made", tenant="u", env="e", open_key="k",
                              open_digest=OpenTrajectory(env="e").digest())  # fmt: skip
        with pytest.raises(EngineError):
            await engine.close_opened("u", "k")
        back = Agent(hello(trajectories=[made]))
        await connect(engine, back)
        assert [m["trajectory"] for m in back.ops("close")] == ["t-made"]
        assert not engine.state.trajectories and _memory_used(engine) == 0

    run(scenario, reconnecting=True)
