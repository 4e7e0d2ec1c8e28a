"""An agent that says it stops (SIGTERM: the ``leaving`` heartbeat) and then lets what it
runs finish within its grace, driven through the real hub, links and engine by fake
agents: its node takes no new work from that word on. New trajectories, commands and
service calls go to the other nodes; the next commands of its own trajectories wait,
sent nowhere, and end node_lost (retryable) when its link closes; its next agent (a new
link) takes work again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from tangram.api.wire import (
    AGENT_LEAVING,
    ActionStatus,
    AgentReply,
    ExecOutcome,
    ExecRequest,
    GpuWorkerInfo,
    OpenTrajectory,
    ServiceCallRequest,
    ServiceDef,
    ServiceLoad,
    ServiceOutcome,
    ServiceStats,
)
from tangram.service.app import create_app
from tangram.service.auth import TokenStore
from tangram.service.config import EnvConfig, PoolConfig, ServiceConfig
from tangram.service.engine import Engine
from tangram.service.records import EngineError
from tests.fixtures.fake_agent import (
    ENV,
    Agent,
    Policy,
    answer_all,
    connect,
    hello,
    left,
    run,
    settle,
)


def _outcome() -> ExecOutcome:
    return ExecOutcome(exit_code=0, stdout="", stderr="", stdout_truncated=False,
                       stderr_truncated=False, timed_out=False, setup_s=0.0, exec_s=0.1,
                       teardown_s=0.0, path="fast")  # fmt: skip


def _commands(msg: dict[str, Any]) -> AgentReply | None:
    """An agent whose ``hold`` command runs until the test answers it; any other command
    exits 0 at once, and everything else is answered."""
    if msg["op"] == "exec":
        return None if msg["argv"] == ["hold"] else AgentReply(rid=0, ok=True, result=_outcome())
    return answer_all(msg)


def _said_stopping(caplog: pytest.LogCaptureFixture, node: str) -> list[logging.LogRecord]:
    said = f"node {node} is stopping"
    return [
        r
        for r in caplog.records
        if r.name == "tangram.service.nodes" and r.getMessage().startswith(said)
    ]


def test_a_leaving_node_takes_no_new_work_while_what_runs_there_finishes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """n1's agent says it stops while a command of t1 runs there. A trajectory opened
    then went to n1 (it sorts first) and its open, like t1's next command, was sent to an
    agent that took nothing more: both hung until its link closed. Now the new trajectory
    opens on n2 and its command runs there; t1's next command waits, never sent to n1, and
    ends node_lost (retryable) when n1's link closes; the command running when the agent
    said it stops ends with its result. n1's next agent takes work again."""
    caplog.set_level(logging.INFO, logger="tangram.service.nodes")

    async def scenario(engine: Engine) -> None:
        n1, n2 = Agent(hello(node="n1"), _commands), Agent(hello(node="n2"), _commands)
        await connect(engine, n1)
        await connect(engine, n2)
        for tid in ("t1", "t0"):  # one on each node (1 GiB of their 2): n1 is chosen next
            await engine.open_trajectory("u", OpenTrajectory(env="e", id=tid))
        assert [engine.state.trajectory("u", t).node for t in ("t1", "t0")] == ["n1", "n2"]
        held = engine.submit_exec("u", "t1", ExecRequest(argv=["hold"]))
        assert await settle(lambda: len(n1.ops("exec")) == 1)

        opens = len(n1.ops("open"))  # (t1's)
        n1.inbox.put_nowait(AGENT_LEAVING)
        assert await settle(lambda: engine.hub.links["n1"].leaving)
        (said,) = _said_stopping(caplog, "n1")
        assert said.levelno == logging.INFO and said.__dict__["node"] == "n1"
        assert "1 actions run on" in said.getMessage()
        nxt = engine.submit_exec("u", "t1", ExecRequest(argv=["true"]))
        t2 = await asyncio.wait_for(
            engine.open_trajectory("u", OpenTrajectory(env="e", id="t2")), 5
        )
        assert t2.node == "n2"
        other = engine.submit_exec("u", "t2", ExecRequest(argv=["true"]))
        result = await asyncio.wait_for(other.done, 5)
        assert result.status is ActionStatus.OK and result.allocation.node == "n2"
        assert not await settle(lambda: nxt.started is not None)  # held here, sent nowhere
        assert len(n1.ops("exec")) == 1 and len(n1.ops("open")) == opens
        assert nxt.id in engine.core.stranded

        n1.push(AgentReply(rid=n1.ops("exec")[0]["rid"], ok=True, result=_outcome()))
        assert (await asyncio.wait_for(held.done, 5)).status is ActionStatus.OK
        n1.drop()  # its grace is over: the link closes
        await left(engine, "n1")
        lost = await asyncio.wait_for(nxt.done, 5)
        assert lost.error is not None and lost.error.code == "node_lost", lost
        assert lost.error.retryable and lost.allocation.node is None  # it never started

        back = Agent(hello(node="n1"), _commands)  # its next agent: a link not leaving
        await connect(engine, back)
        assert not engine.hub.links["n1"].leaving and not engine.core.cpu.cordoned
        t3 = await engine.open_trajectory("u", OpenTrajectory(env="e", id="t3"))
        assert t3.node == "n1"  # (n2 is full)
        again = engine.submit_exec("u", "t3", ExecRequest(argv=["true"]))
        assert (await asyncio.wait_for(again.done, 5)).status is ActionStatus.OK
        assert len(back.ops("exec")) == 1

    run(scenario)


def test_an_answer_not_taken_is_the_agents_word_that_it_stops() -> None:
    """An agent whose stop began answers what comes not taken; its heartbeat saying it
    stops may still be on its way (the signal came between two). Until that word came,
    the next command of the trajectory was sent there again, and refused again; the
    answer is the word now: the node takes no new work, and the command waits."""

    async def scenario(engine: Engine) -> None:
        n1 = Agent(hello(node="n1"), lambda m: None if m["op"] == "exec" else answer_all(m))
        await connect(engine, n1)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        first = engine.submit_exec("u", "t1", ExecRequest(argv=["true"]))
        assert await settle(lambda: len(n1.ops("exec")) == 1)
        n1.push(AgentReply(rid=n1.ops("exec")[0]["rid"], ok=False, retryable=True,
                           not_taken=True, error="exec: the node agent is stopping"))  # fmt: skip
        lost = await asyncio.wait_for(first.done, 5)
        assert lost.error is not None and lost.error.code == "node_lost", lost.error
        assert engine.hub.links["n1"].leaving  # (no AGENT_LEAVING came)
        retry = engine.submit_exec("u", "t1", ExecRequest(argv=["true"]))
        assert not await settle(lambda: retry.started is not None)  # held, sent nowhere
        assert len(n1.ops("exec")) == 1 and retry.id in engine.core.stranded

    run(scenario)


def test_an_open_while_every_agent_stops_is_503_not_sent_to_them() -> None:
    async def scenario(engine: Engine) -> None:
        n1 = Agent(hello(node="n1"), _commands)
        await connect(engine, n1)
        n1.inbox.put_nowait(AGENT_LEAVING)
        assert await settle(lambda: engine.hub.links["n1"].leaving)
        with pytest.raises(Exception) as refused:
            await asyncio.wait_for(engine.open_trajectory("u", OpenTrajectory(env="e", id="t")), 5)
        assert getattr(refused.value, "kind", None) == "unavailable", refused.value
        assert "stopping" in str(refused.value)
        assert not n1.ops("open")

    run(scenario)


@pytest.mark.parametrize("reconnecting", [False, True])
def test_an_open_with_no_agent_connected_says_so_not_that_memory_is_short(
    reconnecting: bool,
) -> None:
    """With no agent at all, an open said "no node has 1.0 GiB free for a new trajectory":
    a 503 that sent its reader to the nodes' memory, when there was no node. It says no
    agent is connected (and, just after a start, that they may be reconnecting)."""

    async def scenario(engine: Engine) -> None:
        with pytest.raises(EngineError) as refused:
            await engine.open_trajectory("u", OpenTrajectory(env="e", id="t"))
        assert (refused.value.kind, refused.value.field) == ("unavailable", "env")
        said = "no node agent is connected: no node to open a trajectory on"
        if reconnecting:
            said += " (this scheduler has just started: they may be reconnecting)"
        assert refused.value.message == said

    run(scenario, reconnecting=reconnecting)


def test_a_stopping_agent_is_not_told_to_keep_environments_warm() -> None:
    """An edit of the pool's environments tells each agent the warm sandboxes to keep.
    A stopping agent's node opens no new trajectory: it would start them for nobody, and
    remove them as it ends. Only n2 is told."""

    async def scenario(engine: Engine) -> None:
        n1, n2 = Agent(hello(node="n1"), _commands), Agent(hello(node="n2"), _commands)
        await connect(engine, n1)
        await connect(engine, n2)
        n1.inbox.put_nowait(AGENT_LEAVING)
        assert await settle(lambda: engine.hub.links["n1"].leaving)
        told = {a.node: len(a.ops("warm")) for a in (n1, n2)}
        warm = EnvConfig(spec=ENV.spec.model_copy(update={"warm": 2}))
        engine.reconfigure(replace(engine.config, envs={"e": warm}))
        assert await settle(lambda: len(n2.ops("warm")) == told["n2"] + 1)
        assert [e["warm"] for e in n2.ops("warm")[-1]["envs"]] == [2]
        assert len(n1.ops("warm")) == told["n1"]

    run(scenario)


def test_only_stopping_agents_leave_the_pool_not_ready() -> None:
    """Readiness (``/readyz``) says whether the pool can take new work: an agent that said
    it stops cannot, so with only such agents the pool is not ready (503, saying why),
    and is again once an agent that does not stop is connected; the figures the operator
    reads count the agents that stop. Liveness (``/healthz``) stays ok throughout: a
    not-ready scheduler is not restarted."""

    async def probes(engine: Engine) -> tuple[bool, int, str, int]:
        """``Engine.ready``, /readyz's status and text, /healthz's status."""
        app = create_app(engine, TokenStore({}))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            ready, alive = await http.get("/readyz"), await http.get("/healthz")
        return engine.ready, ready.status_code, ready.text, alive.status_code

    async def scenario(engine: Engine) -> None:
        n1 = Agent(hello(node="n1"), _commands)
        await connect(engine, n1)
        assert await probes(engine) == (True, 200, "ready", 200)
        n1.inbox.put_nowait(AGENT_LEAVING)
        assert await settle(lambda: engine.hub.links["n1"].leaving)
        ready, status, why, alive = await probes(engine)
        assert (ready, status, alive) == (False, 503, 200) and "stopping" in why
        figures = engine.figures()  # (the operator's AgentsStopping reads them)
        assert (figures.nodes, figures.stopping) == (1, 1)
        await connect(engine, Agent(hello(node="n2"), _commands))
        assert await probes(engine) == (True, 200, "ready", 200)
        assert engine.figures().stopping == 1

    run(scenario)


# ---- GPU nodes ----------------------------------------------------------------------------


JUDGE = ServiceDef(name="judge", entrypoint="m:build", weights="/w.pt", gpu_memory_gb=1)
EDITED = JUDGE.model_copy(update={"weights": "/w2.pt"})


@contextlib.asynccontextmanager
async def _serving_judge() -> AsyncIterator[Engine]:
    """A started engine whose pool serves ``judge`` (JUDGE); stopped at the end."""
    engine = Engine(PoolConfig(services={"judge": ServiceConfig(spec=JUDGE)}))
    engine.all_agents_joined()
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop(grace_s=0)


def _gpu_hello(node: str, devices: int) -> Any:
    gpu = GpuWorkerInfo(backend="cpu", devices=list(range(devices)),
                        memory_bytes=[2**31] * devices, h2d_gbps=1)  # fmt: skip
    return hello(node=node).model_copy(update={"gpu": gpu})


def _worker(msg: dict[str, Any]) -> AgentReply | None:
    """A GPU node's agent that holds ``judge`` and holds each call until answered."""
    if msg["op"] == "services":
        return AgentReply(rid=0, ok=True, loaded={"judge": ServiceLoad(ok=True, bytes=1 << 20)})
    if msg["op"] == "call":
        return None
    return answer_all(msg)


def _scored(rid: int) -> AgentReply:
    stats = ServiceStats(service="judge", resident=True)
    return AgentReply(rid=rid, ok=True, call=ServiceOutcome(outputs=[1.0], exec_s=0.1, stats=stats))


def _calls(agent: Agent) -> list[dict[str, Any]]:
    return [m for m in agent.ops("call") if not m.get("ahead")]


def test_a_service_call_goes_to_another_gpu_node_than_a_leaving_one() -> None:
    """g1 runs a call on one of its two GPUs (first by name); its agent says it stops.
    The next call went to g1's other GPU (the smallest free chunk, where the first call's
    service was restored ahead), and hung there until g1's link closed. It goes to g2
    now, and the call g1 ran ends with its result."""

    async def go() -> None:
        async with _serving_judge() as engine:
            g1, g2 = Agent(_gpu_hello("g1", 2), _worker), Agent(_gpu_hello("g2", 2), _worker)
            for agent in (g1, g2):
                await connect(engine, agent)
            assert await settle(lambda: {"g1", "g2"} <= set(engine.gpu.loads))
            first = engine.submit_service("u", "judge", ServiceCallRequest(inputs=[1]))
            assert await settle(lambda: len(_calls(g1)) == 1)
            g1.inbox.put_nowait(AGENT_LEAVING)
            assert await settle(lambda: engine.hub.links["g1"].leaving)
            second = engine.submit_service("u", "judge", ServiceCallRequest(inputs=[2]))
            assert await settle(lambda: len(_calls(g2)) == 1)
            assert len(_calls(g1)) == 1
            g2.push(_scored(_calls(g2)[0]["rid"]))
            done = await asyncio.wait_for(second.done, 5)
            assert done.status is ActionStatus.OK and done.allocation.node == "g2"
            g1.push(_scored(_calls(g1)[0]["rid"]))
            assert (await asyncio.wait_for(first.done, 5)).status is ActionStatus.OK

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_service_call_its_stopping_agent_did_not_take_ends_at_once_retryable() -> None:
    """A call that reached g1's agent after its stop began, before its word of it came:
    the agent answers it not taken. It ended with the link's close (the agent's grace
    later); it ends now, node_lost and retryable, saying it did not run."""

    async def go() -> None:
        async with _serving_judge() as engine:
            g1 = Agent(_gpu_hello("g1", 1), _worker)
            await connect(engine, g1)
            assert await settle(lambda: "g1" in engine.gpu.loads)
            call = engine.submit_service("u", "judge", ServiceCallRequest(inputs=[1]))
            assert await settle(lambda: len(_calls(g1)) == 1)
            stopping = "call: the node agent is stopping"
            rid = _calls(g1)[0]["rid"]
            g1.push(AgentReply(rid=rid, ok=False, retryable=True, not_taken=True, error=stopping))
            done = await asyncio.wait_for(call.done, 5)
            assert done.status is ActionStatus.ERROR and done.error is not None, done
            assert done.error.code == "node_lost" and done.error.retryable, done.error
            assert "took no new action, so it did not run" in done.error.message, done.error
            assert "g1" in engine.hub.links  # (not the link's close: the answer)

    asyncio.run(asyncio.wait_for(go(), 30))


def _loads_v1_only(msg: dict[str, Any]) -> AgentReply | None:
    """A GPU node's agent that loads ``judge`` from /w.pt and fails to from any other
    weights; calls are held until answered."""
    if msg["op"] == "services":
        (judge,) = msg["services"]
        load = (
            ServiceLoad(ok=True, bytes=1 << 20)
            if judge["weights"] == "/w.pt"
            else ServiceLoad(ok=False, error=f"no file {judge['weights']}")
        )
        return AgentReply(rid=0, ok=True, loaded={"judge": load})
    if msg["op"] == "call":
        return None
    return answer_all(msg)


@contextlib.asynccontextmanager
async def _judge_on_g1_g2(g1_policy: Policy) -> AsyncIterator[tuple[Engine, Agent, Agent]]:
    """An engine serving ``judge`` (JUDGE) on GPU nodes g1 (its agent ``g1_policy``) and
    g2 (loads /w.pt only), both loaded; stopped at the end."""
    async with _serving_judge() as engine:
        g1 = Agent(_gpu_hello("g1", 1), g1_policy)
        g2 = Agent(_gpu_hello("g2", 1), _loads_v1_only)
        for agent in (g1, g2):
            await connect(engine, agent)
        assert await settle(lambda: {"g1", "g2"} <= set(engine.gpu.loads))
        yield engine, g1, g2


def test_a_stopping_gpu_agent_is_not_synced_and_counts_for_no_load() -> None:
    """judge is edited (new weights) while g1's agent stops. g1 takes no new call, so its
    worker is not told to load the edit: only g2 is. g2 cannot load it: the call queued
    meanwhile is refused with g2's error and a new one is a conflict, as if g1 were gone
    (g1's word on the old weights counts for nothing; counted as still loading, it
    kept them waiting, and new ones admitted, until their queue timeout)."""

    async def go() -> None:
        async with _judge_on_g1_g2(_loads_v1_only) as (engine, g1, g2):
            g1.inbox.put_nowait(AGENT_LEAVING)
            assert await settle(lambda: engine.hub.links["g1"].leaving)
            synced = {a.node: len(a.ops("services")) for a in (g1, g2)}
            engine.reconfigure(PoolConfig(services={"judge": ServiceConfig(spec=EDITED)}))
            queued = engine.submit_service("u", "judge", ServiceCallRequest(inputs=[1]))
            assert await settle(lambda: len(g2.ops("services")) == synced["g2"] + 1)
            assert len(g1.ops("services")) == synced["g1"]
            assert await settle(queued.done.done)
            refused = queued.done.result()
            assert refused.status is ActionStatus.REJECTED and refused.error is not None
            assert "no file /w2.pt" in refused.error.message
            with pytest.raises(EngineError) as never:
                engine.submit_service("u", "judge", ServiceCallRequest(inputs=[2]))
            assert never.value.kind == "conflict" and "g1" not in never.value.message
            assert not _calls(g1) and not _calls(g2)

    asyncio.run(asyncio.wait_for(go(), 30))


def _loads_nothing_new(msg: dict[str, Any]) -> AgentReply | None:
    """A GPU node's agent whose worker never answers for an edit of ``judge`` (still
    loading it when its node stops or leaves)."""
    if msg["op"] == "services" and msg["services"][0]["weights"] != "/w.pt":
        return None
    return _loads_v1_only(msg)


@pytest.mark.parametrize("how", ["stops", "leaves"])
def test_a_call_queued_for_an_edit_ends_when_the_last_node_loading_it_goes(how: str) -> None:
    """judge is edited; g2 fails to load the edit, g1 is still loading it, so a call waits
    (g1 may load it). Then g1's agent says it stops, or its link is lost: no node is left
    that may load it, and the waiting call ends with g2's load error at once, as a new
    one is refused (it waited for its queue timeout, or for ever without one: only a
    load's answer looked at the queued calls again)."""

    async def go() -> None:
        async with _judge_on_g1_g2(_loads_nothing_new) as (engine, g1, g2):
            synced = len(g2.ops("services"))
            engine.reconfigure(PoolConfig(services={"judge": ServiceConfig(spec=EDITED)}))
            assert await settle(lambda: not engine.gpu.loads["g2"]["judge"].ok)
            assert len(g2.ops("services")) == synced + 1
            queued = engine.submit_service("u", "judge", ServiceCallRequest(inputs=[1]))
            assert not await settle(queued.done.done)  # g1 may still load it
            if how == "stops":
                g1.inbox.put_nowait(AGENT_LEAVING)
            else:
                g1.drop()
            assert await settle(queued.done.done)
            refused = queued.done.result()
            assert refused.status is ActionStatus.REJECTED and refused.error is not None
            assert "no file /w2.pt" in refused.error.message
            assert not _calls(g1) and not _calls(g2)

    asyncio.run(asyncio.wait_for(go(), 30))
