"""The agent's stop on purpose (``NodeAgent.wind_down``): its grace counts from the stop's
start, not from when the wind-down gets to run, and one wind-down serves every call."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tangram.api.wire import AgentExec, AgentOpen, EnvSpec
from tangram.node_agent import agent as agent_module
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.execution import ExecResult
from tangram.node_agent.inventory import read_inventory
from tangram.node_agent.noop_runtime import NoopRuntime

GUARD_S = 60.0  # a hang's bound: never a timing assertion


class _Stubborn(NoopRuntime):
    """Commands run until ``release``; with ``stubborn``, a kill does not end them (a
    process the kill cannot reach)."""

    def __init__(self, stubborn: bool) -> None:
        super().__init__()
        self.stubborn = stubborn
        self.running = asyncio.Event()
        self.release = threading.Event()

    async def exec(
        self, trajectory: str, argv: Sequence[str], cores: Sequence[int], **options: Any
    ) -> ExecResult:
        self.running.set()
        while not self.release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if not self.stubborn:
                    raise
        return await super().exec(trajectory, argv, cores, **options)


async def _running(runtime: _Stubborn) -> tuple[NodeAgent, asyncio.Task[Any]]:
    agent = NodeAgent(runtime, read_inventory(), [0], [1], node="n1")
    await agent.handle(AgentOpen(rid=1, trajectory="t", env=EnvSpec(name="e", image="i")))
    answer = asyncio.ensure_future(agent.handle(AgentExec(rid=2, trajectory="t", argv=["x"])))
    await asyncio.wait_for(runtime.running.wait(), GUARD_S)
    return agent, answer


def test_the_grace_counts_from_the_stops_start() -> None:
    """A SIGTERM during the link's connect was taken up when the connect failed (up to
    10 s on), and the grace counted from there: past the pod's 30 s. The grace counts
    from the stop's start (the signal's time): one that began a grace ago kills at once."""

    async def scenario() -> int:
        agent, answer = await _running(_Stubborn(stubborn=False))
        agent.note_stop(time.monotonic() - 3600)  # (began an hour ago)
        killed = await asyncio.wait_for(agent.wind_down(600), GUARD_S)
        await asyncio.wait({answer}, timeout=GUARD_S)
        assert answer.cancelled()  # killed by the stop: not answered
        return killed

    assert asyncio.run(scenario()) == 1


def test_a_wind_down_asked_for_again_is_the_same_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``link.run`` winds down again after the link's leave did: the kill, its log line
    and its wait for a command the kill cannot end were all repeated."""
    monkeypatch.setattr(agent_module, "STOP_GRACE_S", 0.0)  # (the kill cannot end it)
    runtime = _Stubborn(stubborn=True)

    async def scenario() -> list[int]:
        agent, answer = await _running(runtime)
        counts = [await asyncio.wait_for(agent.wind_down(0), GUARD_S) for _ in range(2)]
        runtime.release.set()
        await asyncio.wait({answer}, timeout=GUARD_S)
        return counts

    with caplog.at_level(logging.WARNING, logger="tangram.agent"):
        assert asyncio.run(scenario()) == [1, 1]
    killed = [r for r in caplog.records if "still running killed" in r.getMessage()]
    assert len(killed) == 1, killed


def test_a_key_that_ran_asked_again_after_the_stop_began_is_replayed_not_refused() -> None:
    """A request that came after the stop began is answered not taken ("nothing of it
    ran": its scheduler ends it retryable); but one whose key this agent ran, or runs,
    did run: it gets its replay (a run in flight, its end), never "not taken", which would
    let a retry under another key run it twice. A key it never saw is not taken."""

    async def scenario() -> None:
        agent = NodeAgent(NoopRuntime(), read_inventory(), [0], [1], node="n1")
        await agent.handle(AgentOpen(rid=1, trajectory="t", env=EnvSpec(name="e", image="i")))
        first = await agent.handle(
            AgentExec(rid=2, trajectory="t", argv=["x"], cores=[0], key="u/k")
        )
        assert first.ok and first.result is not None, first
        agent.note_stop()
        again = await agent.handle(
            AgentExec(rid=3, trajectory="t", argv=["x"], cores=[0], key="u/k")
        )
        assert again.ok and again.replayed and not again.not_taken, again
        new = await agent.handle(
            AgentExec(rid=4, trajectory="t", argv=["x"], cores=[0], key="u/other")
        )
        assert new.not_taken and new.retryable and not new.ok, new

    asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
