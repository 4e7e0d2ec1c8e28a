"""How actions end, driven through the real hub, links and engine by a fake agent: what
an ending frees is handed out at once and not before the agent says it is free, what an
adopted run teaches, and how the metrics count endings and refusals."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from tangram.api.wire import (
    ActionResult,
    ActionStatus,
    AgentReply,
    EnvSpec,
    ExecOutcome,
    ExecRequest,
    OpenTrajectory,
    RunningAction,
    ServiceCallRequest,
    Session,
    TrajectoryMeta,
)
from tangram.service.config import ANY_TENANT, EnvConfig, TenantLimits
from tangram.service.engine import Engine
from tangram.service.records import KEY_SEP, ActionRecord, EngineError
from tests.fixtures.fake_agent import Agent, answer_all, connect, hello, left, run, settle

SMALL = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.5))  # 4 fit on n1


def _held(msg: dict[str, Any]) -> AgentReply | None:
    """An agent whose commands run until told otherwise; it answers everything else."""
    return None if msg["op"] == "exec" else answer_all(msg)


class Killing(Agent):
    """An agent whose commands run until cancelled. While ``kills``, a cancel ends its
    command at once (the command's reply follows the cancel's); else the command goes
    on until the test pushes its reply. A stopping engine cancels what still runs, and
    so need not wait for an answer that would never come."""

    def __init__(self, kills: bool = True) -> None:
        super().__init__(hello(), self._answer)
        self.kills = kills

    def _answer(self, msg: dict[str, Any]) -> AgentReply | None:
        if msg["op"] == "exec":
            return None
        if msg["op"] == "cancel" and msg.get("target") is not None and self.kills:
            self.push(AgentReply(rid=msg["target"], ok=False, error="cancelled"))
        return answer_all(msg)


def _outcome(exec_s: float = 1.0, timed_out: bool = False) -> ExecOutcome:
    return ExecOutcome(exit_code=None if timed_out else 0, stdout="", stderr="",
                       stdout_truncated=False, stderr_truncated=False, timed_out=timed_out,
                       setup_s=0.0, exec_s=exec_s, teardown_s=0.0, path="fast")  # fmt: skip


def _counted(engine: Engine) -> dict[tuple[str, str], float]:
    """tangram_actions_total by (kind, status)."""
    return {
        (s.labels["kind"], s.labels["status"]): s.value
        for m in engine.metrics.registry.collect()
        for s in m.samples
        if s.name == "tangram_actions_total"
    }


def _rejected(engine: Engine, reason: str | None = None) -> float:
    """tangram_admission_rejected_total, of ``reason`` or of every reason."""
    return sum(
        s.value
        for m in engine.metrics.registry.collect()
        for s in m.samples
        if s.name == "tangram_admission_rejected_total"
        and s.labels["pool"] == engine.config.name
        and reason in (None, s.labels["reason"])
    )


# ---- a queued action taken out: the ones behind it start ---------------------------------


@pytest.mark.parametrize("how", ["cancel", "queue_timeout", "close"])
def test_a_queued_action_taken_out_lets_the_ones_it_blocked_start(how: str) -> None:
    """Node n1 has 2 cores, one held by a long command. A 2-core action waits at the head;
    a 1-core one behind it waits too (first come, first served on the node's cores). The
    head goes — cancelled, its queue timeout passed, its trajectory closed — and the one
    behind starts on the free core, with no other event."""

    async def scenario(engine: Engine) -> None:
        agent = Killing()
        await connect(engine, agent)
        for tid in ("t1", "t2", "t3"):
            await engine.open_trajectory("u", OpenTrajectory(env="e", id=tid))
        long = engine.submit_exec("u", "t1", ExecRequest(argv=["long"]))
        assert await settle(lambda: long.started is not None)
        timeout = 3600.0 if how == "queue_timeout" else None
        wide = engine.submit_exec(
            "u", "t2", ExecRequest(argv=["wide"], cpu=2, queue_timeout_s=timeout)
        )
        small = engine.submit_exec("u", "t3", ExecRequest(argv=["small"]))
        assert not await settle(lambda: small.started is not None)  # behind the wide one
        if how == "cancel":
            assert engine.cancel("u", wide.id)
        elif how == "queue_timeout":
            engine.outcomes.queue_timeout(wide)  # (what its timer calls)
        else:
            await engine.close_trajectory("u", "t2")
        assert wide.done.done() and wide.started is None
        assert await settle(lambda: small.started is not None)
        assert engine.core.cpu.nodes["n1"].free_cores == 0

    run(scenario, env=SMALL)


# ---- a started action cancelled twice: its cores wait for the agent's word -----------------


@pytest.mark.parametrize("again", ["action", "trajectory", "close"])
def test_a_second_cancel_does_not_free_the_cores_before_the_agent_answers(again: str) -> None:
    """A running command is cancelled; its agent has not yet said it is gone when a
    second cancel comes (a retried DELETE, the trajectory's cancel or close): its cores
    stay held, for no one else's command to start on them, until the agent answers."""

    async def scenario(engine: Engine) -> None:
        agent = Killing(kills=False)
        await connect(engine, agent)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t2"))
        first = engine.submit_exec("u", "t1", ExecRequest(argv=["a"], cpu=2))
        assert await settle(lambda: bool(agent.ops("exec")))
        waiting = engine.submit_exec("u", "t2", ExecRequest(argv=["b"], cpu=2))
        assert engine.cancel("u", first.id)
        assert await settle(lambda: bool(agent.ops("cancel")))
        assert first.task is not None
        if again == "action":
            assert engine.cancel("u", first.id)  # still cancelling: not ended yet
        elif again == "trajectory":
            assert engine.cancel_trajectory("u", "t1") == 1
        else:
            engine.state.background(engine.close_trajectory("u", "t1"))
        await settle()
        assert first.task.cancelling() == 1  # its task was not cancelled a second time
        assert not first.done.done() and waiting.started is None
        assert len(agent.ops("cancel")) == 1
        rid = agent.ops("exec")[0]["rid"]
        agent.push(AgentReply(rid=rid, ok=False, error="cancelled"))  # the command is gone
        assert (await first.done).status is ActionStatus.CANCELLED
        assert await settle(lambda: waiting.started is not None)
        agent.kills = True

    run(scenario)


def test_an_actions_task_cancelled_twice_still_waits_for_the_agents_word() -> None:
    """However its task comes to be cancelled again (a stop after a cancel, say), the
    bounded wait for the agent's word that the command is gone runs its course."""

    async def scenario(engine: Engine) -> None:
        agent = Killing(kills=False)
        await connect(engine, agent)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t2"))
        first = engine.submit_exec("u", "t1", ExecRequest(argv=["a"], cpu=2))
        assert await settle(lambda: bool(agent.ops("exec")))
        waiting = engine.submit_exec("u", "t2", ExecRequest(argv=["b"], cpu=2))
        assert first.task is not None
        first.task.cancel()
        assert await settle(lambda: bool(agent.ops("cancel")))
        first.task.cancel()
        await settle()
        assert not first.done.done() and waiting.started is None
        agent.push(AgentReply(rid=agent.ops("exec")[0]["rid"], ok=False, error="cancelled"))
        assert (await first.done).status is ActionStatus.CANCELLED
        assert await settle(lambda: waiting.started is not None)
        agent.kills = True

    run(scenario)


# ---- adopted runs ------------------------------------------------------------------------


async def _adopted_and_ended(
    engine: Engine, run_: RunningAction, outcome: ExecOutcome
) -> ActionResult:
    """``run_`` of trajectory t1 handed back by an agent's hello (a restart), then its
    result, unasked: what its record ends with."""
    agent = Agent(hello([TrajectoryMeta(id="t1", tenant="u", env="e")], [run_]))
    await connect(engine, agent)
    (rec,) = engine.state.actions.values()
    agent.push(AgentReply(rid=0, ok=True, key=run_.key, result=outcome))
    return await rec.done


@pytest.mark.parametrize("timed_out", [True, False])
def test_an_adopted_run_teaches_nothing_of_a_type_it_may_not_be(timed_out: bool) -> None:
    """An agent hands back a keyed run (a scheduler restart, a link's blip) without the
    type its request named: learned as the generic ``exec:cpu2`` it would size every
    untyped 2-core command by a suite's 600 s. A timed-out one is no full run either."""

    async def scenario(engine: Engine) -> None:
        for _ in range(20):
            engine.core.book.observe("exec:cpu2", 2, 1.0)
        before = engine.core.book.mean_duration("exec:cpu2")
        run_ = RunningAction(key=f"u{KEY_SEP}suite", trajectory="t1", cores=[1, 2],
                             running_s=600.0)  # fmt: skip
        result = await _adopted_and_ended(engine, run_, _outcome(600.0, timed_out))
        assert result.status is (ActionStatus.TIMEOUT if timed_out else ActionStatus.OK)
        assert engine.core.book.mean_duration("exec:cpu2") == before
        assert engine.core.trajectories["t1"].steps_done == (0 if timed_out else 1)

    run(scenario)


@pytest.mark.parametrize("limit", [30.0, None])
def test_an_adopted_run_that_timed_out_says_it_was_killed(limit: float | None) -> None:
    """Its limit was set by the scheduler before the restart: the timeout's message says
    after how long it was killed where its agent says (an older agent does not)."""

    async def scenario(engine: Engine) -> None:
        run_ = RunningAction(key=f"u{KEY_SEP}k", trajectory="t1", cores=[1],
                             running_s=29.0, timeout_s=limit)  # fmt: skip
        result = await _adopted_and_ended(engine, run_, _outcome(30.0, True))
        assert result.status is ActionStatus.TIMEOUT and result.error is not None
        assert result.error.code == "timeout"
        after = "killed after 30 s" if limit is not None else "killed (its limit"
        assert result.error.message.startswith(after), result.error.message
        assert "scheduler restarted" in result.error.message

    run(scenario)


@pytest.mark.parametrize("saved", [True, False])
def test_a_trajectory_taken_back_after_a_restart_goes_on_from_what_it_had_done(
    saved: bool,
) -> None:
    """Its action count read 0 after a restart, and its length, learned when it ended, was
    the part after the restart: every length learned short. With what the scheduler before
    saved, it goes on counting; without, its length is not learned."""
    kept: list[Any] = []

    def ran(msg: dict[str, Any]) -> AgentReply | None:
        ok = AgentReply(rid=0, ok=True, result=_outcome())
        return ok if msg["op"] == "exec" else answer_all(msg)

    async def before(engine: Engine) -> None:
        await connect(engine, Agent(hello(), ran))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1", expected_steps=9))
        for _ in range(3):
            await engine.submit_exec("u", "t1", ExecRequest(argv=["true"])).done
        kept.append(engine._kept())

    async def after(engine: Engine) -> None:
        if saved:
            engine._resume(kept[0])
        meta = TrajectoryMeta(id="t1", tenant="u", env="e")
        await connect(engine, Agent(hello([meta]), ran))
        assert engine.trajectory("u", "t1").actions == (3 if saved else 0)
        await engine.submit_exec("u", "t1", ExecRequest(argv=["true"])).done
        traj = engine.core.trajectories["t1"]
        assert (traj.steps_done, traj.hint_steps) == ((4, 9) if saved else (1, None))
        # Saved again only when known whole: a count from the restart on is not its length.
        assert ("t1" in engine._kept().progress) is saved
        await engine.close_trajectory("u", "t1")
        assert engine.core.learned().lengths == ([4] if saved else [])

    run(before)
    (state,) = kept
    assert state.progress["t1"].model_dump() == {
        "actions": 3, "steps": 3, "busy_s": state.progress["t1"].busy_s,
        "hint_steps": 9, "hint_at": 0,
    }  # fmt: skip
    run(after, reconnecting=True)


def test_the_progress_kept_is_of_the_trajectories_furthest_along(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most MAX_PROGRESS of them (the document must fit a ConfigMap): those whose
    lengths a restart would lose the most of."""
    import tangram.service.engine as engine_module

    monkeypatch.setattr(engine_module, "MAX_PROGRESS", 1)

    def ran(msg: dict[str, Any]) -> AgentReply | None:
        ok = AgentReply(rid=0, ok=True, result=_outcome())
        return ok if msg["op"] == "exec" else answer_all(msg)

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello(), ran))
        for tid, steps in (("t1", 1), ("t2", 2)):
            await engine.open_trajectory("u", OpenTrajectory(env="e", id=tid))
            for _ in range(steps):
                await engine.submit_exec("u", tid, ExecRequest(argv=["true"])).done
        assert list(engine._kept().progress) == ["t2"]

    run(scenario)


# ---- metrics: each action once, by its final outcome; every 429 ---------------------------


@pytest.mark.parametrize("blips", [1, 2])
def test_a_keyed_exec_cut_off_by_its_link_is_counted_once_as_its_run_ended(blips: int) -> None:
    """Its link blips (once, or again while its run is adopted): its waiter hears
    outcome_unknown (it was sent: it may have run), the agent goes on with the run, which
    is adopted when it is back and ends ok: one command, counted once, ok."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), _held)
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        cut = engine.submit_exec("u", "t1", ExecRequest(argv=["make"], idempotency_key="k"))
        assert await settle(lambda: bool(first.ops("exec")))
        first.drop()
        await left(engine)
        assert (await cut.done).error.code == "outcome_unknown"  # type: ignore[union-attr]
        meta = TrajectoryMeta(id="t1", tenant="u", env="e")
        run_ = RunningAction(key=f"u{KEY_SEP}k", trajectory="t1",
                             cores=first.ops("exec")[0]["cores"], running_s=0.5)  # fmt: skip
        for _ in range(blips - 1):  # back, its run adopted, and gone again before it ends
            again = Agent(hello([meta], [run_]))
            await connect(engine, again)
            (adopted,) = engine.state.actions.values()
            again.drop()
            await left(engine)
            assert (await adopted.done).error.code == "outcome_unknown"  # type: ignore[union-attr]
        back = Agent(hello([meta], [run_]))
        await connect(engine, back)
        retry = engine.submit_exec("u", "t1", ExecRequest(argv=["make"], idempotency_key="k"))
        back.push(AgentReply(rid=0, ok=True, key=f"u{KEY_SEP}k", result=_outcome()))
        assert (await retry.done).status is ActionStatus.OK
        assert _counted(engine) == {("exec", "ok"): 1.0}

    run(scenario)


async def _exec_running_on_its_agent(engine: Engine) -> tuple[Agent, ActionRecord]:
    """An unkeyed exec of trajectory t1 that its agent holds (it never answers)."""
    agent = Agent(hello(), _held)
    await connect(engine, agent)
    await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
    cut = engine.submit_exec("u", "t1", ExecRequest(argv=["make"]))
    assert await settle(lambda: bool(agent.ops("exec")))
    return agent, cut


def test_an_unkeyed_exec_cut_off_by_its_link_is_counted_as_lost() -> None:
    """Without a key its run is killed with the link, if its agent lives: it ended
    outcome_unknown, counted so (no retry can ask its agent)."""

    async def scenario(engine: Engine) -> None:
        first, cut = await _exec_running_on_its_agent(engine)
        first.drop()
        await left(engine)
        assert (await cut.done).error.code == "outcome_unknown"  # type: ignore[union-attr]
        assert _counted(engine) == {("exec", "error"): 1.0}

    run(scenario)


def test_an_adopted_run_answering_nobody_is_not_counted() -> None:
    """Its key already has its answer here (the action was cancelled while its link was
    down, and counted so); the run its agent went on with is not counted again."""

    async def scenario(engine: Engine) -> None:
        first = Agent(hello(), _held)
        await connect(engine, first)
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        meta = engine.trajectory("u", "t1").meta()
        first.drop()
        await left(engine)
        answered = engine.state.record("u", "t1", "exec", ExecRequest(argv=["make"]), None,
                                       target="exec on t1")  # fmt: skip
        engine.state.idempotent.remember("u", "k", answered)
        engine.outcomes.finish(answered, ActionStatus.CANCELLED)
        run_ = RunningAction(key=f"u{KEY_SEP}k", trajectory="t1", cores=[1], running_s=1.0)
        back = Agent(hello([meta], [run_]))
        await connect(engine, back)
        (held,) = engine.state.actions.values()
        back.push(AgentReply(rid=0, ok=True, key=f"u{KEY_SEP}k", result=_outcome()))
        await held.done
        assert _counted(engine) == {("exec", "cancelled"): 1.0}

    run(scenario)


def test_a_service_call_cut_off_is_counted_once_as_its_node_reported_it() -> None:
    """A keyed call whose node left mid-call ends there, unheld; its node, back, reports
    it done: its outputs answer its key, and it is counted once, ok."""
    from tangram.api.wire import ServiceDef, ServiceOutcome, ServiceStats
    from tangram.service.config import PoolConfig, ServiceConfig

    spec = ServiceDef(name="judge", entrypoint="m:build", weights="/w.pt", gpu_memory_gb=1)

    async def scenario() -> None:
        e = Engine(PoolConfig(services={"judge": ServiceConfig(spec=spec)}))
        e.all_agents_joined()
        await e.start()
        try:
            rec = e.state.record("u", None, "service",
                                 ServiceCallRequest(inputs=[1], idempotency_key="k"), None,
                                 target="call of service judge")  # fmt: skip
            e.state.idempotent.remember("u", "k", rec)
            rec.started = e.state.clock()  # (it ran: its node left mid-call)
            rec.sent = True
            e.outcomes.cut_off(rec, "node g left the pool")
            e.outcomes.finish(rec, ActionStatus.ERROR)
            stats = ServiceStats(service="judge", resident=True)
            outcome = ServiceOutcome(outputs=[0.5], exec_s=1.0, stats=stats)
            e.membership.orphan("g", AgentReply(rid=0, ok=True, key=f"u{KEY_SEP}k", call=outcome))
            retry = e.submit_service(
                "u", "judge", ServiceCallRequest(inputs=[1], idempotency_key="k")
            )
            assert (await retry.done).output == [0.5]
            assert _counted(e) == {("service", "ok"): 1.0}
        finally:
            await e.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_every_429_is_counted_as_an_admission_rejection() -> None:
    """A tenant's maxTrajectories, and no node with the memory, answer 429 like a full
    queue; each is a rejection."""

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello()))  # 2 GiB; a trajectory takes 1
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        with pytest.raises(EngineError) as refused:
            await engine.open_trajectory("u", OpenTrajectory(env="e", id="t2"))
        assert (refused.value.kind, refused.value.field) == ("overloaded", "trajectory")
        assert _rejected(engine) == 1
        await engine.open_trajectory("v", OpenTrajectory(env="e", id="t1"))
        with pytest.raises(EngineError) as full:
            await engine.open_trajectory("w", OpenTrajectory(env="e", id="t1"))
        assert (full.value.kind, full.value.field) == ("overloaded", "env")
        assert _rejected(engine) == 2

    run(scenario, tenants={ANY_TENANT: TenantLimits(max_trajectories=1)})


def test_a_429_is_counted_by_its_reason_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The code knew what was full (a tenant's maxTrajectories, no node's memory, the
    queue) but the counter had no label for it and nothing was logged, even with -v."""

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello(), _held))  # 2 GiB; a trajectory takes 1
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        with pytest.raises(EngineError):
            await engine.open_trajectory("u", OpenTrajectory(env="e", id="t2"))
        await engine.open_trajectory("v", OpenTrajectory(env="e", id="t1"))
        with pytest.raises(EngineError):
            await engine.open_trajectory("w", OpenTrajectory(env="e", id="t1"))
        engine.submit_exec("u", "t1", ExecRequest(argv=["long"]))
        with pytest.raises(EngineError) as full:
            engine.submit_exec("u", "t1", ExecRequest(argv=["more"]))
        assert (full.value.kind, full.value.field) == ("overloaded", "queue")
        counted = {r: _rejected(engine, r) for r in ("queue", "trajectory", "env", "stream")}
        assert counted == {"queue": 1, "trajectory": 1, "env": 1, "stream": 0}

    with caplog.at_level(logging.INFO, logger="tangram.service"):
        run(scenario, tenants={ANY_TENANT: TenantLimits(max_trajectories=1, max_queued=1)})
    said = [getattr(r, "reason", None) for r in caplog.records
            if r.getMessage().startswith("admission rejected")]  # fmt: skip
    assert said == ["trajectory", "env", "queue"]


def test_an_action_ended_by_its_nodes_loss_counts_its_time_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A command 6.4 s in when its node was lost ended with act_s 0.0009 (its queueing
    alone), and its log line said status=error and not why."""
    now = [1000.0]

    async def scenario(engine: Engine) -> None:
        first, cut = await _exec_running_on_its_agent(engine)
        now[0] += 6.4
        first.drop()
        await left(engine)
        result = await cut.done
        assert result.error is not None and result.error.code == "outcome_unknown"
        assert result.timings.act_s == pytest.approx(6.4)
        assert result.timings.queued_s + result.timings.overhead_s == pytest.approx(6.4)

    with caplog.at_level(logging.INFO, logger="tangram.service"):
        run(scenario, clock=lambda: now[0])
    (ended,) = [r for r in caplog.records if r.getMessage() == "action ended"]
    assert getattr(ended, "act_s", None) == pytest.approx(6.4)
    assert getattr(ended, "error", None) == "outcome_unknown"
    assert getattr(ended, "detail", "").startswith("node n1 left the pool after the action was")


def test_a_queue_timeout_is_logged_with_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    """``queue_timeout`` logged status=rejected and no reason."""

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello(), _held))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        rec = engine.submit_exec("u", "t1", ExecRequest(argv=["x"]))
        engine.outcomes.queue_timeout(rec)  # (at once: no round has started it yet)
        assert (await rec.done).status is ActionStatus.REJECTED

    with caplog.at_level(logging.INFO, logger="tangram.service"):
        run(scenario)
    (ended,) = [r for r in caplog.records if r.getMessage() == "action ended"]
    assert (getattr(ended, "status", None), getattr(ended, "error", None)) == (
        "rejected",
        "queue_timeout",
    )
    assert "queue_timeout_s" in getattr(ended, "detail", "")


# ---- what the agent says beside an outcome ---------------------------------------------------


def test_an_oom_kill_and_a_lost_session_are_said_in_the_result() -> None:
    """A command the OOM killer ended read as any SIGKILL (status ok, exit 137, no word of
    why), and a session killed at its timeout as one that lived through it: the agent says
    both now, and the result carries it (``out_of_memory``; the timeout's message)."""
    lost = "the bash session did not answer its interrupt within 2 s and was killed"

    def ran(msg: dict[str, Any]) -> AgentReply | None:
        if msg["op"] == "exec":
            return AgentReply(rid=0, ok=True, result=_outcome(), signal=9, oom_killed=True)
        if msg["op"] == "session":
            return AgentReply(rid=0, ok=True, result=_outcome(timed_out=True), error=lost)
        return answer_all(msg)

    async def scenario(engine: Engine) -> None:
        docker = hello().model_copy(update={"runtime": "docker"})  # (one with sessions)
        await connect(engine, Agent(docker, ran))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        oom = await engine.submit_exec("u", "t1", ExecRequest(argv=["grab"])).done
        assert oom.status is ActionStatus.OK and oom.error is not None
        assert oom.error.code == "out_of_memory" and "spec.memoryGiB" in oom.error.message
        step = ExecRequest(session=Session(kind="bash"), code="sleep 9", timeout_s=1)
        killed = await engine.submit_exec("u", "t1", step).done
        assert killed.status is ActionStatus.TIMEOUT and killed.error is not None
        assert killed.error.message == f"killed after 1 s (timeout_s); {lost}"

    run(scenario)


def test_an_ended_actions_log_line_names_its_node(caplog: pytest.LogCaptureFixture) -> None:
    """``--log-json`` promises ``node`` among the ids; the line of an action's end had the
    trajectory but no node (only a trajectory's opening had it)."""

    def ran(msg: dict[str, Any]) -> AgentReply | None:
        return AgentReply(rid=0, ok=True, result=_outcome()) if msg["op"] == "exec" else None

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello(), lambda m: ran(m) or answer_all(m)))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        await engine.submit_exec("u", "t1", ExecRequest(argv=["true"])).done

    with caplog.at_level(logging.INFO, logger="tangram.service"):
        run(scenario)
    (ended,) = [r for r in caplog.records if r.getMessage() == "action ended"]
    assert (getattr(ended, "node", None), getattr(ended, "trajectory", None)) == ("n1", "t1")


@pytest.mark.parametrize("hurried", [False, True])
def test_a_command_the_stop_killed_says_why_its_grace_ended(hurried: bool) -> None:
    """Killed by a second Ctrl-C, a command said it was killed at the end of its grace,
    which had not run out: each end says its own."""

    async def scenario(engine: Engine) -> None:
        await connect(engine, Killing())
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        rec = engine.submit_exec("u", "t1", ExecRequest(argv=["long"]))
        assert await settle(lambda: rec.started is not None)
        hurry = asyncio.Event()
        if hurried:
            hurry.set()
        await engine.wind_down(0.0 if not hurried else 3600.0, hurry)
        result = await rec.done
        assert result.status is ActionStatus.CANCELLED and result.error is not None
        why = "a second stop signal cut its grace short" if hurried else "its grace ran out"
        assert result.error.message == f"the scheduler stopped: killed ({why})"

    run(scenario)


def test_a_command_that_failed_running_counts_its_run_as_exec_time() -> None:
    """A command whose handler was killed under it failed after running 2.5 s: all of it
    was overhead_s, exec_s 0. The agent says how long it ran, and that is its exec_s."""

    def failed(msg: dict[str, Any]) -> AgentReply | None:
        if msg["op"] == "exec":
            return AgentReply(rid=0, ok=False, error="its handler ended first", ran_s=2.5)
        return answer_all(msg)

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello(), failed))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        result = await engine.submit_exec("u", "t1", ExecRequest(argv=["x"])).done
        assert result.status is ActionStatus.ERROR and result.timings.exec_s == 2.5
        assert result.timings.overhead_s < 2.5

    run(scenario)
