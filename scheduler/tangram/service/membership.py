"""Node membership: agents joining and leaving, and what they hand back.

A joining agent brings its cores, GPUs and the environments it holds: this scheduler's
(a reconnect) or a previous scheduler's (a restart); they are taken back with their files,
and actions and keyed service calls still running on it are adopted. An agent that says
it stops takes no new work from then on; what runs there may finish. A leaving agent's
actions end: ``node_lost`` (retryable) those never sent to it, ``outcome_unknown`` those
sent (they may have run; a retry of the key is the agent's to answer, once it is back).
Its trajectories wait out the pool's grace for it before they are lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from tangram.api.action import ActionSpec
from tangram.api.reasons import Reason
from tangram.api.wire import (
    ActionStatus,
    AgentReply,
    ExecRequest,
    RunningAction,
    TrajectoryMeta,
    TrajectoryState,
)
from tangram.scheduler.core.scheduler import SchedulingError
from tangram.service.agents import AgentLink, NodeRefusedError
from tangram.service.config import EnvConfig
from tangram.service.gpu_calls import GpuCalls
from tangram.service.keys import exec_target
from tangram.service.outcomes import Outcomes, lost_error
from tangram.service.records import KEY_SEP, ActionRecord, TrajectoryRecord, err, ran_status
from tangram.service.state import PoolState
from tangram.service.trajectories import Trajectories

log = logging.getLogger("tangram.service")
# Nodes joining and leaving: shown at the default level (logs.LIFECYCLE), both of them, so
# that a leave in the log is followed by its node's return, or by nothing.
nodes = logging.getLogger("tangram.service.nodes")


class Membership:
    def __init__(
        self, state: PoolState, outcomes: Outcomes, trajectories: Trajectories, gpu: GpuCalls
    ) -> None:
        self.s = state
        self.outcomes = outcomes
        self.trajectories = trajectories
        self.gpu = gpu
        self.refused: dict[str, str] = {}  # node -> why its agent was refused (standing)

    def _refused(self, node: str, reason: str, why: str) -> None:
        """``node``'s agent refused for ``why``: on the pool's status, counted once per
        cause while the agent keeps reconnecting."""
        s, subject = self.s, f"node {node}"
        if self.refused.get(node) == why:  # the same cause, reconnecting
            s.problems.touch(reason, subject, s.clock())
        else:
            s.problems.note(reason, subject, why, s.clock())
        self.refused[node] = why

    def second_agent(self, node: str, why: str) -> None:
        """A second agent was refused for ``node`` (the hub keeps the one serving it)."""
        self._refused(node, Reason.DUPLICATE_AGENT, why)

    async def join(self, link: AgentLink) -> None:
        s, hello = self.s, link.hello
        if hello.problem is not None:
            self._refused(hello.node, hello.problem.reason, hello.problem.message)
            raise NodeRefusedError(hello.problem.message)
        self.refused.pop(hello.node, None)
        cores = sorted(hello.action_cores)
        s.core.add_node(hello.node, cores=len(cores), memory_gb=hello.inventory.memory_gb)
        s.node_cores[hello.node] = cores
        if hello.gpu is not None:
            self.gpu.join(hello.node, hello.gpu)
        stale = [m.id for m in hello.trajectories if not self._take_back(m, hello.node)]
        self._lose_unlisted(hello.node, {m.id for m in hello.trajectories})
        # What it did not hand back is gone; what it did and nobody answers for is to close
        # until it says it closed it (its link may drop first: its next hello lists it).
        if stale:
            self.trajectories.to_close[hello.node] = set(stale)
        else:
            self.trajectories.to_close.pop(hello.node, None)
        adopted = sum(self._adopt_running(r, hello.node) for r in hello.running)
        adopted += self.gpu.adopt(hello.node, hello.calls)
        for tid in stale:  # environments nobody can use any more: lost before, or unknown
            s.background(self.trajectories.close_on(hello.node, tid))
        s.keep_warm(hello.node)  # also retires what it kept of envs removed while away
        nodes.info(
            "node %s joined: %d action cores, %s runtime, %d trajectories and %d running "
            "actions taken back, %d stale environments closed",
            hello.node,
            len(cores),
            hello.runtime,
            len(hello.trajectories) - len(stale),
            adopted,
            len(stale),
            extra={"node": hello.node},
        )
        s.wake.set()

    def _lose_unlisted(self, node: str, listed: set[str]) -> None:
        """The trajectories that waited for ``node``'s agent and that it did not bring back
        (their environment ended while it was away: a deleted pod, a killed container) are
        lost now, saying so, not at the grace's end as if the agent had not come back."""
        for rec in list(self.s.trajectories.values()):
            if rec.node == node and rec.state is TrajectoryState.AWAY and rec.key not in listed:
                self.trajectories.lose(
                    rec, f"the agent of node {node} came back without its environment: it "
                    "ended while the agent was away",
                )  # fmt: skip

    def _take_back(self, meta: TrajectoryMeta, node: str) -> bool:
        """A trajectory an agent holds: this scheduler's (a reconnect), or one a previous
        scheduler opened (a restart). False when its environment should go."""
        s = self.s
        if meta.id in self.trajectories.to_close.get(node, ()):
            return False
        rec = s.trajectories.get(meta.id)
        if rec is not None:
            if rec.node not in (None, node):
                return False
            if rec.state is TrajectoryState.AWAY:  # its agent is back within the grace
                if self._place_again(meta.id, s.env_of(rec), node, rec.tenant):
                    rec.state = TrajectoryState.OPEN
                    rec.active_at = s.clock()  # its idle time starts again from its return
                else:
                    self.trajectories.lose(rec, f"its memory is no longer free on {node}")
            if rec.state is TrajectoryState.OPEN:
                rec.node = node
                return True
            return False  # lost (the grace ended) or closed while its agent was away
        env = s.config.envs.get(meta.env)
        name = meta.name or meta.id
        # Taken when its tenant opened the id again while this agent was away too long; or
        # the open's retry opened another before this agent was back.
        if env is None or not meta.tenant or (meta.tenant, name) in s.named:
            return False
        if self.trajectories.opened_again(meta):
            return False
        if not self._place_again(meta.id, env, node, meta.tenant):
            return False
        rec = TrajectoryRecord(
            name, meta.tenant, meta.env, node, dict(meta.labels), meta.opened_at, env, key=meta.id
        )  # fmt: skip
        rec.env_vars = dict(meta.env_vars)
        if meta.open_key is not None and meta.open_digest is not None:
            rec.open_key = (meta.open_key, meta.open_digest)
        done = s.progress_due.pop(meta.id, None)
        rec.actions = done.actions if done is not None else 0
        s.core.resume_progress(meta.id, done)
        s.add_trajectory(rec)
        self.trajectories.taken_back(rec)
        return True

    def _place_again(self, tid: str, env: EnvConfig, node: str, tenant: str) -> bool:
        """Reserve a live environment's memory again on the node that holds it."""
        try:
            self.s.core.open_trajectory(tid, env.spec.memory_gb, tenant=tenant)
            self.s.core.place_trajectory(tid, node)
        except SchedulingError as e:
            log.warning("cannot take back trajectory %s on %s: %s", tid, node, e)
            return False
        return True

    def _adopt_running(self, run: RunningAction, node: str) -> bool:
        """An action still running on a node whose scheduler restarted: its cores stay
        held; a retry of its key waits for it; its result arrives unasked (``orphan``)."""
        s = self.s
        tenant, _, key = run.key.partition(KEY_SEP)
        traj = s.trajectories.get(run.trajectory)
        if traj is None or traj.tenant != tenant:
            return False
        index = {c: i for i, c in enumerate(s.node_cores[node])}
        req = ExecRequest(argv=["(adopted)"], idempotency_key=key)
        target = exec_target(traj.id)  # as its tenant named it when submitting
        rec = s.record(tenant, run.trajectory, "exec", req, None, target=target)
        # Its request's digest, as its agent kept it: another request under its key is
        # refused as it was before the restart (None from an older agent: not checked).
        rec.digest = run.digest
        rec.timeout_s = run.timeout_s
        rec.submitted = rec.submitted - run.running_s
        try:
            asg = s.core.adopt(
                rec.id,
                run.trajectory,
                ActionSpec(kind="exec", cpu=len(run.cores)),
                units=len(run.cores),
                started_at=s.clock() - run.running_s,
                node=node,
                cores=[index[c] for c in run.cores if c in index],
            )
        except SchedulingError as e:
            log.warning("cannot adopt running action %s on %s: %s", run.key, node, e)
            return False
        s.adopted_as(rec, asg)
        traj.running.add(rec.id)
        return True

    def orphan(self, node: str, reply: AgentReply) -> None:
        """The result of an adopted action or call, sent by its agent when it finished; or
        an environment that ended by itself."""
        if reply.lost is not None:
            self.trajectories.environment_lost(
                reply.lost, reply.reason or Reason.SANDBOX_EXITED, reply.error or ""
            )
            return
        if reply.warm_failed is not None:  # counted as a failed open of it is
            s = self.s
            s.problems.note(reply.reason or Reason.SANDBOX_START_FAILED,
                            f"TrajectoryEnv {reply.warm_failed}", reply.error or "",
                            s.clock())  # fmt: skip
            return
        self.s.cancelled_keys.pop(reply.key or "", None)  # (its run has ended)
        rec = self.s.adopted.pop((node, reply.key or ""), None)
        if rec is None:  # nobody holds its run: it ended while its node was away
            if reply.call is not None:
                self.gpu.answer(reply, reply.call)
            return
        if rec.kind == "service":
            self.gpu.ended_unasked(rec, reply)
            return
        out = reply.result
        status = ActionStatus.ERROR
        error = None
        if (ran := ran_status(reply)) is not None:
            status = ran
            if ran is ActionStatus.TIMEOUT:  # its limit's owner went with the old scheduler
                after = "" if rec.timeout_s is None else f" after {rec.timeout_s:g} s"
                error = err("timeout", f"killed{after} (its limit as sent before the "
                            "scheduler restarted)")  # fmt: skip
        elif reply.error == "cancelled":
            status = ActionStatus.CANCELLED
        else:
            error = err("exec_failed", reply.error or "the agent refused the action")
        exec_s = out.exec_s if out is not None else 0.0
        # Counted as a run to its end only when it was one (not one that timed out), as a
        # dispatched run is; never learned from: its agent does not say the type its
        # request named (``RunningAction``), and under the generic ``exec:cpuN`` it would
        # size every untyped command of that many cores by it.
        self.outcomes.end(rec, status, ok=status is ActionStatus.OK, learn=False, error=error,
                          exec_s=exec_s, reply=reply)  # fmt: skip

    def stopping(self, link: AgentLink) -> None:
        """``link``'s agent said it stops (SIGTERM): its node takes no new work from now
        on, as if its capacity were gone (the core's ``cordon_node``): new trajectories
        and service calls go to the other nodes, or wait for room. What runs there gets
        the agent's grace to finish, as usual.

        The next actions of its trajectories wait too, sent nowhere: their environment
        lives on that node and cannot move. When the link closes they end node_lost,
        retryable, with the node's other queued actions (``leave``), and the trajectories
        wait for its agent as after any loss: the path of a node lost, taken a little
        early. (Sent to the agent, which takes nothing once it stops, they would hold its
        cores unanswered until the link closed, then end ``outcome_unknown``: sent, as far
        as the scheduler can tell, though never run.)"""
        s, node = self.s, link.node
        if s.hub.links.get(node) is not link or node not in s.node_cores:
            return  # (not joined, or replaced by a newer link)
        with contextlib.suppress(SchedulingError):  # (a node of neither cores nor GPUs)
            s.core.cordon_node(node)
        self.gpu.fail_unloadable()  # it was perhaps the last node still loading a service
        running = sum(1 for r in s.core.running.values() if r.assignment.node == node)
        placed = sum(1 for n in s.core.cpu.placement.values() if n == node)
        nodes.info(
            "node %s is stopping: no new work goes there; %d actions run on within its "
            "agent's grace, new actions of its %d trajectories wait for it",
            node,
            running,
            placed,
            extra={"node": node},
        )
        s.wake.set()  # what waited behind its trajectories' next actions may start

    async def leave(self, link: AgentLink) -> None:
        s = self.s
        if link.node not in s.node_cores:
            return
        drained = s.core.drain_node(link.node)
        del s.node_cores[link.node]
        self.gpu.leave(link.node)
        why = f"node {link.node} left the pool"
        if link.leaving:
            why = f"node {link.node}'s agent stopped"
        ended = 0
        # Each ends by whether it was sent there (``lost_error``): not by running or
        # queued, since a round may have started one whose task has not sent it yet.
        for aid in (*drained.running, *drained.dropped):
            rec = s.actions.get(aid)
            # One its leaving agent answered is its waiter's to end, with that answer
            # (its units came back with the node).
            if rec is not None and aid not in link.answered:
                ended += 1
                if rec.task is not None:
                    rec.task.cancel()
                lost = self.outcomes.cut_off(rec, why, stopping=link.leaving)
                self.outcomes.finish(rec, ActionStatus.ERROR, error=lost, **_held_since(rec, s))
        # Its adopted runs end here too, those whose units already came back included (their
        # trajectory ended first); back, its hello lists those still running.
        for held in [k for k in s.adopted if k[0] == link.node]:
            rec = s.adopted.pop(held)
            if not rec.done.done():
                if rec.key is not None:
                    s.idempotent.forget(rec.tenant, rec.key, rec)
                lost = lost_error(rec, why, stopping=link.leaving)
                self.outcomes.finish(rec, ActionStatus.ERROR, error=lost, **_held_since(rec, s))
        self.gpu.fail_unloadable()  # (as at its stop: the rest may all have failed a load)
        away = [
            t for t in drained.trajectories
            if t in s.trajectories and s.trajectories[t].state is TrajectoryState.OPEN
        ]  # fmt: skip
        now = s.clock()
        for tid in away:
            s.trajectories[tid].state = TrajectoryState.AWAY
            s.trajectories[tid].away_since = now
        if away:
            s.background(self.lose_after_grace(link.node, away, now))
        if not s.accepting:  # the stop's own doing: no node was lost, nobody waits for it
            nodes.info(
                "node %s left as the scheduler stops: %d actions ended",
                link.node,
                ended,
                extra={"node": link.node},
            )
        elif link.leaving:  # its agent said it stops (SIGTERM): not lost, and it says so
            nodes.info(
                "node %s stopped: %d actions ended, %d trajectories wait %.0f s for its agent",
                link.node,
                ended,
                len(away),
                s.config.agent_grace_s,
                extra={"node": link.node},
            )
        else:
            nodes.warning(
                "node %s left: %d actions ended, %d trajectories wait %.0f s for its agent",
                link.node,
                ended,
                len(away),
                s.config.agent_grace_s,
                extra={"node": link.node},
            )
        s.wake.set()

    async def lose_after_grace(self, node: str, tids: Sequence[str], since: float) -> None:
        """The trajectories of an agent that did not come back in time are lost (their
        environments, if they still live, are closed when it does come back). Only the
        absence that began at ``since``: one that came back and left again has its own."""
        s = self.s
        grace = s.config.agent_grace_s
        await asyncio.sleep(grace)
        lost = [
            rec for t in tids
            if (rec := s.trajectories.get(t)) is not None
            and rec.state is TrajectoryState.AWAY and rec.away_since == since
        ]  # fmt: skip
        for rec in lost:
            self.trajectories.lose(
                rec, f"the agent of node {node} did not come back in {grace:.0f} s"
            )
        if lost:
            nodes.warning(
                "node %s: its agent did not come back in %.0f s: %d trajectories lost",
                node,
                grace,
                len(lost),
                extra={"node": node},
            )


def _held_since(rec: ActionRecord, s: PoolState) -> dict[str, float]:
    """The time a started action held its units until its node was lost, as its overhead:
    no reply says how long its command ran (a lost request in ``rounds`` counts it so).
    Without it the result's ACT was its queueing alone: 1 ms for a command 6 s in."""
    return {} if rec.started is None else {"overhead_s": max(0.0, s.clock() - rec.started)}
