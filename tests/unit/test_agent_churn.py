"""Agents that drop and come back, driven through the real hub, links and engine by a fake
agent socket: nothing closed comes back to life, an environment that must go goes once its
agent can be told, and a keyed run cut off by the link keeps its outcome the agent's."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tangram.api.wire import (
    ActionStatus,
    AgentReply,
    ExecOutcome,
    ExecRequest,
    OpenTrajectory,
    RunningAction,
    TrajectoryMeta,
    TrajectoryState,
)
from tangram.service.config import ANY_TENANT, TenantLimits
from tangram.service.engine import Engine
from tangram.service.learned_file import LearnedFile
from tangram.service.records import KEY_SEP, EngineError
from tests.fixtures.fake_agent import Agent, answer_all, connect, hello, left, make_engine, run


def _memory_used(engine: Engine) -> float:
    return engine.core.cpu.nodes["n1"].memory_used_gb


def test_a_close_cut_off_by_the_link_closes_the_environment_on_the_agents_return() -> None:
    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), lambda m: None if m["op"] == "close" else answer_all(m))
        await connect(engine, first)
        meta = (await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))).meta()
        closing = asyncio.ensure_future(engine.close_trajectory("u", "t1"))
        while not first.ops("close"):
            await asyncio.sleep(0)
        first.drop()  # the link drops with the close unanswered
        assert (await closing).state is TrajectoryState.CLOSED
        await left(engine)
        back = Agent(hello(trajectories=[meta]))  # it still holds the environment
        await connect(engine, back)
        assert [m["trajectory"] for m in back.ops("close")] == ["t1"]  # closed, not revived
        assert ("u", "t1") not in engine.state.named and _memory_used(engine) == 0
        assert not engine.lifecycle.to_close  # it said it closed it

    run(scenario)


def test_a_second_close_waits_for_the_first_to_end() -> None:
    """It answered at once while the agent still removed the environment: embedded mode's
    stop, closing what was open behind an idle timeout's close, said every environment was
    removed and stopped the agent under it."""

    async def scenario(engine: Engine) -> None:
        agent = Agent(hello(), lambda m: None if m["op"] == "close" else answer_all(m))
        await connect(engine, agent)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        first = asyncio.ensure_future(engine.close_trajectory("u", "t1"))
        while not agent.ops("close"):
            await asyncio.sleep(0)
        second = asyncio.ensure_future(engine.close_trajectory("u", "t1"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done()  # the agent has not answered
        agent.push(AgentReply(rid=agent.ops("close")[0]["rid"], ok=True))
        assert (await second).state is (await first).state is TrajectoryState.CLOSED

    run(scenario)


def test_a_stale_environment_whose_close_is_cut_off_is_closed_on_the_next_return() -> None:
    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        meta = (await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))).meta()
        engine.hub.links["n1"].socket.drop()  # type: ignore[attr-defined]
        await left(engine)
        await engine.close_trajectory("u", "t1")  # while its agent is away
        deaf = Agent(hello(trajectories=[meta]), lambda m: None)
        await connect(engine, deaf)
        assert deaf.ops("close")  # told, but it drops before it answers
        deaf.drop()
        await left(engine)
        again = Agent(hello(trajectories=[meta]))
        await connect(engine, again)
        assert [m["trajectory"] for m in again.ops("close")] == ["t1"]
        assert ("u", "t1") not in engine.state.named and _memory_used(engine) == 0

    run(scenario)


def test_an_open_whose_answer_was_lost_is_closed_on_the_agents_return() -> None:
    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), lambda m: None)  # it makes the environment, never answers
        await connect(engine, first)
        opening = asyncio.ensure_future(engine.open_trajectory("u", OpenTrajectory(env="e")))
        while not first.ops("open"):
            await asyncio.sleep(0)
        first.drop()
        try:
            await opening
        except EngineError as e:
            assert e.kind == "unavailable"
        await left(engine)
        made = TrajectoryMeta.model_validate(first.ops("open")[0]["meta"])
        back = Agent(hello(trajectories=[made]))
        await connect(engine, back)
        assert [m["trajectory"] for m in back.ops("close")] == [made.id]
        assert not engine.state.trajectories and _memory_used(engine) == 0

    run(scenario)


def test_a_keyed_run_cut_off_by_a_failed_send_gets_its_agents_result() -> None:
    """The send fails, so the link fails what waits before the hub drains the node: the
    key must not keep that outcome_unknown; the run the agent still holds answers its
    retry."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), lambda m: None if m["op"] == "exec" else answer_all(m))
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        meta = engine.trajectory("u", "t1").meta()
        cut = engine.submit_exec("u", "t1", ExecRequest(argv=["train"], idempotency_key="K"))
        while not first.ops("exec"):
            await asyncio.sleep(0)
        first.broken = True
        engine.submit_exec("u", "t1", ExecRequest(argv=["true"]))  # its send fails
        assert (await cut.done).error.code == "outcome_unknown"  # type: ignore[union-attr]
        await left(engine)
        held = RunningAction(key=f"u{KEY_SEP}K", trajectory="t1",
                             cores=first.ops("exec")[0]["cores"], running_s=1.0)  # fmt: skip
        back = Agent(hello(trajectories=[meta], running=[held]))
        await connect(engine, back)
        result = ExecOutcome(exit_code=0, stdout="trained\n", stderr="", timed_out=False,
                             stdout_truncated=False, stderr_truncated=False, setup_s=0.0,
                             exec_s=1.0, teardown_s=0.0, path="fast")  # fmt: skip
        back.push(AgentReply(rid=0, ok=True, key=f"u{KEY_SEP}K", result=result))
        retry = engine.submit_exec("u", "t1", ExecRequest(argv=["train"], idempotency_key="K"))
        answer = await retry.done
        assert (answer.status, answer.stdout) == (ActionStatus.OK, "trained\n"), answer

    run(scenario)


def test_lost_trajectories_do_not_count_against_max_trajectories() -> None:
    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        engine.lifecycle.environment_lost("t1", "SandboxEvicted", "the kubelet evicted it")
        assert engine.trajectory("u", "t1").state is TrajectoryState.LOST
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t2"))  # not refused

    run(scenario, tenants={ANY_TENANT: TenantLimits(max_trajectories=1)})


def test_a_retried_close_gets_the_closed_trajectory() -> None:
    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        first = await engine.close_trajectory("u", "t1")
        again = await engine.close_trajectory("u", "t1")  # its first answer was lost
        assert again is first and again.state is TrajectoryState.CLOSED

    run(scenario)


def test_an_open_retried_before_its_agent_is_back_leaves_one_trajectory() -> None:
    """A restarted scheduler: the open's retry comes while the agent holding what the
    first try opened is not back yet, and opens another elsewhere. The client has that
    one; the first, handed back later, is closed rather than kept as a second."""

    async def scenario(engine: Engine) -> None:
        first = TrajectoryMeta(id="t-first", tenant="u", env="e", open_key="K",
                               open_digest=OpenTrajectory(env="e").digest())  # fmt: skip
        await connect(engine, Agent(hello(node="n2")))
        retry = await engine.open_trajectory("u", OpenTrajectory(env="e", idempotency_key="K"))
        assert retry.node == "n2"
        back = Agent(hello(trajectories=[first], node="n1"))
        await connect(engine, back)
        assert [m["trajectory"] for m in back.ops("close")] == ["t-first"]
        assert [t.id for t in engine.state.trajectories.values()] == [retry.id]
        again = await engine.open_trajectory("u", OpenTrajectory(env="e", idempotency_key="K"))
        assert again is retry

    run(scenario, reconnecting=True)


def test_a_close_answered_while_its_agent_was_away_outlives_a_scheduler_restart(
    tmp_path: Path,
) -> None:
    """The next scheduler learns it from the document the last one left (a Helm upgrade
    restarts the scheduler and the agents together): the environment its agent brings
    back is closed, not taken back as an open trajectory nobody will use or close."""
    store = LearnedFile(tmp_path / "learned.json")

    async def go() -> None:
        first = make_engine()
        first.keep_learned(store)
        await first.start()
        await connect(first, Agent(hello()))
        meta = (await first.open_trajectory("u", OpenTrajectory(env="e", id="t1"))).meta()
        first.hub.links["n1"].socket.drop()  # type: ignore[attr-defined]
        await left(first)
        assert (await first.close_trajectory("u", "t1")).state is TrajectoryState.CLOSED
        await first.stop(grace_s=0)  # (it saves what the next one resumes)
        second = make_engine(reconnecting=True)
        second.keep_learned(store)
        await second.start()
        try:
            back = Agent(hello(trajectories=[meta]))
            await connect(second, back)
            assert [m["trajectory"] for m in back.ops("close")] == ["t1"]
            assert ("u", "t1") not in second.state.named and not second.lifecycle.to_close
        finally:
            await second.stop(grace_s=0)
        assert "closing" not in store.path.read_text()  # done: none left to close

    asyncio.run(asyncio.wait_for(go(), 30))


def test_an_agent_gone_under_a_request_is_named_once() -> None:
    """An open said "node node-0: node node-0: the agent disconnected"."""
    import pytest

    from tangram.service.agents import AgentGoneError
    from tangram.service.state import agent_gone

    with pytest.raises(EngineError) as e, agent_gone("n1"):
        raise AgentGoneError("node n1: the agent disconnected")
    assert str(e.value).count("n1") == 1 and e.value.kind == "unavailable"
    with pytest.raises(EngineError) as e, agent_gone("n1"):
        raise ConnectionResetError("reset by peer")
    assert "node n1: reset by peer" in str(e.value)
