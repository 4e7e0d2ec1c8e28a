"""How an action ends: its units go back, its result goes to its waiter, once.

Every ending (an agent's reply, a call's answer, a cancel, a lease's release, a lost node,
a failed start) goes through :meth:`Outcomes.end` or, for actions the core does not run,
:meth:`Outcomes.finish`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from tangram.api.wire import (
    ActionResult,
    ActionStatus,
    AgentCancel,
    AgentReply,
    Allocation,
    ErrorInfo,
    ServiceStats,
    Timings,
    json_bytes,
)
from tangram.scheduler.core.scheduler import Assignment, SchedulingError
from tangram.service.records import ActionRecord, EngineError, NoAgentError, NotTakenError, err
from tangram.service.state import PoolState

log = logging.getLogger("tangram.service")
DETAIL_CHARS = 200  # an error's message on an action's log line, cut to this


def _short(message: str) -> str:
    """An error's message for a log line: its first line, within ``DETAIL_CHARS``."""
    first = message.splitlines()[0] if message else ""
    return first if len(first) <= DETAIL_CHARS else first[: DETAIL_CHARS - 3] + "..."


def lost_error(
    rec: ActionRecord, why: str, *, stopping: bool = False, not_taken: bool = False
) -> ErrorInfo:
    """The error of an action whose node's agent went before answering it: ``why`` says
    how, naming the node; ``stopping``: its agent had said it stops (it kills what still
    runs at the end of its grace); ``not_taken``: its agent answered that it took it not,
    its stop begun.

    Never sent there, or not taken, it never ran: ``node_lost``, retryable, under its key
    or a new one.
    Sent, it may have run, in part or to its end, and may run on: ``outcome_unknown``, not
    retryable (as a new action: that could run it twice). A retry under its idempotency
    key is never run again: it answers the run's outcome once the agent is back (the run
    adopted, its recorded reply), or ``outcome_unknown`` (an agent that restarted while it
    ran). A RewardService call has no side effect a second run could repeat (the agent
    runs a cut-off call again when retried, too): ``node_lost``, retryable, either way."""
    if not rec.sent:
        never = "the action was never sent there" if not not_taken else "it took no new action"
        never += ", so it did not run; a retry runs it"
        return err("node_lost", f"{why}: {never}", retryable=True)
    if rec.kind == "service":
        again = (
            "the call may have run there (its thread runs on to its end); a call has no "
            "side effect, so a retry runs it again, or, under its idempotency_key once that "
            "node is back, gets its outputs"
        )
        return err("node_lost", f"{why}: {again}", retryable=True)
    fate = "it may have run in part or to its end"
    if stopping:
        fate += ": its agent lets what runs finish within its grace, then kills what is left"
    elif rec.key is not None:
        fate += (
            ", and may still be running there: nothing killed it (an agent lets a keyed "
            "command run on when its link drops)"
        )
    else:
        fate += ": an agent that lives on kills an unkeyed command when its link drops"
    if rec.cancelled:
        fate += "; its cancel was not confirmed"
    if rec.key is None:
        then = "without an idempotency key its outcome cannot be asked for"
    else:
        then = (
            f"it is not run again under its idempotency_key {rec.key!r}: a retry with that "
            "key answers its outcome once the node's agent is back (or outcome_unknown), "
            "while another key would run it a second time"
        )
    return err("outcome_unknown", f"{why} after the action was sent there: {fate}; {then}")


class Outcomes:
    def __init__(self, state: PoolState) -> None:
        self.s = state

    def end(
        self,
        rec: ActionRecord,
        status: ActionStatus,
        *,
        ok: bool | None = None,
        complete: bool = True,
        learn: bool = True,
        **details: Any,
    ) -> None:
        """End a started action: the core gets its units back (``ok``, default: it ran to
        its end; ``complete=False`` when they stay held for now; ``learn`` as for the
        core's ``complete``), it leaves its trajectory's running set, its result goes out,
        and a round is due."""
        s = self.s
        if complete and rec.id in s.core.running:
            ok = status is ActionStatus.OK if ok is None else ok
            s.core.complete(rec.id, s.clock(), ok=ok, learn=learn)
        self.finish(rec, status, **details)
        s.wake.set()

    def cancel(self, tenant: str, aid: str) -> bool:
        """Cancel a queued or running action; False if it already ended."""
        s = self.s
        rec = s.actions.get(aid)
        if rec is None or rec.tenant != tenant:
            return False
        again, rec.cancelled = rec.cancelled, True
        if rec.started is None:
            s.core.cancel(aid)
            self.finish(rec, ActionStatus.CANCELLED)
            return True
        if again and rec.task is not None:
            # Its cancel is under way: its task waits (bounded) for the agent's word that
            # the command is gone before its cores go back. Cancelled again, it would stop
            # waiting, and the next round would hand them out under a running command (a
            # retried DELETE, a trajectory's cancel or close after the action's own).
            return True
        agent_key = rec.agent_key
        if agent_key is not None and rec.kind != "api":  # its agent goes on if the cancel
            s.note_cancelled(agent_key)  # is lost with its link
        if rec.task is not None:
            rec.task.cancel()  # the task ends it as cancelled
        elif rec.kind == "api":
            self.end_lease(rec)
        else:  # adopted after a restart: only its agent holds it; its result follows
            node = rec.assignment.node if rec.assignment else None
            if agent_key is not None and node is not None:
                s.background(s.ask(node, AgentCancel(key=agent_key, output=True)))
        return True

    def release(self, tenant: str, lease: str) -> ActionResult:
        """End a held API lease early."""
        aid = self.s.leases.get(lease)
        rec = self.s.actions.get(aid) if aid else None
        if rec is None or rec.tenant != tenant:
            raise EngineError("not_found", "lease", f"{lease} is not held")
        return self.end_lease(rec)

    def end_lease(self, rec: ActionRecord) -> ActionResult:
        """A lease ends (released, or its hold limit passed): its units go back."""
        assert rec.assignment is not None and rec.started is not None
        s = self.s
        if rec.expiry is not None:
            rec.expiry.cancel()
        now = s.clock()
        with contextlib.suppress(SchedulingError):
            s.core.complete(rec.id, now)
        if rec.lease is not None:
            s.leases.pop(rec.lease, None)
        s.actions.pop(rec.id, None)
        s.wake.set()
        result = self.result(rec, ActionStatus.OK, exec_s=now - rec.started)
        self.ended(rec, result)
        return result

    def queue_timeout(self, rec: ActionRecord) -> None:
        if rec.started is None and rec.id in self.s.actions:
            self.s.core.cancel(rec.id)
            self.finish(
                rec,
                ActionStatus.REJECTED,
                error=err("queue_timeout", "not started within queue_timeout_s", True),
            )

    def finish(self, rec: ActionRecord, status: ActionStatus, **details: Any) -> None:
        """Give an action's result (``details`` as for ``result``) to its waiter; it leaves
        the actions and its trajectory's running set, however it ended; and a round is due:
        a queued action taken out (cancelled, timed out, its trajectory closed) may have
        been the one the actions behind it waited for (the queue is first come, first
        served on each resource), though no unit came back."""
        if rec.expiry is not None:
            rec.expiry.cancel()
        self.s.actions.pop(rec.id, None)
        self.s.wake.set()
        if rec.trajectory is not None and (traj := self.s.trajectories.get(rec.trajectory)):
            traj.running.discard(rec.id)
            traj.active_at = self.s.clock()
        if not rec.done.done():
            result = self.result(rec, status, **details)
            rec.done.set_result(result)
            self.ended(rec, result)

    def cut_off(
        self, rec: ActionRecord, why: str, *, stopping: bool = False, not_taken: bool = False
    ) -> ErrorInfo:
        """An action whose node's agent went before answering it (``why`` says how,
        naming the node; ``stopping``: its agent had said it stops; ``not_taken``: its
        agent, stopping, said it took it not): the error it ends with (``lost_error``). A
        keyed exec or service call's outcome is the agent's to tell, so a retry of its key
        goes to the agent (a replay, a first run, or "unknown"; a run it still holds is
        adopted on its return), not to a kept error."""
        if rec.key is not None and rec.kind in ("exec", "service"):
            self.s.idempotent.forget(rec.tenant, rec.key, rec)
            if rec.sent:
                # Nor is its end counted: the run it started is counted once its outcome is
                # known here (its run adopted on the agent's return ends, or a retry of its
                # key is answered), as the action it ended as. One never sent ended here.
                self.s.uncounted.add(rec.id)
        return lost_error(rec, why, stopping=stopping, not_taken=not_taken)

    def ask_failed(self, rec: ActionRecord, e: EngineError, *, stopping: bool = False) -> ErrorInfo:
        """``cut_off`` for an action whose request to its agent failed with ``e``: with no
        agent there (its link went before the request was made), or one that, stopping,
        took it not, nothing of it ran."""
        if isinstance(e, NoAgentError):
            rec.sent = False
        return self.cut_off(
            rec, e.message, stopping=stopping, not_taken=isinstance(e, NotTakenError)
        )

    def ended(self, rec: ActionRecord, result: ActionResult) -> None:
        """Count it, keep the answer for its key's retries, log it."""
        s = self.s
        if rec.id in s.uncounted:  # (each action is counted once, by its final outcome)
            s.uncounted.discard(rec.id)
        else:
            s.metrics.ended(result)
        if s.idempotent.in_flight(rec.id):  # what its submitter got (a lease: the grant)
            rec.answer = json_bytes(rec.done.result())
            s.idempotent.ended(rec, rec.target, rec.answer, rec.digest)
        if log.isEnabledFor(logging.INFO):  # its fields cost ~1% of the CPU at 2,000/s
            log.info(
                "action ended",
                extra={
                    "action": result.id,
                    "trajectory": rec.trajectory,
                    "node": result.allocation.node,  # (None: it never started)
                    "kind": result.kind,
                    "status": result.status.value,
                    "act_s": round(result.timings.act_s, 6),
                    # why it ended so (None for an action that ran to its end): a line
                    # saying status=error and no more sent the reader to the client's logs
                    "error": result.error.code if result.error is not None else None,
                    "detail": _short(result.error.message) if result.error is not None else None,
                },
            )

    def devices(self, asg: Assignment) -> list[int]:
        """The device indexes of an assignment's GPU chunk (none for other actions)."""
        return self.s.devices(asg.chunk) if asg.chunk else []

    def result(
        self,
        rec: ActionRecord,
        status: ActionStatus,
        *,
        error: ErrorInfo | None = None,
        exec_s: float = 0.0,
        overhead_s: float = 0.0,
        restore_s: float = 0.0,
        reply: AgentReply | None = None,
        lease: str | None = None,
        output: Any = None,
        service: ServiceStats | None = None,
    ) -> ActionResult:
        now = self.s.clock()
        queued = (rec.started if rec.started is not None else now) - rec.submitted
        asg = rec.assignment
        out = reply.result if reply is not None else None
        # Validated construction on purpose: model_construct inspects default factories'
        # signatures on every call and costs more (py-spy, docs/benchmarks.md).
        alloc = Allocation()
        if asg is not None:
            node_cores = self.s.node_cores.get(asg.node or "", [])
            alloc = Allocation(
                node=asg.node,
                cores=[node_cores[i] for i in asg.cores if i < len(node_cores)],
                gpus=self.devices(asg),
                dop=asg.units if asg.cores or asg.chunk else 0,
                path=out.path if out is not None else None,
                fallback=(out.fallback or None) if out is not None else None,
            )
        return ActionResult(
            id=rec.id,
            trajectory=rec.shown_trajectory,
            kind=rec.kind,
            status=status,
            exit_code=out.exit_code if out is not None else None,
            signal=reply.signal if reply is not None and out is not None else None,
            stdout=out.stdout if out is not None else "",
            stderr=out.stderr if out is not None else "",
            stdout_truncated=out.stdout_truncated if out is not None else False,
            stderr_truncated=out.stderr_truncated if out is not None else False,
            lease=lease,
            output=output,
            service=service,
            error=error,
            allocation=alloc,
            timings=Timings(
                queued_s=queued,
                overhead_s=overhead_s,
                restore_s=restore_s,
                exec_s=exec_s,
                act_s=queued + overhead_s + restore_s + exec_s,
            ),
            idempotency_key=rec.key,
        )
