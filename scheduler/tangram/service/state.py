"""The mutable state every part of the engine shares, and the few services they all use.

One event loop runs the whole engine, so no locks are needed. The parts (admission, the
rounds, node membership, GPU calls, API quotas) each keep what is theirs alone and read
and change this for the rest; they are handed it, and it is handed the collaborators it
does not build: the agent hub, the metrics sink, the clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from tangram.api.learned import LearnedProgress
from tangram.api.wire import (
    NO_SESSIONS,
    NO_SESSIONS_WHY,
    NO_TERMINALS,
    NO_TERMINALS_WHY,
    ActionResult,
    AgentCancel,
    AgentReply,
    AgentRequest,
    AgentWarm,
    ErrorInfo,
    ExecRequest,
    TrajectoryState,
)
from tangram.scheduler.core.gpu_pool import Chunk
from tangram.scheduler.core.scheduler import Assignment, Scheduler
from tangram.service.agents import AgentGoneError, AgentHub, AgentLink, RequestNotTakenError
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.keys import KeyMemory, exec_target
from tangram.service.metrics import REJECTED_REASONS, Metrics
from tangram.service.problems import ProblemLog
from tangram.service.records import (
    RECONNECT_WINDOW_S,
    ActionKind,
    ActionRecord,
    EngineError,
    NoAgentError,
    NotTakenError,
    Request,
    TrajectoryRecord,
    err,
)

log = logging.getLogger("tangram.service")
MAX_CANCELLED_KEYS = 10_000  # cancels remembered for runs their agents may still hold
MAX_CLOSED = 4096  # closed trajectories remembered: a retried close comes within seconds


class PoolState:
    def __init__(
        self,
        config: PoolConfig,
        core: Scheduler,
        hub: AgentHub,
        metrics: Metrics,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.core = core
        self.hub = hub
        self.metrics = metrics
        self.clock = clock  # monotonic seconds: queueing, timings, windows
        self.wall = wall  # unix seconds: what users read (a trajectory's opening)
        self.trajectories: dict[str, TrajectoryRecord] = {}  # by key
        self.named: dict[tuple[str, str], TrajectoryRecord] = {}  # by (tenant, id)
        # Closed lately, by (tenant, id), newest last: a retried close whose answer was
        # lost gets the closed one, and a late request learns why it is gone.
        self.closed: OrderedDict[tuple[str, str], TrajectoryRecord] = OrderedDict()
        self.actions: dict[str, ActionRecord] = {}
        self.idempotent: KeyMemory[ActionRecord] = KeyMemory()
        # Runs an agent still held when it (re)joined, by (node, agent key): their unasked
        # replies end them (two nodes may run one key: a retry ran it again elsewhere). And
        # the agent keys of runs cancelled while running, most recent last: a run its agent
        # goes on with (the cancel was lost with its link) is cancelled again if adopted.
        self.adopted: dict[tuple[str, str], ActionRecord] = {}
        # What the open trajectories had done when the scheduler before this one saved its
        # state, by key: taken when their agents' hellos bring them back.
        self.progress_due: dict[str, LearnedProgress] = {}
        self.cancelled_keys: OrderedDict[str, None] = OrderedDict()
        # Actions whose end the metrics do not count, since another's counts the same run:
        # a keyed one cut off from its agent (the run it started ends later, adopted, or
        # its retry is answered), and an adopted run that answers nobody (its key's action
        # is counted). Each leaves the set when it ends.
        self.uncounted: set[str] = set()
        self.node_cores: dict[str, list[int]] = {}  # the pool's core index -> real core id
        self.node_gpus: dict[str, list[int]] = {}  # the pool's GPU index -> device index
        self.problems = ProblemLog()  # sandbox and node failures, for the pool's status
        self.leases: dict[str, str] = {}  # an API lease's id -> its action's id
        self.accepting = True
        self.draining = False  # the pool is being deleted: no new trajectories
        # Why it stopped, when its pool was deleted and the drain's time ran out
        # (``Engine.end_drain``); None: a stop of the scheduler itself.
        self.ended: str | None = None
        self.hurried = False  # the stop's grace was cut short (a second Ctrl-C)
        # Until then an unknown trajectory answers 503 (retry), not 404; ended early by
        # whoever knows every agent is back (the embedded mode's single local agent).
        self.reconnect_until = clock() + RECONNECT_WINDOW_S
        self.wake = asyncio.Event()  # a round is due: something arrived, ended or changed
        self.epoch = secrets.token_hex(3)  # this scheduler's run: action ids are unique by it
        self._ids = itertools.count(1)
        self._spawned: set[asyncio.Future[Any]] = set()

    def trajectory(self, tenant: str, tid: str) -> TrajectoryRecord:
        """``tenant``'s trajectory ``tid``: 404 for an unknown one or another tenant's; 503
        (retry) for an unknown one while agents may still be reconnecting."""
        rec = self.named.get((tenant, tid))
        if rec is None and self.reconnecting():
            raise EngineError(
                "unavailable",
                "trajectory",
                f"{tid} is not known yet: this scheduler has just started and node agents "
                "are still reconnecting; retry",
            )
        if rec is None:  # another tenant's trajectory of that id is not this tenant's
            recent = self.closed.get((tenant, tid))
            why = f" (closed: {recent.ended})" if recent is not None and recent.ended else ""
            raise EngineError("not_found", "trajectory", f"{tid} does not exist{why}")
        return rec

    def reconnecting(self) -> bool:
        """Whether agents may still be coming back with environments this scheduler does
        not know yet (it has just started)."""
        return bool(self.config.envs) and self.clock() < self.reconnect_until

    def add_trajectory(self, rec: TrajectoryRecord) -> None:
        self.trajectories[rec.key] = rec
        self.named[(rec.tenant, rec.id)] = rec
        rec.active_at = self.clock()

    def was_closed(self, rec: TrajectoryRecord) -> None:
        self.closed[(rec.tenant, rec.id)] = rec
        while len(self.closed) > MAX_CLOSED:
            self.closed.popitem(last=False)

    def drop_trajectory(self, rec: TrajectoryRecord) -> None:
        self.trajectories.pop(rec.key, None)
        if self.named.get((rec.tenant, rec.id)) is rec:
            self.named.pop((rec.tenant, rec.id))
        for key in rec.action_keys:  # (its own uses only: the key may be used elsewhere since)
            self.idempotent.drop(rec.tenant, key, exec_target(rec.id))
        rec.action_keys.clear()

    def usable(self, tenant: str, tid: str) -> TrajectoryRecord:
        """An open trajectory of ``tenant``; 503 (retry) while its agent is away."""
        traj = self.trajectory(tenant, tid)
        traj.active_at = self.clock()  # asked for: in use, its agent away or not
        if traj.state is TrajectoryState.AWAY:
            raise EngineError(
                "unavailable",
                "trajectory",
                f"{tid}: the agent of node {traj.node} is reconnecting; retry",
            )
        if traj.state is not TrajectoryState.OPEN:
            why = f": {traj.ended}" if traj.ended else ""
            raise EngineError("conflict", "trajectory", f"{tid} is {traj.state.value}{why}")
        return traj

    def unservable(
        self, node: str | None, req: ExecRequest, streamed: bool, interactive: bool
    ) -> EngineError | None:
        """Why ``node``'s agent cannot give the command of ``req`` what it asks (a session,
        a pty, input, its output streamed), or None. Refused before it queues rather than
        failed once run; an agent away is asked once back, and says so itself."""
        link = self.hub.links.get(node or "")
        if link is None:
            return None
        runtime = link.hello.runtime
        if req.pty and runtime in NO_TERMINALS:
            return EngineError("invalid", "pty", NO_TERMINALS_WHY)
        if req.session is not None and runtime in NO_SESSIONS:
            return EngineError("invalid", "session", f"{NO_SESSIONS_WHY}, not {runtime}")
        asked = [
            ("session", req.session is not None),
            ("pty", req.pty),
            ("stdin", req.stdin is not None),
            ("interactive", interactive),
            ("stream", streamed),
        ]
        field = next((name for name, on in asked if on), None)  # the first asked is named
        if field is None or not link.hello.no_io:
            return None
        return EngineError(
            "invalid",
            field,
            "sessions, input, a pty and streamed output need the environment's exec "
            f"server, which the agent of node {node} has not: {link.hello.no_io}",
        )

    def stopped(self, ran: bool, killed: bool = True) -> ErrorInfo:
        """The error of an action the stop ended: queued (``ran`` False: retryable, unless
        its pool is gone) or running at the end of the grace (it ran in part): killed, or
        (``killed`` False: a RewardService call) left to run on, no longer waited for."""
        end = "killed" if killed else "no longer waited for (it runs on to its end)"
        if self.ended is not None:
            return err("pool_deleted", f"{self.ended}: " + (end if ran else "never ran"))
        if ran:
            why = "its grace ran out"
            if self.hurried:
                why = "a second stop signal cut its grace short"
            return err("shutdown", f"the scheduler stopped: {end} ({why})")
        return err("shutdown", "the scheduler stopped", retryable=True)

    def stop_ended(self, rec: ActionRecord, killed: bool = True) -> ErrorInfo | None:
        """Why a running action was cancelled when the stop did it (the grace ended, the
        pool's drain ran out); None for a cancel its caller asked for."""
        return None if self.accepting or rec.cancelled else self.stopped(True, killed)

    def admitting(self, tenant: str, extra: int = 1) -> None:
        """Refuse new work while stopping, or when ``extra`` more would overfill the queue
        or the tenant's share of it (``spec.access.tenants[].maxQueued``)."""
        if not self.accepting:
            raise EngineError(
                "unavailable", "service", self.ended or "the scheduler is shutting down"
            )
        if self.core.queued + extra > self.config.max_queued:
            raise self.overloaded("queue", f"{self.core.queued} actions are queued")
        limit = self.config.limits(tenant).max_queued
        waiting = self.core.queued_by_tenant.get(tenant, 0)
        if limit is not None and waiting + extra > limit:
            raise self.overloaded(
                "queue",
                f"tenant {tenant} has {waiting} actions waiting, its limit is "
                f"{limit} (spec.access.tenants[].maxQueued)",
            )

    def overloaded(self, field: str, message: str) -> EngineError:
        """A refusal for want of room (429, Retry-After), counted as admission control
        shedding (``tangram_admission_rejected``, by ``field``: what was full, one of
        ``REJECTED_REASONS``) and logged at INFO (``-v``): every 429 is made here."""
        assert field in REJECTED_REASONS, field  # a label's values stay a few
        self.metrics.rejected.labels(self.config.name, field).inc()
        log.info("admission rejected: %s", message, extra={"reason": field})
        return EngineError("overloaded", field, message)

    def record(
        self,
        tenant: str,
        tid: str | None,
        kind: ActionKind,
        req: Request,
        argv: list[str] | None,
        *,
        target: str,
    ) -> ActionRecord:
        """A new action's record, with its id and the future its waiter awaits; ``tid``:
        its trajectory's key."""
        aid = f"a-{self.epoch}-{next(self._ids)}"  # unique across restarts by the epoch
        fut: asyncio.Future[ActionResult] = asyncio.get_running_loop().create_future()
        rec = ActionRecord(aid, tenant, tid, kind, req, argv, target, self.clock(), fut)
        if tid is not None and (traj := self.trajectories.get(tid)) is not None:
            rec.trajectory_id = traj.id
        return rec

    def adopted_as(self, rec: ActionRecord, asg: Assignment) -> None:
        """``rec`` is a run its agent holds under its key, adopted by the core as ``asg``.
        Its key answers with it, unless the key already names an action here: then it
        holds its units and answers nobody. A run cancelled before (the cancel lost with
        its link) is cancelled again."""
        assert rec.key is not None and rec.agent_key is not None
        rec.started, rec.assignment = asg.started_at, asg
        rec.sent = True  # (it runs there)
        self.actions[rec.id] = rec
        if (rec.tenant, rec.key) not in self.idempotent:
            self.idempotent.remember(rec.tenant, rec.key, rec)
        else:
            self.uncounted.add(rec.id)
        traj = self.trajectories.get(rec.trajectory or "")
        if traj is not None and rec.kind == "exec":
            traj.action_keys.add(rec.key)
        agent_key, node = rec.agent_key, asg.node
        self.adopted[(node or "", agent_key)] = rec
        if agent_key in self.cancelled_keys:
            rec.cancelled = True
            self.background(self.ask(node, AgentCancel(key=agent_key, output=True)))

    def note_cancelled(self, agent_key: str) -> None:
        self.cancelled_keys[agent_key] = None
        self.cancelled_keys.move_to_end(agent_key)
        while len(self.cancelled_keys) > MAX_CANCELLED_KEYS:
            self.cancelled_keys.popitem(last=False)

    def holder(self, tenant: str, group: str) -> str:
        """The core's trajectory that counts the tenant's actions of ``group`` that belong
        to no trajectory (API leases and calls, service calls), opened on first use."""
        holder = f"~{group}/{tenant}"  # "~" is never in a trajectory id
        if holder not in self.core.trajectories:
            self.core.open_trajectory(holder, tenant=tenant)
        return holder

    def env_of(self, traj: TrajectoryRecord) -> EnvConfig:
        """The trajectory's environment as configured now, or as it was opened if its
        definition has since been removed."""
        return self.config.envs.get(traj.env) or traj.env_config

    def keep_warm(self, node: str) -> None:
        """Tell ``node``'s agent the environments it keeps warm sandboxes of, all of them:
        it tops those up and removes the warm sandboxes of any other (a removed
        environment, or one no longer kept warm, would hold their memory for good).
        Not an agent that said it stops: no new trajectory opens on its node, so new warm
        sandboxes would serve nobody and hold up its stop (it waits for the ones it is
        making, then removes them all); its next agent is told as it joins."""
        if self.core.is_cordoned(node):
            return
        envs = [env.spec for env in self.config.envs.values() if env.spec.warm]
        self.background(self.ask(node, AgentWarm(envs=envs)))

    def background(self, work: Coroutine[Any, Any, Any] | asyncio.Future[Any]) -> None:
        """Run ``work`` unawaited, kept referenced until it ends."""
        task = asyncio.ensure_future(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        task.add_done_callback(_said)

    def spawned(self) -> list[asyncio.Future[Any]]:
        """What ``background`` runs and has not ended."""
        return list(self._spawned)

    def link(self, node: str | None) -> AgentLink:
        """The link to ``node``'s agent; NoAgentError (an EngineError, "unavailable") when
        it has none, or its link is ending."""
        link = self.hub.links.get(node or "")
        if link is None or link.closed:
            raise NoAgentError(node)
        return link

    def devices(self, chunk: Chunk) -> list[int]:
        """The device indexes of a GPU chunk on its node's worker."""
        devices = self.node_gpus.get(chunk.node, [])
        return [devices[g] for g in chunk.gpus if g < len(devices)]

    async def ask(self, node: str | None, req: AgentRequest) -> AgentReply:
        """``req`` to the agent of ``node``; EngineError ("unavailable") when it has none
        or its link ends before it answers."""
        with agent_gone(node):
            return await self.link(node).request(req)


@contextlib.contextmanager
def agent_gone(node: str | None) -> Iterator[None]:
    """A link that ends under what talks to it, as the engine says it: "unavailable"."""
    try:
        yield
    except RequestNotTakenError as e:  # (its message names the node already)
        raise NotTakenError(node, str(e)) from None
    except AgentGoneError as e:  # (its message names the node already)
        raise EngineError("unavailable", "node", str(e)) from None
    except (RuntimeError, OSError) as e:  # incl. a socket closing under us
        raise EngineError("unavailable", "node", f"node {node}: {e}") from None


def _said(task: asyncio.Future[Any]) -> None:
    """Retrieve a background task's failure, and say it: an agent gone meanwhile is
    expected (whoever waits on it hears of it), anything else is worth a warning."""
    if task.cancelled() or task.exception() is None:
        return
    e = task.exception()
    if isinstance(e, EngineError):
        log.debug("background work ended: %s", e)
    else:
        log.warning("background work failed: %s: %s", type(e).__name__, e)
