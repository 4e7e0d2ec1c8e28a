"""A TrajectoryEnv's idleTimeoutSeconds: a trajectory nothing used for that long is closed
(a rollout worker that died never closes its own), and one in use never is."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tangram.api.resources import TrajectoryEnv
from tangram.api.wire import (
    AgentReply,
    EnvSpec,
    ExecOutcome,
    ExecRequest,
    OpenTrajectory,
)
from tangram.service.config import EnvConfig
from tangram.service.e2b.sandboxes import Sandboxes
from tangram.service.engine import Engine
from tangram.service.files import Files
from tangram.service.from_resources import env_config
from tangram.service.records import EngineError
from tests.fixtures.fake_agent import Agent, answer_all, connect, hello, left, run

IDLE = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=1.0), idle_timeout_s=60.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _idle(engine: Engine, clock: Clock) -> list[str]:
    return [t.id for t in engine.lifecycle.idle(clock())]


def test_a_trajectory_idle_past_its_envs_timeout_is_closed_and_says_why() -> None:
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        agent = Agent(hello())
        await connect(engine, agent)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        clock.now += 59.9
        assert _idle(engine, clock) == []
        clock.now += 0.1
        assert _idle(engine, clock) == ["t1"]
        closing = asyncio.ensure_future(engine.lifecycle.close_idle_forever(every_s=0.001))
        while ("u", "t1") in engine.state.named:
            await asyncio.sleep(0.001)
        closing.cancel()
        assert [m["trajectory"] for m in agent.ops("close")] == ["t1"]
        with pytest.raises(EngineError, match=r"closed: idle for 60 s .* idleTimeoutSeconds"):
            engine.trajectory("u", "t1")

    run(scenario, env=IDLE, clock=clock)


def test_a_trajectory_in_use_is_not_idle() -> None:
    """A running action keeps it open however long it runs; its end, and any request of
    the trajectory (an action, a files request), start the idle time again."""
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        agent = Agent(hello(), lambda m: None if m["op"] == "exec" else answer_all(m))
        await connect(engine, agent)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        running = engine.submit_exec("u", "t1", ExecRequest(argv=["make", "test"]))
        while not agent.ops("exec"):
            await asyncio.sleep(0)
        clock.now += 600
        assert _idle(engine, clock) == []  # its action runs
        result = ExecOutcome(exit_code=0, stdout="", stderr="", timed_out=False,
                             stdout_truncated=False, stderr_truncated=False, setup_s=0.0,
                             exec_s=600.0, teardown_s=0.0, path="fast")  # fmt: skip
        agent.push(AgentReply(rid=agent.ops("exec")[0]["rid"], ok=True, result=result))
        await running.done
        clock.now += 59
        assert _idle(engine, clock) == []  # counted from the action's end
        engine.state.usable("u", "t1")  # a files request, say
        clock.now += 59
        assert _idle(engine, clock) == []
        clock.now += 1
        assert _idle(engine, clock) == ["t1"]

    run(scenario, env=IDLE, clock=clock)


def test_an_env_without_a_timeout_keeps_its_trajectories() -> None:
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        clock.now += 1e6
        assert _idle(engine, clock) == []

    run(scenario, clock=clock)


def test_the_timeout_comes_from_the_trajectory_env() -> None:
    spec = {"poolRef": "p", "image": "i", "idleTimeoutSeconds": 600}
    env = TrajectoryEnv.model_validate({
        "apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
        "metadata": {"name": "e"}, "spec": spec,
    })  # fmt: skip
    assert env_config(env, "p").idle_timeout_s == 600


def test_the_idle_time_starts_again_when_its_agent_is_back() -> None:
    """Away longer than the timeout, its worker retrying all along (503): back, it is
    not closed at the next check."""
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        first = Agent(hello())
        await connect(engine, first)
        meta = (await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))).meta()
        first.drop()
        await left(engine)
        clock.now += 50
        with pytest.raises(EngineError, match="reconnecting"):
            engine.state.usable("u", "t1")  # a retry while it is away
        clock.now += 40
        await connect(engine, Agent(hello(trajectories=[meta])))
        assert engine.trajectory("u", "t1").state.value == "open"
        assert _idle(engine, clock) == []
        clock.now += 60
        assert _idle(engine, clock) == ["t1"]

    run(scenario, env=IDLE, clock=clock)


def test_a_files_transfer_under_way_keeps_it_from_idling() -> None:
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        agent = Agent(hello(), lambda m: None if m["op"] == "files" else answer_all(m))
        await connect(engine, agent)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        reading = asyncio.ensure_future(Files(engine.state).read("u", "t1", "big.bin"))
        while not agent.ops("files"):
            await asyncio.sleep(0)
        clock.now += 600  # a slow download
        assert _idle(engine, clock) == []
        reading.cancel()  # it ends (the client went)
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        assert _idle(engine, clock) == []  # counted from its end
        clock.now += 60
        assert _idle(engine, clock) == ["t1"]

    run(scenario, env=IDLE, clock=clock)


def test_a_lost_trajectory_reads_as_lost_until_its_idle_timeout_then_is_closed() -> None:
    """Its environment ended by itself: it holds nothing, but its record and its id would
    stay for good. Its client reads it as lost for the idle timeout from then on; then it
    is closed, and answers 404 saying why."""
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        clock.now += 50
        engine.lifecycle.environment_lost("t1", "SandboxExited", "OOM")
        clock.now += 59
        assert _idle(engine, clock) == []  # counted from its loss, not its opening
        assert engine.trajectory("u", "t1").state.value == "lost"
        with pytest.raises(EngineError, match="lost"):
            engine.state.usable("u", "t1")  # (asked for: in use from now)
        clock.now += 60
        assert _idle(engine, clock) == ["t1"]
        engine.lifecycle.close_idle(clock())
        while ("u", "t1") in engine.state.named:
            await asyncio.sleep(0)
        with pytest.raises(EngineError, match=r"closed: lost \(OOM \(SandboxExited\)\), then "
                           r"closed after 60 s .* idleTimeoutSeconds"):  # fmt: skip
            engine.trajectory("u", "t1")
        assert not engine.state.trajectories
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))  # its id is free

    run(scenario, env=IDLE, clock=clock)


def test_a_trajectory_lost_while_its_agent_is_away_is_closed_after_its_idle_timeout() -> None:
    """Its agent did not come back within the grace: lost, then closed that long after;
    its environment, if it lives, is closed when its agent does come back."""
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        first = Agent(hello())
        await connect(engine, first)
        meta = (await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))).meta()
        first.drop()
        await left(engine)
        rec = engine.trajectory("u", "t1")
        while rec.state.value != "lost":  # (the pool's grace, 0 here)
            await asyncio.sleep(0)
        clock.now += 60
        assert _idle(engine, clock) == ["t1"]
        engine.lifecycle.close_idle(clock())
        while ("u", "t1") in engine.state.named:
            await asyncio.sleep(0)
        back = Agent(hello(trajectories=[meta]))
        await connect(engine, back)
        assert [m["trajectory"] for m in back.ops("close")] == ["t1"]  # closed, not revived
        assert ("u", "t1") not in engine.state.named

    run(scenario, env=IDLE, clock=clock, agent_grace_s=0.0)


def test_an_e2b_sandbox_ends_at_its_own_timeout_not_its_envs_idle_timeout() -> None:
    """E2B's promise: a sandbox lives till its ``timeout`` passes, however idle (its client
    sets and extends it; the reaper ends it). A /v1 trajectory beside it idles out."""
    clock = Clock()

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        sandboxes = Sandboxes(engine, clock=clock)
        box = await sandboxes.create("u", "e", 600, {}, {})
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="plain"))
        clock.now += 120.0  # past the env's 60 s, within the sandbox's 600 s
        assert _idle(engine, clock) == ["plain"]
        sandboxes.set_timeout(box, 30)  # (any timeout of its own, shorter too)
        assert _idle(engine, clock) == ["plain"]

    run(scenario, env=IDLE, clock=clock)
