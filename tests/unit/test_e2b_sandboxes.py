"""E2B sandboxes over the real engine and a fake agent: their timeouts, the reaper, lost
ones, and the streams that read their commands."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.api import format_envd_api_exception, get_message
from e2b.envd.rpc import handle_rpc_exception
from e2b.exceptions import SandboxNotRunningException
from fastapi import FastAPI

from tangram.api.wire import AgentReply, EnvSpec, ExecRequest, OpenTrajectory, TrajectoryState
from tangram.service.config import EnvConfig
from tangram.service.e2b import add_e2b_routes, process
from tangram.service.e2b.connect import envelope
from tangram.service.e2b.sandboxes import NO_END_S, OUTPUT_BACKLOG, Proc, Sandbox, Sandboxes
from tangram.service.engine import Engine
from tangram.service.records import EngineError
from tests.fixtures.fake_agent import Agent, answer_all, connect, hello, run


def _state(box: Sandbox) -> TrajectoryState:
    return box.trajectory.state  # (read afresh: mypy would keep what it last narrowed)


def test_a_lost_sandbox_can_be_killed_and_is_reaped_at_its_timeout() -> None:
    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        now = [1000.0]
        boxes = Sandboxes(engine, clock=lambda: now[0])
        killed, reaped = [await boxes.create("u", "e", 60, {}, {}) for _ in range(2)]
        for box in (killed, reaped):
            engine.lifecycle.environment_lost(box.trajectory.key, "SandboxExited", "killed")
        with pytest.raises(EngineError, match=r"\(lost: killed \(SandboxExited\)\)"):
            boxes.find("u", killed.id)  # no command or file reaches it
        assert boxes.mine("u") == []
        await boxes.kill("u", killed.id)
        assert _state(killed) is TrajectoryState.CLOSED
        await boxes.reap_once()
        assert _state(reaped) is TrajectoryState.LOST  # not before its timeout
        now[0] += 60
        await boxes.reap_once()
        await asyncio.gather(*boxes.expiring)  # (each killed on its own task)
        assert _state(reaped) is TrajectoryState.CLOSED

    run(scenario)


def test_one_slow_close_holds_up_no_other_sandboxs_reaping() -> None:
    slow: list[str] = []  # the trajectory whose close its agent does not answer yet
    agent = Agent(hello(), lambda m: None if m.get("trajectory") in slow else answer_all(m))

    async def scenario(engine: Engine) -> None:
        await connect(engine, agent)
        now = [1000.0]
        boxes = Sandboxes(engine, clock=lambda: now[0])
        first, second = [await boxes.create("u", "e", 1, {}, {}) for _ in range(2)]
        slow.append(first.trajectory.key)
        now[0] += 2  # both past their timeout
        await boxes.reap_once()
        while _state(second) is not TrajectoryState.CLOSED:  # (run's guard: 30 s)
            await asyncio.sleep(0.01)
        assert _state(first) is TrajectoryState.CLOSING
        third = await boxes.create("u", "e", 1, {}, {})
        now[0] += 2
        await boxes.reap_once()  # the next round is not held up by the unanswered close
        while _state(third) is not TrajectoryState.CLOSED:
            await asyncio.sleep(0.01)
        (close,) = [m for m in agent.ops("close") if m["trajectory"] == slow[0]]
        agent.push(AgentReply(rid=close["rid"], ok=True))
        while boxes.expiring:
            await asyncio.sleep(0.01)
        assert _state(first) is TrajectoryState.CLOSED

    run(scenario)


def test_connect_gives_a_trajectory_without_a_timeout_none() -> None:
    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))
        boxes = Sandboxes(engine)
        made = await boxes.create("u", "e", 60, {}, {})
        v1 = await engine.open_trajectory("u", OpenTrajectory(env="e"))
        plain = boxes.find("u", v1.id)  # a /v1 trajectory: no timeout
        assert plain.end_at is None
        for box in (plain, made):
            boxes.set_timeout(box, 5, extend_only=True)  # E2B's connect
        assert plain.end_at is None  # kept none: not killed 5 s from now
        assert boxes.shown_end(plain) == v1.opened_at + NO_END_S  # (its env: no idle timeout)
        assert made.end_at is not None and made.end_at > boxes.clock() + 5  # not shortened

    run(scenario)


def test_a_v1_trajectory_is_found_not_listed_and_ends_when_its_idle_timeout_would() -> None:
    """``Sandbox.connect`` takes any open trajectory of the tenant, but ``list`` names only
    the sandboxes made through E2B's API (a cleanup that kills all it lists killed an RL
    trainer's /v1 trajectories); a trajectory without a timeout ends (``endAt``) when its
    env's idle timeout finds it idle, not a year on."""
    engine_now = [500.0]
    idle = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.5), idle_timeout_s=600)

    def held(msg: dict[str, Any]) -> AgentReply | None:  # (its commands run until the end)
        return None if msg["op"] == "exec" else AgentReply(rid=0, ok=True, opened_s=0.0)

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello(), held))
        boxes = Sandboxes(engine, clock=lambda: 1000.0)
        made = await boxes.create("u", "e", 60, {}, {})
        v1 = await engine.open_trajectory("u", OpenTrajectory(env="e", labels={"a": "b"}))
        await engine.open_trajectory("other", OpenTrajectory(env="e"))  # (not the tenant's)
        assert [box.id for box in boxes.mine("u")] == [made.id]
        listed = {made.id: made, v1.id: boxes.find("u", v1.id)}
        assert listed[v1.id].metadata == {"a": "b"}
        assert [box.id for box in boxes.mine("u")] == [made.id]  # (found, still not listed)
        assert boxes.shown_end(made) == 1060.0  # its own timeout
        engine_now[0] += 100  # idle for 100 s of its 600
        assert boxes.shown_end(listed[v1.id]) == 1500.0
        engine_now[0] += 1000
        assert boxes.shown_end(listed[v1.id]) == 1000.0  # due now: never in the past
        v1.running.add("a-1")  # a command runs: not idle until 600 s after it ends
        assert boxes.shown_end(listed[v1.id]) == 1600.0
        v1.running.discard("a-1")
        # Its command queued behind another trajectory's on both cores: busy too (it read
        # as due now, though the idle timeout closes no trajectory with one queued).
        for _ in range(2):
            engine.submit_exec("u", made.id, ExecRequest(argv=["long"]))
        waiting = engine.submit_exec("u", v1.id, ExecRequest(argv=["short"]))
        await asyncio.sleep(0)
        engine_now[0] += 1000  # queued past its idle timeout
        assert waiting.started is None and not v1.running
        assert boxes.shown_end(listed[v1.id]) == 1600.0

    run(scenario, env=idle, clock=lambda: engine_now[0])


def test_a_reader_that_goes_mid_wait_leaves_no_wait_on_the_output_queue() -> None:
    """As Starlette ends a stream whose client went: its task is cancelled while the
    events wait for output. Nothing of that reader may take output after it."""

    async def scenario() -> None:
        proc = Proc(1, None, {}, stdin=False, pty=False)
        proc.rec = cast(Any, SimpleNamespace(done=asyncio.get_running_loop().create_future()))
        events = process.events(proc, None)
        assert b'"start"' in await anext(events)
        (queue,) = proc.readers
        reader = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0)  # now waiting for output
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        assert proc.readers == []  # detached
        queue.put_nowait(("stdout", "late"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert queue.qsize() == 1  # no forgotten wait of the gone reader took it

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_every_reader_gets_every_event_and_the_command_waits_for_the_slowest() -> None:
    """As envd fans events out: a second reader takes nothing from the first; the
    buffers stay bounded, so a reader that does not read holds the command's output."""

    async def scenario() -> None:
        proc = Proc(1, None, {}, stdin=False, pty=False)
        first = proc.attach()
        proc.output("stdout", "before")
        second = proc.attach()
        proc.output("stderr", "after")
        assert [first.get_nowait(), first.get_nowait()] == [("stdout", "before"),
                                                            ("stderr", "after")]  # fmt: skip
        assert second.get_nowait() == ("stderr", "after") and second.empty()
        for i in range(OUTPUT_BACKLOG):
            proc.output("stdout", str(i))
        while not first.empty():
            first.get_nowait()
        proc.taken()
        waiting = asyncio.ensure_future(proc.room())
        await asyncio.sleep(0)
        assert not waiting.done()  # the second reader has taken none of it
        proc.detach(second)  # it went: the command goes on
        await asyncio.wait_for(waiting, 5)
        assert proc.readers == [first]

    asyncio.run(asyncio.wait_for(scenario(), 30))


def _routes(engine: Engine) -> tuple[FastAPI, Sandboxes]:
    """An app with only the E2B routes, every token tenant ``u``'s."""

    async def admit(token: str | None) -> str:
        return "u"

    app = FastAPI()
    boxes, _ = add_e2b_routes(app, engine, admit)
    return app, boxes


def test_envd_says_why_a_sandbox_is_gone() -> None:
    """E2B's SDK shows envd's 502 message: it names what happened to the sandbox."""

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))

        app, boxes = _routes(engine)
        lost, closed = [await boxes.create("u", "e", 60, {}, {}) for _ in range(2)]
        engine.lifecycle.environment_lost(lost.trajectory.key, "SandboxExited", "killed")
        await engine.close_trajectory("u", closed.id)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for box, why in ((lost, "lost: killed (SandboxExited)"), (closed, "does not exist")):
                r = await http.get("/health", headers={"E2b-Sandbox-Id": box.id})
                assert r.status_code == 502
                assert box.id in r.json()["message"] and why in r.json()["message"]

    run(scenario)


def test_a_killed_or_unknown_sandbox_is_what_e2bs_sdk_calls_not_running() -> None:
    """E2B's SDK takes a 502 (REST) or ``unavailable`` (Connect) whose message says "was
    not found" for a sandbox killed or past its timeout; any other message it reads as
    unreachable, its state unknown. A sandbox killed here has no record left."""

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))

        app, boxes = _routes(engine)
        killed, expired = [await boxes.create("u", "e", 60, {}, {}) for _ in range(2)]
        await boxes.kill("u", killed.id)
        boxes.set_timeout(expired, 1)
        await engine.close_trajectory("u", expired.id)  # (as the reaper does at its timeout)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for sid in (killed.id, expired.id, "t-never-made"):
                head = {"E2b-Sandbox-Id": sid}
                health = await http.get("/health", headers=head)
                download = await http.get("/files", params={"path": "a"}, headers=head)
                for r in (health, download):
                    assert r.status_code == 502, r.text
                    error = format_envd_api_exception(r.status_code, get_message(r))
                    assert isinstance(error, SandboxNotRunningException), error
                    assert sid in str(error)
                r = await http.post("/filesystem.Filesystem/Stat", json={"path": "a"},
                                    headers=head)  # fmt: skip
                body = r.json()
                error = handle_rpc_exception(ConnectError(Code(body["code"]), body["message"]))
                assert isinstance(error, SandboxNotRunningException), error
                start = {"process": {"cmd": "true"}}
                r = await http.post("/process.Process/Start", content=envelope(start), headers={
                    **head, "Content-Type": "application/connect+json"})  # fmt: skip
                end = json.loads(r.content[5:])["error"]
                error = handle_rpc_exception(ConnectError(Code(end["code"]), end["message"]))
                assert isinstance(error, SandboxNotRunningException), error

    run(scenario)
