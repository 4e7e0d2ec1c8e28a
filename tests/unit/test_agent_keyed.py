"""Results of keyed runs reported unasked (their requester's link dropped) reach the next
link: a run whose requester is cancelled in the very tick it ends (it used to raise
KeyError: the run was done but its done-callback, which keeps the result, had not run
yet), and a result a link took but could not send (it used to be lost)."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tangram.api.wire import (
    AGENT_SUBPROTOCOL,
    AgentCall,
    AgentExec,
    AgentReply,
    AgentRequest,
    RunningAction,
    RunningCall,
    ServiceOutcome,
    ServiceStats,
)
from tangram.node_agent.agent import NodeAgent, PodOptions
from tangram.node_agent.key_journal import KeyJournal
from tangram.node_agent.link import _session


def _ok(req: AgentRequest) -> AgentReply:
    return AgentReply(rid=req.rid, ok=True)


def _gate(
    agent: NodeAgent,
    monkeypatch: pytest.MonkeyPatch,
    answer: Callable[[AgentRequest], AgentReply] = _ok,
) -> asyncio.Future[None]:
    """Have ``agent`` run each request by waiting for the returned gate, then answering
    with ``answer`` (one call per run). Call it on the running loop."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run(req: AgentRequest) -> AgentReply:
        await gate
        return answer(req)

    monkeypatch.setattr(agent, "_run", run)
    return gate


def _stop_mid_run(agent: NodeAgent, monkeypatch: pytest.MonkeyPatch, req: AgentRequest) -> None:
    """Start ``req`` on ``agent`` and stop the agent (gracefully) while it runs."""

    async def go() -> None:
        _gate(agent, monkeypatch)  # never opened
        requester = asyncio.create_task(agent.handle(req))
        await asyncio.sleep(0)
        await agent.shutdown()
        await asyncio.gather(requester, return_exceptions=True)

    asyncio.run(go())


def test_a_requester_cancelled_as_its_keyed_run_ends_still_gets_it_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)

    async def go() -> list[AgentReply]:
        gate = _gate(agent, monkeypatch)
        req = AgentExec(rid=7, trajectory="t", argv=["true"], key="k", digest="d1")
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
    assert reply.digest == "d1"  # so that a scheduler that did not place it can compare


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


def test_keyed_runs_outlive_the_agent_in_its_journal_and_none_runs_twice(tmp_path: Path) -> None:
    """A restarted agent (the same state directory) replays what a key answered, and
    refuses as unknown a key whose run it was cut off in, instead of running it again."""
    first = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)

    async def exec_(agent: NodeAgent, rid: int, key: str) -> AgentReply:
        req = AgentExec(rid=rid, trajectory="t", argv=["true"], cores=[0], key=key)
        return await agent.handle(req)

    async def first_life() -> None:
        await first.runtime.open("t", None)  # type: ignore[arg-type]
        assert (await exec_(first, 1, "ended")).ok
        first.journal.started("cut")  # type: ignore[union-attr]  # as a run the crash cut off

    asyncio.run(first_life())
    again = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)

    async def second_life() -> tuple[AgentReply, AgentReply, AgentReply]:
        await again.runtime.open("t", None)  # type: ignore[arg-type]
        return (
            await exec_(again, 2, "ended"),
            await exec_(again, 3, "cut"),
            await exec_(again, 4, "new"),
        )

    replayed, unknown, new = asyncio.run(second_life())
    assert replayed.ok and replayed.replayed and replayed.result is not None
    assert not unknown.ok and unknown.unknown and "not run again" in (unknown.error or "")
    assert new.ok and not new.replayed
    # A third life still answers all three the same; the journal was rewritten at each
    # start (one line a key), not only appended to.
    third = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)

    async def third_life() -> list[AgentReply]:
        await third.runtime.open("t", None)  # type: ignore[arg-type]
        return [await exec_(third, 5 + i, k) for i, k in enumerate(("ended", "cut", "new"))]

    ended3, cut3, new3 = asyncio.run(third_life())
    assert ended3.ok and ended3.replayed and new3.ok and new3.replayed
    assert cut3.unknown and not cut3.ok
    assert len((tmp_path / "keys.journal").read_bytes().splitlines()) == 3


def test_a_pool_made_again_under_its_name_gets_nothing_of_the_deleted_ones_keys(
    tmp_path: Path,
) -> None:
    """The state directory is named after the pool's namespace and name: a pool deleted
    and made again under them had its agents replay the deleted pool's answers (a retry of
    ``task-7-step-1`` got the old sandbox's output, never run). Its own restart still
    replays them."""

    def agent(uid: str | None) -> NodeAgent:
        pods = None if uid is None else PodOptions(namespace="rl", execd_image="i",
                                                   pool="box", pool_uid=uid)  # fmt: skip
        return NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1, pods=pods)

    async def exec_(agent: NodeAgent, key: str) -> AgentReply:
        await agent.runtime.open("t", None)  # type: ignore[arg-type]
        req = AgentExec(rid=1, trajectory="t", argv=["true"], cores=[0], key=key)
        return await agent.handle(req)

    assert not asyncio.run(exec_(agent(None), "before")).replayed  # (an agent before uids)
    assert asyncio.run(exec_(agent("uid-1"), "before")).replayed  # taken as it was
    assert not asyncio.run(exec_(agent("uid-1"), "step-1")).replayed
    assert asyncio.run(exec_(agent("uid-1"), "step-1")).replayed  # its own restart
    made_again = agent("uid-2")
    assert not asyncio.run(exec_(made_again, "step-1")).replayed
    assert (tmp_path / "pool-uid").read_text() == "uid-2"


def test_a_restarted_agent_still_refuses_a_key_reused_for_another_request(
    tmp_path: Path,
) -> None:
    """Once the scheduler has forgotten a key (its bound, its restart), the agent is the
    last to know what it ran: a restarted one must not answer another request with it."""

    async def exec_(agent: NodeAgent, rid: int, trajectory: str, argv: list[str]) -> AgentReply:
        await agent.runtime.open(trajectory, None)  # type: ignore[arg-type]
        req = AgentExec(rid=rid, trajectory=trajectory, argv=argv, cores=[0], key="k")
        return await agent.handle(req)

    first = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    assert asyncio.run(exec_(first, 1, "t", ["true"])).ok
    again = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    same = asyncio.run(exec_(again, 2, "t", ["true"]))
    other = asyncio.run(exec_(again, 3, "t2", ["rm", "-rf", "x"]))
    assert same.ok and same.replayed
    assert not other.ok and not other.replayed
    assert "its idempotency key was used for exec on t, not exec on t2" in (other.error or "")


def test_a_journal_line_cut_by_a_crash_is_skipped(tmp_path: Path) -> None:
    journal = KeyJournal(tmp_path / "keys.journal")
    journal.started("a")
    journal.done("a", b'{"rid":0,"ok":true}')
    journal.started("b")
    journal.close()
    with (tmp_path / "keys.journal").open("ab") as f:
        f.write(b'{"d":"b","r":{"rid":0,"o')  # the process died mid-write
    done, started = KeyJournal(tmp_path / "keys.journal").load()
    assert done == {"a": b'{"rid":0,"ok":true}'} and started == {"b"}


@pytest.mark.parametrize(
    "line",
    [
        b"null",
        b"[1,2]",
        b'"s"',
        b'{"s":["k"]}',
        b'{"d":{"k":1},"r":{"rid":0,"ok":true}}',
        b'{"x":"k"}',
        b'{"d":"b","a":"exec on t"}',  # no reply
        b'{"d":"b","r":{"rid":"zero","ok":true}}',  # not a reply
        b'{"d":"b","r":[1]}',
        b'{"s":"b","a":7}',
    ],
)
def test_a_journal_line_not_of_its_form_is_skipped_and_logged(
    tmp_path: Path, line: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A line that is JSON but neither a start nor an end with a reply is skipped, counted
    and logged, the lines around it taken up; a key it names is kept as cut off (its run
    began, its reply is unknown: it is never run again)."""
    path = tmp_path / "keys.journal"
    path.write_bytes(
        b'{"s":"a","a":"exec on t"}\n' + line + b'\n{"d":"a","r":{"rid":0,"ok":true}}\n{"s":"c"}\n'
    )
    journal = KeyJournal(path)
    with caplog.at_level("WARNING", logger="tangram.agent"):
        done, started = journal.load()
    assert done == {"a": b'{"rid":0,"ok":true}'}
    assert started == ({"b", "c"} if b'"b"' in line else {"c"})
    assert journal.asked == {"a": "exec on t"} and journal.malformed == [2]
    # (the agent's records only: a collection may log another test's leftovers here)
    (warning,) = [r for r in caplog.records if r.name == "tangram.agent"]
    assert f"the key journal {path}: skipped 1 line(s) not of its form (line 2)" in (
        warning.getMessage()
    )


def test_an_agent_starts_on_a_journal_with_lines_not_of_its_form(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's start takes them up (a retry of a key they name is unknown, not run),
    says which lines once, and rewrites the journal without them."""
    path = tmp_path / "keys.journal"
    ok = b'{"rid":0,"ok":true}'
    path.write_bytes(
        b'{"s":"a"}\n[1,2]\n{"d":"a","r":' + ok + b'}\nnull\n{"d":"b","r":{"rid":"zero"}}\n'
    )
    with caplog.at_level("WARNING", logger="tangram.agent"):
        agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    assert [r.getMessage() for r in caplog.records if "key journal" in r.getMessage()] == [
        f"the key journal {path}: skipped 3 line(s) not of its form (line 2, 4, 5); a key "
        "named there without a reply is answered as cut off"
    ]

    async def retries() -> list[AgentReply]:
        reqs = [AgentExec(rid=i, trajectory="t", argv=["true"], cores=[0], key=k)
                for i, k in enumerate("ab", 1)]  # fmt: skip
        return [await agent.handle(r) for r in reqs]

    a, b = asyncio.run(retries())
    assert a.ok and a.replayed
    assert b.unknown and not b.ok
    assert KeyJournal(path).load()[0].keys() == {"a", "b"}  # rewritten, whole
    assert not any(b"[1,2]" in x or x == b"null" for x in path.read_bytes().splitlines())


def test_a_line_the_disk_took_only_part_of_leaves_the_next_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up mid-line: the append fails (the key is not run), and once there
    is room the next line starts on its own instead of gluing onto the torn one."""
    journal = KeyJournal(tmp_path / "keys.journal")
    journal.started("a")
    write = os.write

    def full_after_half(fd: int, data: bytes) -> int:
        monkeypatch.setattr(os, "write", no_space)
        return write(fd, bytes(data[: len(data) // 2]))

    def no_space(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_after_half)
    with pytest.raises(OSError, match="No space"):
        journal.started("b")
    monkeypatch.setattr(os, "write", write)  # room again
    journal.done("a", b'{"rid":0,"ok":true}')
    journal.started("c")
    journal.close()
    done, started = KeyJournal(tmp_path / "keys.journal").load()
    assert done == {"a": b'{"rid":0,"ok":true}'} and started == {"c"}


def test_a_keyed_run_cut_off_by_a_graceful_stop_is_unknown_to_the_next_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop cancels what runs; that is not a cancellation the client asked for, so it
    is not kept as "cancelled": the next agent answers the key as unknown."""
    first = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    _stop_mid_run(first, monkeypatch, AgentExec(rid=1, trajectory="t", argv=["true"], key="k"))
    again = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    req = AgentExec(rid=2, trajectory="t", argv=["true"], cores=[0], key="k")
    reply = asyncio.run(again.handle(req))
    assert reply.unknown and not reply.ok and reply.error != "cancelled"


def test_a_keyed_call_outlives_its_link_shows_in_the_next_hello_and_runs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service call whose link dropped goes on; the next link's hello names it (key,
    service, GPUs) for the scheduler to adopt; a retry of its key waits for that run (its
    reply is a replay: the run was another request's), and the reply also goes out
    unasked. Unlike an exec's, its key and reply are not journaled (next test)."""
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    runs: list[int] = []
    outcome = ServiceOutcome(outputs=[0.5], stats=ServiceStats(service="judge", resident=True),
                             exec_s=0.2)  # fmt: skip

    def answer(req: AgentRequest) -> AgentReply:
        runs.append(req.rid)
        return AgentReply(rid=req.rid, ok=True, call=outcome)

    async def go() -> tuple[AgentReply, list[AgentReply], AgentReply]:
        gate = _gate(agent, monkeypatch, answer)
        call = AgentCall(rid=3, service="judge", gpus=[2, 3], inputs=[[1.0]], key="u\x1fk")
        requester = asyncio.create_task(agent.handle(call))
        await asyncio.sleep(0)
        requester.cancel()  # its link dropped
        with pytest.raises(asyncio.CancelledError):
            await requester
        hello = agent.hello()
        assert hello.running == [] and len(hello.calls) == 1
        (running,) = hello.calls
        assert running.model_dump(exclude={"running_s"}) == RunningCall(
            key="u\x1fk", service="judge", gpus=[2, 3], running_s=0.0
        ).model_dump(exclude={"running_s"})
        assert running.running_s >= 0.0
        _, started = KeyJournal(tmp_path / "keys.journal").load()
        assert started == set()  # not written down before it started
        unasked: list[AgentReply] = []
        agent.attach(unasked.append)  # the next link
        retry = asyncio.create_task(agent.handle(call.model_copy(update={"rid": 4})))
        await asyncio.sleep(0)
        gate.set_result(None)
        answered = await retry
        await asyncio.sleep(0)
        assert agent.hello().calls == []
        again = await agent.handle(call.model_copy(update={"rid": 5}))
        return answered, unasked, again

    answered, unasked, again = asyncio.run(go())
    assert runs == [3]  # one run for the three requests
    assert answered.rid == 4 and answered.call == outcome and answered.replayed
    assert [(r.rid, r.key, r.call) for r in unasked] == [(0, "u\x1fk", outcome)]
    assert again.replayed and again.call == outcome
    done, _ = KeyJournal(tmp_path / "keys.journal").load()
    assert done == {}  # in memory only


def test_a_keyed_exec_outlives_its_link_and_the_hello_names_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next link's hello names the run with its cores, digest and time limit: the
    scheduler that adopts it says after how long a timeout killed it."""
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=2)

    async def go() -> RunningAction:
        _gate(agent, monkeypatch)  # never opened: the run goes on
        req = AgentExec(rid=1, trajectory="t", argv=["make"], cores=[1], key="u\x1fk",
                        digest="d", timeout_s=45.0)  # fmt: skip
        requester = asyncio.create_task(agent.handle(req))
        await asyncio.sleep(0)
        requester.cancel()  # its link dropped
        with pytest.raises(asyncio.CancelledError):
            await requester
        (running,) = agent.hello().running
        return running

    running = asyncio.run(go())
    assert running.model_dump(exclude={"running_s"}) == RunningAction(
        key="u\x1fk", trajectory="t", cores=[1], running_s=0.0, digest="d", timeout_s=45.0
    ).model_dump(exclude={"running_s"})


def test_a_keyed_call_cut_off_by_the_agents_end_runs_again_when_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exec cut off so is answered as unknown (it may have changed something); a
    service call has nothing a second run could repeat, so the next agent runs it."""
    call = AgentCall(rid=1, service="judge", gpus=[0], inputs=[[1.0]], key="u\x1fk")
    _stop_mid_run(
        NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1), monkeypatch, call
    )
    again = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    outcome = ServiceOutcome(outputs=[0.5], stats=ServiceStats(service="judge", resident=False),
                             exec_s=0.2)  # fmt: skip
    ran: list[int] = []

    async def run(req: AgentRequest) -> AgentReply:
        ran.append(req.rid)
        return AgentReply(rid=req.rid, ok=True, call=outcome)

    monkeypatch.setattr(again, "_run", run)
    reply = asyncio.run(again.handle(call.model_copy(update={"rid": 2})))
    assert ran == [2] and reply.ok and reply.call == outcome
    assert not reply.unknown and not reply.replayed


def test_a_key_reused_for_something_else_is_refused_not_answered_with_anothers_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler refuses that while it remembers the key; the agent, which may remember
    it longer (the scheduler restarted, or its bound dropped the key), refuses it too."""
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)

    async def go() -> list[AgentReply]:
        gate = _gate(agent, monkeypatch)
        first = asyncio.create_task(agent.handle(exec_t1))
        await asyncio.sleep(0)
        in_flight = await agent.handle(AgentCall(rid=5, service="judge", key="u\x1fk"))
        assert not in_flight.ok and "used for exec on t1" in (in_flight.error or "")
        gate.set_result(None)
        assert (await first).ok
        return [
            await agent.handle(exec_t1.model_copy(update={"rid": 2})),
            await agent.handle(exec_t1.model_copy(update={"rid": 3, "trajectory": "t2"})),
            await agent.handle(AgentCall(rid=4, service="judge", gpus=[0], key="u\x1fk")),
        ]

    exec_t1 = AgentExec(rid=1, trajectory="t1", argv=["true"], cores=[0], key="u\x1fk")
    again, other_trajectory, a_call = asyncio.run(go())
    assert again.ok and again.replayed
    assert not other_trajectory.ok and other_trajectory.error == (
        "its idempotency key was used for exec on t1, not exec on t2"
    )
    assert not a_call.ok and "used for exec on t1, not a call of service judge" in (
        a_call.error or ""
    )


def test_a_key_reused_for_another_command_on_its_trajectory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same target is not enough: a retry must ask for the same command (argv, input,
    environment, limits). Where it was placed may differ: a retry can land on other cores."""
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=2)
    first = AgentExec(rid=1, trajectory="t1", argv=["pytest", "-q"], cores=[0], key="u\x1fk")

    async def go() -> list[AgentReply]:
        gate = _gate(agent, monkeypatch)
        running = asyncio.create_task(agent.handle(first))
        await asyncio.sleep(0)
        other = first.model_copy(update={"rid": 2, "argv": ["rm", "x"]})
        in_flight = asyncio.create_task(agent.handle(other))
        await asyncio.wait({in_flight}, timeout=5)  # refused at once; joined, it would wait
        gate.set_result(None)
        assert (await running).ok
        return [
            await in_flight,
            await agent.handle(first.model_copy(update={"rid": 3, "stdin": "y\n"})),
            await agent.handle(first.model_copy(update={"rid": 4, "environ": {"A": "1"}})),
            await agent.handle(first.model_copy(update={"rid": 5, "cores": [1], "stream": True})),
        ]

    in_flight, other_stdin, other_env, moved = asyncio.run(go())
    for refused in (in_flight, other_stdin, other_env):
        assert not refused.ok and refused.error == (
            "its idempotency key was used for exec on t1 with another request"
        )
    assert moved.ok and moved.replayed and moved.rid == 5
