"""Agents that drop and come back, driven through the real hub, links and engine by a fake
agent socket: nothing closed comes back to life, an environment that must go goes once its
agent can be told, and a keyed run cut off by the link keeps its outcome the agent's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocketDisconnect

from tangram.api.inventory import NodeInventory
from tangram.api.wire import (
    ActionStatus,
    AgentHello,
    AgentReply,
    EnvSpec,
    ExecOutcome,
    ExecRequest,
    OpenTrajectory,
    RunningAction,
    TrajectoryMeta,
    TrajectoryState,
    unpack,
)
from tangram.service.config import ANY_TENANT, EnvConfig, PoolConfig, TenantLimits
from tangram.service.engine import Engine
from tangram.service.records import KEY_SEP, EngineError

ENV = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=1.0))
Policy = Callable[[dict[str, Any]], AgentReply | None]  # None: never answered


def _hello(
    trajectories: list[TrajectoryMeta] | None = None, running: list[RunningAction] | None = None
) -> AgentHello:
    inventory = NodeInventory(node_id="n1", hostname="n1", numa=[[0, 1, 2]], memory_gb=2.0,
                              cgroup_version=2)  # fmt: skip
    return AgentHello(
        node="n1", inventory=inventory, runtime="noop", action_cores=[1, 2], idle_cores=[0],
        trajectories=trajectories or [], running=running or [],
    )  # fmt: skip


def _answer_all(msg: dict[str, Any]) -> AgentReply | None:
    return AgentReply(rid=0, ok=True, opened_s=0.0)


class Agent:
    """One connection of a fake agent: its hello, then replies as ``policy`` says."""

    def __init__(self, hello: AgentHello, policy: Policy = _answer_all) -> None:
        self.inbox: asyncio.Queue[str | BaseException] = asyncio.Queue()
        self.inbox.put_nowait(hello.model_dump_json())
        self.policy = policy
        self.sent: list[dict[str, Any]] = []
        self.broken = False  # the next write fails (the peer reset the connection)

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [m for m in self.sent if m.get("op") == op]

    async def send_text(self, data: str) -> None:
        if self.broken:
            raise ConnectionResetError("reset by peer")
        for text in unpack(data):
            msg = json.loads(text)
            self.sent.append(msg)
            reply = self.policy(msg)
            if reply is not None:
                self.push(reply.model_copy(update={"rid": msg["rid"]}))

    async def receive_text(self) -> str:
        item = await self.inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        await asyncio.sleep(0)  # a close frame is a write, as Starlette's
        self.drop()

    def push(self, reply: AgentReply) -> None:
        self.inbox.put_nowait(reply.model_dump_json())

    def drop(self) -> None:
        self.inbox.put_nowait(WebSocketDisconnect(1006))


async def _connect(engine: Engine, agent: Agent) -> None:
    engine.state.background(engine.hub.serve(agent))
    while "n1" not in engine.state.node_cores:
        await asyncio.sleep(0)
    for _ in range(10):  # what it sends on joining (closes of stale environments)
        await asyncio.sleep(0)


async def _left(engine: Engine) -> None:
    while "n1" in engine.state.node_cores:
        await asyncio.sleep(0)


def _engine(**pool: Any) -> Engine:
    engine = Engine(PoolConfig(envs={"e": ENV}, **pool))
    engine.all_agents_joined()
    return engine


def _run(scenario: Callable[[Engine], Any], **pool: Any) -> None:
    async def go() -> None:
        engine = _engine(**pool)
        await engine.start()
        try:
            await asyncio.wait_for(scenario(engine), 30)  # (a guard against a hang)
        finally:
            await engine.stop(grace_s=0)

    asyncio.run(go())


def _memory_used(engine: Engine) -> float:
    return engine.core.cpu.nodes["n1"].memory_used_gb


def test_a_close_cut_off_by_the_link_closes_the_environment_on_the_agents_return() -> None:
    async def scenario(engine: Engine) -> None:
        first = Agent(_hello(), lambda m: None if m["op"] == "close" else _answer_all(m))
        await _connect(engine, first)
        meta = (await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))).meta()
        closing = asyncio.ensure_future(engine.close_trajectory("u", "t1"))
        while not first.ops("close"):
            await asyncio.sleep(0)
        first.drop()  # the link drops with the close unanswered
        assert (await closing).state is TrajectoryState.CLOSED
        await _left(engine)
        back = Agent(_hello(trajectories=[meta]))  # it still holds the environment
        await _connect(engine, back)
        assert [m["trajectory"] for m in back.ops("close")] == ["t1"]  # closed, not revived
        assert ("u", "t1") not in engine.state.named and _memory_used(engine) == 0
        assert not engine.lifecycle.to_close  # it said it closed it

    _run(scenario)


def test_a_stale_environment_whose_close_is_cut_off_is_closed_on_the_next_return() -> None:
    async def scenario(engine: Engine) -> None:
        await _connect(engine, Agent(_hello()))
        meta = (await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))).meta()
        engine.hub.links["n1"].socket.drop()  # type: ignore[attr-defined]
        await _left(engine)
        await engine.close_trajectory("u", "t1")  # while its agent is away
        deaf = Agent(_hello(trajectories=[meta]), lambda m: None)
        await _connect(engine, deaf)
        assert deaf.ops("close")  # told, but it drops before it answers
        deaf.drop()
        await _left(engine)
        again = Agent(_hello(trajectories=[meta]))
        await _connect(engine, again)
        assert [m["trajectory"] for m in again.ops("close")] == ["t1"]
        assert ("u", "t1") not in engine.state.named and _memory_used(engine) == 0

    _run(scenario)


def test_an_open_whose_answer_was_lost_is_closed_on_the_agents_return() -> None:
    async def scenario(engine: Engine) -> None:
        first = Agent(_hello(), lambda m: None)  # it makes the environment, never answers
        await _connect(engine, first)
        opening = asyncio.ensure_future(engine.open_trajectory("u", OpenTrajectory(env="e")))
        while not first.ops("open"):
            await asyncio.sleep(0)
        first.drop()
        try:
            await opening
        except EngineError as e:
            assert e.kind == "unavailable"
        await _left(engine)
        made = TrajectoryMeta.model_validate(first.ops("open")[0]["meta"])
        back = Agent(_hello(trajectories=[made]))
        await _connect(engine, back)
        assert [m["trajectory"] for m in back.ops("close")] == [made.id]
        assert not engine.state.trajectories and _memory_used(engine) == 0

    _run(scenario)


def test_a_keyed_run_cut_off_by_a_failed_send_gets_its_agents_result() -> None:
    """The send fails, so the link fails what waits before the hub drains the node: the
    key must not keep that node_lost; the run the agent still holds answers its retry."""

    async def scenario(engine: Engine) -> None:
        first = Agent(_hello(), lambda m: None if m["op"] == "exec" else _answer_all(m))
        await _connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        meta = engine.trajectory("u", "t1").meta()
        cut = engine.submit_exec("u", "t1", ExecRequest(argv=["train"], idempotency_key="K"))
        while not first.ops("exec"):
            await asyncio.sleep(0)
        first.broken = True
        engine.submit_exec("u", "t1", ExecRequest(argv=["true"]))  # its send fails
        assert (await cut.done).error.code == "node_lost"  # type: ignore[union-attr]
        await _left(engine)
        held = RunningAction(key=f"u{KEY_SEP}K", trajectory="t1",
                             cores=first.ops("exec")[0]["cores"], running_s=1.0)  # fmt: skip
        back = Agent(_hello(trajectories=[meta], running=[held]))
        await _connect(engine, back)
        result = ExecOutcome(exit_code=0, stdout="trained\n", stderr="", timed_out=False,
                             stdout_truncated=False, stderr_truncated=False, setup_s=0.0,
                             exec_s=1.0, teardown_s=0.0, path="fast")  # fmt: skip
        back.push(AgentReply(rid=0, ok=True, key=f"u{KEY_SEP}K", result=result))
        retry = engine.submit_exec("u", "t1", ExecRequest(argv=["train"], idempotency_key="K"))
        answer = await retry.done
        assert (answer.status, answer.stdout) == (ActionStatus.OK, "trained\n"), answer

    _run(scenario)


def test_lost_trajectories_do_not_count_against_max_trajectories() -> None:
    async def scenario(engine: Engine) -> None:
        await _connect(engine, Agent(_hello()))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        engine.lifecycle.environment_lost("t1", "SandboxEvicted", "the kubelet evicted it")
        assert engine.trajectory("u", "t1").state is TrajectoryState.LOST
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t2"))  # not refused

    _run(scenario, tenants={ANY_TENANT: TenantLimits(max_trajectories=1)})


def test_a_retried_close_gets_the_closed_trajectory() -> None:
    async def scenario(engine: Engine) -> None:
        await _connect(engine, Agent(_hello()))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        first = await engine.close_trajectory("u", "t1")
        again = await engine.close_trajectory("u", "t1")  # its first answer was lost
        assert again is first and again.state is TrajectoryState.CLOSED

    _run(scenario)
