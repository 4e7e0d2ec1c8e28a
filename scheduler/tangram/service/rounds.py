"""The scheduling loop: a round of the core whenever something arrived, ended, or a rate
window is due; each assignment started and dispatched to where it runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from tangram.api.wire import ActionStatus, AgentExec, AgentReply, AgentSession, ExecRequest
from tangram.scheduler.core.scheduler import Assignment, SchedulingError
from tangram.service.agents import ACTION, CANCEL_WAIT_S, RunCancelled
from tangram.service.api_calls import ApiCalls
from tangram.service.gpu_calls import GpuCalls
from tangram.service.live import LiveExec
from tangram.service.outcomes import Outcomes
from tangram.service.records import ActionRecord, EngineError, err, ran_status
from tangram.service.state import PoolState, agent_gone

log = logging.getLogger("tangram.service")

OOM_KILLED = (
    "the kernel's out-of-memory killer killed it (or a process it waited for): its sandbox "
    "reached its TrajectoryEnv's spec.memoryGiB, or the node ran out of memory"
)


class Rounds:
    def __init__(self, state: PoolState, outcomes: Outcomes, gpu: GpuCalls, api: ApiCalls) -> None:
        self.s = state
        self.outcomes = outcomes
        self.gpu = gpu
        self.api = api
        self._timer: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        s = self.s
        while True:
            await s.wake.wait()
            s.wake.clear()
            now = s.clock()
            try:
                rnd = s.core.schedule(now)
            except Exception:  # a bug must not stop the service: shed what triggered it
                log.exception("scheduling round failed; rejecting the newest queued action")
                self._reject_newest()
                await asyncio.sleep(0.01)
                s.wake.set()
                continue
            for asg in rnd.assignments:
                try:
                    self.start(asg, now)
                except Exception:  # one bad start must not end the loop
                    log.exception("starting %s failed", asg.action_id)
                    self._abandon(asg.action_id)
            for bad in rnd.invalid:  # out of the queue: it could never run (as at submit)
                if (rec := s.actions.get(bad.action_id)) is not None:
                    error = err("invalid", str(bad))
                    self.outcomes.finish(rec, ActionStatus.REJECTED, error=error)
            for ahead in rnd.ahead:
                s.background(self.gpu.restore_ahead(ahead))
            if rnd.again:  # calls may join an instance it opened
                s.wake.set()
            if rnd.wake_at is not None:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = asyncio.get_running_loop().call_later(
                    max(0.0, rnd.wake_at - now), s.wake.set
                )

    def start(self, asg: Assignment, now: float) -> None:
        """An assignment of the round: its action starts where the round put it."""
        rec = self.s.actions[asg.action_id]
        rec.started, rec.assignment = now, asg
        if rec.kind == "api":
            call = self.api.start(rec)
            if call is not None:
                rec.task = self._run(rec, call)
            return
        if rec.expiry is not None:
            rec.expiry.cancel()
        if rec.kind == "service":
            rec.task = self._run(rec, self.gpu.call(rec, asg))
            return
        if rec.trajectory is not None:
            self.s.trajectories[rec.trajectory].running.add(rec.id)
        rec.task = self._run(rec, self._dispatch(rec, asg))

    def _abandon(self, aid: str) -> None:
        with contextlib.suppress(SchedulingError):
            self.s.core.complete(aid, self.s.clock(), ok=False)
        rec = self.s.actions.get(aid)
        if rec is not None:
            self.outcomes.finish(
                rec, ActionStatus.ERROR, error=err("start_failed", "could not start")
            )

    def _reject_newest(self) -> None:
        """A round raised: the newest queued action is the likeliest cause. Rejecting one
        per failed round isolates a poisonous request instead of stalling everyone."""
        for rec in reversed(list(self.s.actions.values())):
            if rec.started is None:
                self.s.core.cancel(rec.id)
                self.outcomes.finish(
                    rec,
                    ActionStatus.REJECTED,
                    error=err("scheduling_failed", "the scheduler could not place this action"),
                )
                return

    def _run(self, rec: ActionRecord, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """The task that runs a started action. It ends the action itself; if it ends
        without doing so — cancelled before its first step, so its body never ran and
        nothing was sent anywhere, or a bug — the action still ends and its units come
        back, or its waiter would wait forever."""
        task = asyncio.create_task(work)
        task.add_done_callback(lambda _: self._settle(rec, task))
        return task

    def _settle(self, rec: ActionRecord, task: asyncio.Task[None]) -> None:
        if rec.done.done():
            return
        if task.cancelled():
            self.outcomes.end(rec, ActionStatus.CANCELLED, ok=False)
            return
        log.error("action %s failed in the scheduler", rec.id, exc_info=task.exception())
        error = err("internal", "the scheduler failed")
        self.outcomes.end(rec, ActionStatus.ERROR, ok=False, error=error)

    async def _dispatch(self, rec: ActionRecord, asg: Assignment) -> None:
        """An exec action to its trajectory's agent, on the cores the round gave it."""
        s = self.s
        assert asg.node is not None and isinstance(rec.request, ExecRequest)
        assert rec.trajectory is not None
        req = rec.request
        cores = [s.node_cores[asg.node][i] for i in asg.cores]
        timeout = rec.timeout_s
        key = rec.agent_key
        traj = s.trajectories.get(rec.trajectory)
        environ = {**(traj.env_vars if traj is not None else {}), **req.env}
        op: AgentExec | AgentSession
        if req.session is not None:
            assert req.code is not None
            op = AgentSession(session=req.session, code=req.code, trajectory=rec.trajectory,
                              cores=cores, timeout_s=timeout, environ=environ,
                              output_cap=req.output_cap, key=key,
                              digest=rec.digest)  # fmt: skip
        else:
            assert rec.argv is not None
            live = rec.live
            op = AgentExec(argv=rec.argv, trajectory=rec.trajectory, cores=cores,
                           timeout_s=timeout, environ=environ, output_cap=req.output_cap,
                           key=key, digest=rec.digest, stdin=req.stdin, pty=req.pty,
                           stream=live is not None and live.output is not None,
                           interactive=live is not None and live.interactive)  # fmt: skip
        t0 = s.clock()
        status, reply, error = ActionStatus.ERROR, None, None
        ACTION.set(rec.id)  # (this task's own context: ``AgentLink.answered``)
        link = s.hub.links.get(asg.node)  # (whether its agent said it stops: read at a loss)
        rec.sent = True  # from here the agent may run it, whatever becomes of its link
        try:
            if rec.live is not None and isinstance(op, AgentExec):
                reply = await self._streamed(asg.node, op, rec.live)
            else:
                reply = await s.ask(asg.node, op)
            lost = rec.live.input_lost if rec.live is not None else None
            if reply.ok and reply.result is not None and lost is not None:
                error = err("input_refused", f"part of its input was refused ({lost}): the "
                            "command was killed rather than left to run without it")  # fmt: skip
            elif (ran := ran_status(reply)) is not None:  # (cancelled: its key's run again)
                status = ran
                if ran is ActionStatus.TIMEOUT and timeout is not None:  # say which limit
                    said = f"; {reply.error}" if reply.error else ""  # (a session's loss)
                    error = err("timeout", f"killed after {timeout:g} s ({rec.timeout_from}){said}")
                elif ran is ActionStatus.OK and reply.oom_killed:  # (it ran: status stays ok)
                    error = err("out_of_memory", OOM_KILLED)
            elif reply.unknown:
                error = err("outcome_unknown", reply.error or "its outcome is unknown")
            else:
                error = err(
                    "exec_failed", reply.error or "the agent refused the action", reply.retryable
                )
                if reply.reason:  # the node's fault (its cgroups), not the command's
                    s.problems.note(reply.reason, f"node {asg.node}", reply.error or "", t0)
        except asyncio.CancelledError as e:
            status = ActionStatus.CANCELLED
            if isinstance(e, RunCancelled):  # killed: what it wrote, how long it ran
                reply = e.reply
            error = s.stop_ended(rec)  # (queued ones: wind_down says so)
        except EngineError as e:
            stopping = link is not None and link.leaving  # (said since it was sent, too)
            error = self.outcomes.ask_failed(rec, e, stopping=stopping)
        if key is not None and reply is not None:
            s.cancelled_keys.pop(key, None)  # its run ended: a cancel of it is moot
        out = reply.result if reply is not None else None
        ran_s = reply.ran_s if reply is not None else None  # (a command that failed running)
        exec_s = out.exec_s if out is not None else (ran_s or 0.0)
        overhead = max(0.0, (s.clock() - t0) - exec_s)
        self.outcomes.end(rec, status, error=error, exec_s=exec_s, overhead_s=overhead, reply=reply,
                          learn=reply is None or not reply.replayed)  # fmt: skip

    async def _streamed(self, node: str, op: AgentExec, live: LiveExec) -> AgentReply:
        """``op`` as a streamed request: its output to the caller as it comes, the
        caller's input and signals to it. Cancelled, it waits (bounded) for the agent to
        report the command gone, as a plain request does: its cores are not free before."""
        with agent_gone(node):
            stream = self.s.link(node).stream(op)
            live.attach(stream)
            try:
                while (chunk := await live.take(stream)) is not None:
                    live.arrived(chunk)
                return await stream.reply()
            except asyncio.CancelledError:
                await stream.close(CANCEL_WAIT_S)  # (the close below then does nothing)
                if (reply := stream.answered()) is not None and reply.cancelled:
                    raise RunCancelled(reply) from None  # what it ran, as a plain one's
                raise
            finally:
                live.detach()
                await stream.close()
