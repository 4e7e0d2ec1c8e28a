"""What an action whose node is lost ends with, driven through the real hub, links and
engine by fake agents: one never sent there did not run (``node_lost``, retryable, and a
retry under its key runs it); one sent there may have run (``outcome_unknown``, not
retryable, and a retry under its key is the agent's to answer, never a second run). Every
result carries the idempotency key it ran under, so that the retry can be made."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from tangram.api.wire import (
    AGENT_LEAVING,
    ActionStatus,
    AgentReply,
    ExecOutcome,
    ExecRequest,
    OpenTrajectory,
    RunningAction,
)
from tangram.service.engine import Engine
from tangram.service.records import KEY_SEP, ActionRecord, EngineError
from tests.fixtures.fake_agent import Agent, answer_all, connect, hello, left, run, settle

UNKNOWN = "its outcome is unknown: it was running when the node agent stopped"


def _outcome(stdout: str = "") -> ExecOutcome:
    return ExecOutcome(exit_code=0, stdout=stdout, stderr="", stdout_truncated=False,
                       stderr_truncated=False, timed_out=False, setup_s=0.0, exec_s=0.1,
                       teardown_s=0.0, path="fast")  # fmt: skip


def _first_agent(msg: dict[str, Any]) -> AgentReply | None:
    """Its ``hold`` commands run until its link drops; others exit 0 at once."""
    if msg["op"] == "exec":
        return None if msg["argv"] == ["hold"] else AgentReply(rid=0, ok=True, result=_outcome())
    return answer_all(msg)


def _agent_back(msg: dict[str, Any]) -> AgentReply | None:
    """The node's next agent, as its journal has it: key ``kb`` was cut off mid-run (it
    answers "unknown"), key ``ka`` still runs (its hello lists it), and any other command
    runs now, saying which key it ran under."""
    if msg["op"] != "exec":
        return answer_all(msg)
    if msg["key"] == f"u{KEY_SEP}kb":
        return AgentReply(rid=0, ok=False, unknown=True, error=UNKNOWN)
    return AgentReply(rid=0, ok=True, result=_outcome(f"ran {msg['key']}"))


def _keyed(engine: Engine, argv: list[str], key: str) -> ActionRecord:
    return engine.submit_exec("u", "t1", ExecRequest(argv=argv, idempotency_key=key))


def _runs(agents: list[Agent], key: str) -> int:
    """How many times the agents were asked to run the command of ``key``."""
    return sum(1 for a in agents for m in a.ops("exec") if m["key"] == f"u{KEY_SEP}{key}")


def test_a_lost_node_says_whether_it_was_sent_and_a_retry_of_its_key_never_runs_twice() -> None:
    """Two keyed commands run on n1 (both its cores), a third waits for a core. n1's link
    drops. The two sent end outcome_unknown, not retryable, saying they may have run and
    naming their key; the one never sent ends node_lost, retryable, saying it never ran.
    n1's agent comes back, still running ``ka`` and with ``kb`` cut off in its journal:
    the retry of ``kc`` runs it there (for the first time), the retry of ``ka`` waits for
    the run it adopted and gets its output, the retry of ``kb`` gets the agent's "unknown".
    No command was asked of an agent twice."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), _first_agent)
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        meta = engine.trajectory("u", "t1").meta()
        a, b = _keyed(engine, ["hold"], "ka"), _keyed(engine, ["hold"], "kb")
        c = _keyed(engine, ["make"], "kc")
        assert await settle(lambda: len(first.ops("exec")) == 2)
        assert not await settle(lambda: c.started is not None)  # it waits for a core
        first.drop()
        await left(engine)

        for rec, key in ((a, "ka"), (b, "kb")):
            sent = await asyncio.wait_for(rec.done, 5)
            assert sent.status is ActionStatus.ERROR and sent.error is not None, sent
            assert (sent.error.code, sent.error.retryable) == ("outcome_unknown", False)
            assert "after the action was sent there: it may have run" in sent.error.message
            assert "nothing killed it" in sent.error.message
            assert f"not run again under its idempotency_key {key!r}" in sent.error.message
            assert sent.idempotency_key == key and sent.allocation.node == "n1"
        never = await asyncio.wait_for(c.done, 5)
        assert never.error is not None, never
        assert (never.error.code, never.error.retryable) == ("node_lost", True)
        assert never.error.message == (
            "node n1 left the pool: the action was never sent there, so it did not run; a "
            "retry runs it"
        )
        assert never.idempotency_key == "kc" and never.allocation.node is None

        held = RunningAction(key=f"u{KEY_SEP}ka", trajectory="t1",
                             cores=first.ops("exec")[0]["cores"], running_s=1.0)  # fmt: skip
        back = Agent(hello(trajectories=[meta], running=[held]), _agent_back)
        await connect(engine, back)
        ran = await asyncio.wait_for(_keyed(engine, ["make"], "kc").done, 5)
        assert (ran.status, ran.stdout, ran.idempotency_key) == (
            ActionStatus.OK,
            f"ran u{KEY_SEP}kc",
            "kc",
        )
        unknown = await asyncio.wait_for(_keyed(engine, ["hold"], "kb").done, 5)
        assert unknown.error is not None and unknown.error.code == "outcome_unknown", unknown
        assert not unknown.error.retryable and unknown.idempotency_key == "kb"
        waits = _keyed(engine, ["hold"], "ka")
        assert not await settle(waits.done.done)  # the adopted run's, to come
        back.push(AgentReply(rid=0, ok=True, key=f"u{KEY_SEP}ka", result=_outcome("held")))
        adopted = await asyncio.wait_for(waits.done, 5)
        assert (adopted.status, adopted.stdout, adopted.idempotency_key) == (
            ActionStatus.OK,
            "held",
            "ka",
        )
        assert [_runs([first, back], k) for k in ("ka", "kb", "kc")] == [1, 2, 1]
        # (kb: the first agent's run, then the question its next agent answered unknown)
        assert [m["key"] for m in back.ops("exec")] == [f"u{KEY_SEP}kc", f"u{KEY_SEP}kb"]

    run(scenario)


def test_an_action_started_but_not_yet_sent_when_its_node_leaves_never_ran() -> None:
    """A round gave it n1's cores, and its task had not sent it yet when n1 left: it is
    among the node's running actions, but it never reached the agent, so it ends
    node_lost, retryable, and its key's retry runs it once the agent is back."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello())
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        meta = engine.trajectory("u", "t1").meta()
        real, gate = engine.rounds._run, asyncio.Event()

        def gated(rec: ActionRecord, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
            async def later() -> None:
                try:
                    await gate.wait()
                except asyncio.CancelledError:
                    work.close()
                    raise
                await work

            return real(rec, later())

        engine.rounds._run = gated  # type: ignore[method-assign]
        rec = _keyed(engine, ["make"], "k")
        assert await settle(lambda: rec.id in engine.core.running)  # started, not sent
        first.drop()
        await left(engine)
        result = await asyncio.wait_for(rec.done, 5)
        assert not first.ops("exec") and result.error is not None, result
        assert (result.error.code, result.error.retryable) == ("node_lost", True)
        assert result.idempotency_key == "k" and result.allocation.node == "n1"

        engine.rounds._run = real  # type: ignore[method-assign]
        back = Agent(hello(trajectories=[meta]), _agent_back)
        await connect(engine, back)
        again = await asyncio.wait_for(_keyed(engine, ["make"], "k").done, 5)
        assert (again.status, again.stdout) == (ActionStatus.OK, f"ran u{KEY_SEP}k")

    run(scenario)


def test_an_action_started_as_its_nodes_link_closed_was_never_sent() -> None:
    """Its node's link had closed (a failed send closes it, then waits for the socket's
    close) before the node's drain: a round started an action there meanwhile. Nothing
    went to the agent, so it ends node_lost, retryable, not outcome_unknown."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello())
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        engine.hub.links["n1"].closed = True  # (as ``fail_pending`` leaves it)
        result = await asyncio.wait_for(_keyed(engine, ["make"], "k").done, 5)
        assert not first.ops("exec") and result.error is not None, result
        assert (result.error.code, result.error.retryable) == ("node_lost", True)
        assert result.error.message.startswith("node n1 has no agent connected: the action")
        first.drop()

    run(scenario)


def test_a_command_its_stopping_agent_left_unanswered_may_have_run_in_part() -> None:
    """Its agent said it stops, and its link closed with the command unanswered (the
    agent kills what still runs at the end of its grace): outcome_unknown, saying so."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), _first_agent)
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        rec = _keyed(engine, ["hold"], "k")
        assert await settle(lambda: bool(first.ops("exec")))
        first.inbox.put_nowait(AGENT_LEAVING)
        assert await settle(lambda: engine.hub.links["n1"].leaving)
        first.drop()
        await left(engine)
        result = await asyncio.wait_for(rec.done, 5)
        assert result.error is not None and result.error.code == "outcome_unknown", result
        assert not result.error.retryable and result.error.message.startswith(
            "node n1's agent stopped after the action was sent there: it may have run in "
            "part or to its end: its agent lets what runs finish within its grace, then "
            "kills what is left"
        )

    run(scenario)


def test_a_command_cut_off_by_a_failed_send_after_its_agent_said_it_stops_says_so() -> None:
    """The agent said it stops only after the command was sent there; then a write to
    it failed (a close of another trajectory), so the link failed what waits before the
    hub drained the node, and the command's own task ended it, not the node's leave (as
    in the test above). Whether the agent stops is read at that loss, not at the send:
    its outcome_unknown says the agent lets what runs finish within its grace."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), _first_agent)
        await connect(engine, first)
        for tid in ("t1", "t2"):
            await engine.open_trajectory("u", OpenTrajectory(env="e", id=tid))
        rec = engine.submit_exec("u", "t1", ExecRequest(argv=["hold"]))
        assert await settle(lambda: bool(first.ops("exec")))
        assert not engine.hub.links["n1"].leaving  # (as the command was sent)
        first.inbox.put_nowait(AGENT_LEAVING)
        assert await settle(lambda: engine.hub.links["n1"].leaving)
        first.broken = True
        closing = asyncio.ensure_future(engine.close_trajectory("u", "t2"))  # its send fails
        result = await asyncio.wait_for(rec.done, 5)
        assert result.error is not None and result.error.code == "outcome_unknown", result
        assert result.error.message.startswith(
            "node n1: the agent disconnected after the action was sent there: it may have run "
            "in part or to its end: its agent lets what runs finish within its grace, then "
            "kills what is left"
        )  # (the link's word, not the leave's "node n1's agent stopped")
        await left(engine)
        with contextlib.suppress(EngineError):
            await closing

    run(scenario)


def test_an_unkeyed_action_sent_when_its_node_is_lost_says_its_outcome_cannot_be_asked() -> None:
    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), _first_agent)
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        rec = engine.submit_exec("u", "t1", ExecRequest(argv=["hold"]))
        assert await settle(lambda: bool(first.ops("exec")))
        first.drop()
        await left(engine)
        result = await asyncio.wait_for(rec.done, 5)
        assert result.error is not None and not result.error.retryable, result
        assert result.error.code == "outcome_unknown" and result.idempotency_key is None
        assert "without an idempotency key its outcome cannot be asked for" in (
            result.error.message
        )

    run(scenario)


def test_a_command_answered_not_taken_as_its_agent_leaves_at_once_did_not_run() -> None:
    """An idle agent that stops sends its word that it leaves, its answer "not taken" to
    an exec that crossed that word, and its close, back to back: the node's leave ran
    before the exec's waiter woke and ended the exec as sent, maybe run
    (``outcome_unknown``). Answered, it is left to its waiter: ``node_lost``, retryable."""

    async def scenario(engine: Engine) -> None:
        a = Agent(hello(), lambda m: None if m["op"] == "exec" else answer_all(m))
        await connect(engine, a)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        rec = _keyed(engine, ["x"], "k")
        assert await settle(lambda: bool(a.ops("exec")))
        rid = a.ops("exec")[0]["rid"]
        a.inbox.put_nowait(AGENT_LEAVING)
        a.push(AgentReply(rid=rid, ok=False, retryable=True, not_taken=True,
                          error="exec: the node agent is stopping"))  # fmt: skip
        a.drop()
        result = await asyncio.wait_for(rec.done, 5)
        await left(engine)
        assert result.error is not None and result.error.code == "node_lost", result.error
        assert result.error.retryable and "did not run" in result.error.message, result.error

    run(scenario)
