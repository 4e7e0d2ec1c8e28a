"""The scheduling loop of the service: the core scheduler, driven by events.

Requests become core actions; a round runs whenever something arrived, finished, or a
rate window is due; each assignment is dispatched to the agent of its node, and its
result resolves the future the HTTP handler awaits. The engine owns every piece of
mutable state of the service and runs on one event loop, so no locks are needed.

Errors carry the field they are about (``EngineError.field``) and an HTTP-ish kind, so
the handlers only translate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import aiohttp

from tangram.api.action import ActionSpec
from tangram.api.cluster import ClusterSpec, ServiceSpec
from tangram.api.demand import ChoicesDemand, TableEfficiency, allowed_units
from tangram.api.wire import (
    AGENT_BACKOFF_MAX_S,
    ActionResult,
    ActionStatus,
    AgentReply,
    AgentRequest,
    Allocation,
    ApiCallRequest,
    ApiLeaseRequest,
    BatchItem,
    ErrorInfo,
    ExecRequest,
    GpuWorkerInfo,
    OpenTrajectory,
    PoolFigures,
    ResidentInstance,
    RunningAction,
    ServiceCallRequest,
    ServiceLoad,
    ServiceStats,
    Timings,
    TrajectoryInfo,
    TrajectoryMeta,
    TrajectoryState,
    json_bytes,
    valid_id,
)
from tangram.scheduler.core.dp import CHUNK_SIZES
from tangram.scheduler.core.scheduler import Assignment, Scheduler, SchedulingError
from tangram.service.agents import AgentGoneError, AgentHub, AgentLink, NodeRefusedError
from tangram.service.config import ApiEndpoint, EnvConfig, PoolConfig, ServiceConfig
from tangram.service.keys import KeyMemory, Remembered
from tangram.service.metrics import Metrics
from tangram.service.problems import ProblemLog

log = logging.getLogger("tangram.service")

KEY_SEP = "\x1f"  # joins tenant and idempotency key into the agent's key
# After a (re)start, the trajectories live in the agents, which reconnect within their
# backoff cap: until they are back, an unknown trajectory may be one of theirs.
RECONNECT_WINDOW_S = 3 * AGENT_BACKOFF_MAX_S

# "failed": the work was tried and cannot succeed as configured (a sandbox whose image is
# not on the node); retrying the same request will not help.
ErrorKind = Literal["invalid", "not_found", "conflict", "overloaded", "unavailable", "failed"]


class EngineError(Exception):
    def __init__(self, kind: ErrorKind, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.kind = kind
        self.field = field
        self.message = message


@dataclass(slots=True)
class TrajectoryRecord:
    id: str
    tenant: str
    env: str
    node: str | None
    labels: dict[str, str]
    opened_at: float  # unix seconds
    env_config: EnvConfig
    state: TrajectoryState = TrajectoryState.OPEN
    actions: int = 0
    open_s: float | None = None
    warm: bool | None = None
    running: set[str] = field(default_factory=set)
    ended: str = ""  # why it is lost
    away_since: float = 0.0  # engine clock when its agent last left (AWAY)

    def info(self) -> TrajectoryInfo:
        return TrajectoryInfo.model_validate(self, from_attributes=True)


@dataclass(slots=True)
class ActionRecord:
    id: str
    tenant: str
    trajectory: str | None
    kind: Literal["exec", "service", "api"]
    # None only on the stand-in answering a retry of a key whose action already ended
    request: ExecRequest | ApiLeaseRequest | ApiCallRequest | ServiceCallRequest | None
    argv: list[str] | None
    target: str  # what its idempotency key is for: "exec on t-1", "lease of search"
    submitted: float  # engine clock
    done: asyncio.Future[ActionResult]
    started: float | None = None
    assignment: Assignment | None = None
    task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None  # queue timeout, or a lease's hold limit
    cancelled: bool = False
    lease: str | None = None  # an API lease's id while held
    agent_key: str | None = None  # adopted after a restart: the key its agent runs it under
    answer: bytes | None = None  # ``done``'s result as JSON, once kept for its key's retries


class Engine:
    def __init__(self, config: PoolConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.core = Scheduler(ClusterSpec(apis=list(config.apis)), config.scheduling)
        self.hub = AgentHub(self._join, self._leave, config.heartbeat_timeout_s, self._orphan)
        self.trajectories: dict[str, TrajectoryRecord] = {}
        self.actions: dict[str, ActionRecord] = {}
        self.idempotent: KeyMemory[ActionRecord] = KeyMemory()
        self.node_cores: dict[str, list[int]] = {}  # the pool's core index -> real core id
        self.node_gpus: dict[str, list[int]] = {}  # the pool's GPU index -> device index
        self.h2d_gbps: dict[str, float] = {}  # measured by each GPU node's agent
        self.loads: dict[str, dict[str, ServiceLoad]] = {}  # node -> service -> load
        self.leases: dict[str, str] = {}  # lease id -> action id
        self.by_agent_key: dict[str, ActionRecord] = {}  # adopted actions, by agent key
        self.problems = ProblemLog()  # sandbox and node failures, for the pool's status
        self.refused: dict[str, str] = {}  # node -> why its agent was refused (standing)
        # Trajectories closed while their agent was away: their environments may still
        # live, and the agent hands them back on its return; they are closed, not revived.
        self.closed_away: dict[str, set[str]] = {}  # node -> trajectory ids
        # Until then an unknown trajectory answers 503 (retry), not 404; ended early by
        # whoever knows every agent is back (the embedded mode's single local agent).
        self.reconnect_until = clock() + RECONNECT_WINDOW_S
        self._spawned: set[asyncio.Future[Any]] = set()
        self._http: aiohttp.ClientSession | None = None  # outbound calls of proxied APIs
        self._specs: dict[tuple[Any, ...], ActionSpec] = {}  # validated action shapes
        # The pool's definitions anew (set by the CLI): from pushed documents, or with None
        # from the files; POST /v1/admin/reload calls it (in a thread: it may do I/O).
        self.reloader: Callable[[str | None], PoolConfig] | None = None
        self.accepting = True
        self.draining = False  # the pool is being deleted: no new trajectories
        self._ids = itertools.count(1)
        self._epoch = secrets.token_hex(3)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.metrics = Metrics(self)
        self.core.set_services(self._service_specs())

    # ---- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._rounds(), name="rounds"),
            asyncio.create_task(self.hub.watch(), name="heartbeats"),
        ]

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop admitting; give running actions ``grace_s`` to finish, cancel the rest."""
        self.accepting = False
        for rec in list(self.actions.values()):
            if rec.started is None:
                self.core.cancel(rec.id)
                self._finish(
                    rec,
                    ActionStatus.CANCELLED,
                    error=_err("shutdown", "the scheduler stopped", True),
                )
        running = [r.task for r in self.actions.values() if r.task is not None]
        if running:
            _, late = await asyncio.wait(running, timeout=grace_s)
            for t in late:
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*late, return_exceptions=True)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    @property
    def ready(self) -> bool:
        """Admitting, and able to run something: an agent is connected, or the pool has no
        environments at all (API quotas only: nothing needs a node)."""
        return self.accepting and (bool(self.hub.links) or not self.config.envs)

    def figures(self) -> PoolFigures:
        """What the operator copies into the ActionPool's status."""
        nodes = self.core.cpu.nodes.values()
        return PoolFigures(
            pool=self.config.name,
            epoch=self._epoch,
            accepting=self.accepting,
            draining=self.draining,
            nodes=len(self.hub.links),
            cores=sum(n.cores for n in nodes),
            cores_in_use=sum(n.cores - n.free_cores for n in nodes),
            gpus=sum(n.gpus for n in self.core.gpu.nodes.values()),
            gpus_in_use=sum(n.gpus - n.free_gpus for n in self.core.gpu.nodes.values()),
            queue_depth=self.core.queued,
            running=sum(1 for r in self.actions.values() if r.started is not None),
            trajectories=sum(
                1 for t in self.trajectories.values() if t.state is not TrajectoryState.CLOSED
            ),
            apis={name: q.in_use for name, q in sorted(self.core.quotas.items())},
            environments=len(self.config.envs),
            problems=self.problems.recent(self.clock()),
        )

    # ---- configuration ---------------------------------------------------------------
    async def reload(self, text: str | None) -> list[str]:
        """Apply the reloader's definitions (``text``: pushed documents; None: the files)
        and say what changed; ValueError, with the running ones kept, when they are wrong.
        In a thread: resolving secretRefs may ask the API server."""
        assert self.reloader is not None
        return self.reconfigure(await asyncio.to_thread(self.reloader, text))

    def reconfigure(self, config: PoolConfig) -> list[str]:
        """Apply new pool, environment and quota definitions while running; nothing
        queued is dropped. Returns what changed (and what could not), for the log."""
        changes: list[str] = []
        old = self.config
        for name in sorted(set(old.envs) | set(config.envs)):
            before, after = old.envs.get(name), config.envs.get(name)
            if before != after:
                verb = "added" if before is None else "removed" if after is None else "changed"
                changes.append(f"env {name} {verb}")
                if after is not None and after.spec.warm:
                    for node in self.hub.links:
                        self._background(self._ask(node, op="warm", env=after.spec))
        if old.services != config.services:
            changes.append("RewardServices " + (", ".join(sorted(config.services)) or "none"))
        if old.apis != config.apis:
            self.core.set_quotas(config.apis)
            changes.append("API quotas " + ", ".join(a.name for a in config.apis))
        scheduling = config.scheduling
        if scheduling != old.scheduling:
            try:
                self.core.set_config(scheduling)
                changes.append("scheduling")
            except SchedulingError as e:
                scheduling = replace(scheduling, ordering=old.scheduling.ordering)
                self.core.set_config(scheduling)
                changes.append(f"scheduling, except {e}")
        self.config = replace(config, scheduling=scheduling)
        if old.services != config.services:
            self.core.set_services(self._service_specs())
            for node in self.node_gpus:
                self._background(self._sync_services(node))
        self.hub.heartbeat_timeout_s = config.heartbeat_timeout_s
        self.metrics.pool = config.name
        self._wake.set()
        return changes

    def env_of(self, traj: TrajectoryRecord) -> EnvConfig:
        """The trajectory's environment as configured now, or as it was opened if its
        definition has since been removed."""
        return self.config.envs.get(traj.env) or traj.env_config

    # ---- nodes -------------------------------------------------------------------
    async def _join(self, link: AgentLink) -> None:
        hello = link.hello
        if hello.problem is not None:
            p, subject = hello.problem, f"node {hello.node}"
            if self.refused.get(hello.node) == p.message:  # the same cause, reconnecting
                self.problems.touch(p.reason, subject, self.clock())
            else:
                self.problems.note(p.reason, subject, p.message, self.clock())
            self.refused[hello.node] = p.message
            raise NodeRefusedError(p.message)
        self.refused.pop(hello.node, None)
        cores = sorted(hello.action_cores)
        self.core.add_node(hello.node, cores=len(cores), memory_gb=hello.inventory.memory_gb)
        self.node_cores[hello.node] = cores
        if hello.gpu is not None:
            self._join_gpus(hello.node, hello.gpu)
        stale = [m.id for m in hello.trajectories if not self._take_back(m, hello.node)]
        self.closed_away.pop(hello.node, None)  # what it did not hand back is gone
        adopted = sum(self._adopt_running(r, hello.node) for r in hello.running)
        for tid in stale:  # environments nobody can use any more: lost before, or unknown
            self._background(self._ask(hello.node, op="close", trajectory=tid))
        for env in self.config.envs.values():
            if env.spec.warm:
                self._background(self._ask(hello.node, op="warm", env=env.spec))
        log.info(
            "node %s joined: %d action cores, %s runtime, %d trajectories and %d running "
            "actions taken back, %d stale environments closed",
            hello.node,
            len(cores),
            hello.runtime,
            len(hello.trajectories) - len(stale),
            adopted,
            len(stale),
        )
        self._wake.set()

    def _take_back(self, meta: TrajectoryMeta, node: str) -> bool:
        """A trajectory an agent holds: this scheduler's (a reconnect), or one a previous
        scheduler opened (a restart). False when its environment should go."""
        closed = self.closed_away.get(node, set())
        if meta.id in closed:
            closed.discard(meta.id)
            return False
        rec = self.trajectories.get(meta.id)
        if rec is not None:
            if rec.node not in (None, node):
                return False
            if rec.state is TrajectoryState.AWAY:  # its agent is back within the grace
                if self._place_again(meta.id, self.env_of(rec), node):
                    rec.state = TrajectoryState.OPEN
                else:
                    self._lose(rec, f"its memory is no longer free on {node}")
            if rec.state is TrajectoryState.OPEN:
                rec.node = node
                return True
            return False  # lost (the grace ended) or closed while its agent was away
        env = self.config.envs.get(meta.env)
        if env is None or not meta.tenant or not self._place_again(meta.id, env, node):
            return False
        self.trajectories[meta.id] = TrajectoryRecord(
            meta.id, meta.tenant, meta.env, node, dict(meta.labels), meta.opened_at, env
        )
        return True

    def _place_again(self, tid: str, env: EnvConfig, node: str) -> bool:
        """Reserve a live environment's memory again on the node that holds it."""
        try:
            self.core.open_trajectory(tid, env.spec.memory_gb)
            self.core.place_trajectory(tid, node)
        except SchedulingError as e:
            log.warning("cannot take back trajectory %s on %s: %s", tid, node, e)
            return False
        return True

    def _adopt_running(self, run: RunningAction, node: str) -> bool:
        """An action still running on a node whose scheduler restarted: its cores stay
        held; a retry of its key waits for it; its result arrives unasked (``_orphan``)."""
        tenant, _, key = run.key.partition(KEY_SEP)
        traj = self.trajectories.get(run.trajectory)
        if traj is None or traj.tenant != tenant or (tenant, key) in self.idempotent:
            return False
        index = {c: i for i, c in enumerate(self.node_cores[node])}
        req = ExecRequest(argv=["(adopted)"], idempotency_key=key)
        rec = self._record(
            tenant, run.trajectory, "exec", req, None, target=f"exec on {run.trajectory}"
        )
        rec.submitted = rec.submitted - run.running_s
        try:
            asg = self.core.adopt(
                rec.id,
                run.trajectory,
                ActionSpec(kind="exec", cpu=len(run.cores)),
                units=len(run.cores),
                started_at=self.clock() - run.running_s,
                node=node,
                cores=[index[c] for c in run.cores if c in index],
            )
        except SchedulingError as e:
            log.warning("cannot adopt running action %s on %s: %s", run.key, node, e)
            return False
        rec.started, rec.assignment = asg.started_at, asg
        self.actions[rec.id] = rec
        self.idempotent.remember(tenant, key, rec)
        rec.agent_key = run.key
        self.by_agent_key[run.key] = rec
        traj.running.add(rec.id)
        return True

    def _orphan(self, reply: AgentReply) -> None:
        """The result of an adopted action, sent by its agent when it finished; or an
        environment that ended by itself."""
        if reply.lost is not None:
            self._environment_lost(reply.lost, reply.reason or "SandboxExited", reply.error or "")
            return
        rec = self.by_agent_key.pop(reply.key or "", None)
        if rec is None or rec.id not in self.actions:
            return
        if rec.id in self.core.running:
            self.core.complete(rec.id, self.clock(), ok=reply.ok)
        if rec.trajectory in self.trajectories:
            self.trajectories[rec.trajectory].running.discard(rec.id)
        out = reply.result
        status = ActionStatus.ERROR
        error = None
        if reply.ok and out is not None:
            status = ActionStatus.TIMEOUT if out.timed_out else ActionStatus.OK
        elif reply.error == "cancelled":
            status = ActionStatus.CANCELLED
        else:
            error = _err("exec_failed", reply.error or "the agent refused the action")
        exec_s = out.exec_s if out is not None else 0.0
        self._finish(rec, status, error=error, exec_s=exec_s, reply=reply)
        self._wake.set()

    def _environment_lost(self, tid: str, reason: str, message: str) -> None:
        """A trajectory's environment ended by itself (evicted, killed, deleted): the
        trajectory is lost; its queued actions end with why, its running ones when their
        agent answers (their cores come back now: nothing runs in a sandbox that ended)."""
        rec = self.trajectories.get(tid)
        if rec is None or rec.state not in (TrajectoryState.OPEN, TrajectoryState.AWAY):
            return
        self.problems.note(reason, f"TrajectoryEnv {rec.env}", message, self.clock())
        self._lose(rec, f"{message} ({reason})")
        error = _err("environment_lost", f"trajectory {tid} is lost: {rec.ended}")
        self._release(rec, ActionStatus.ERROR, error, finished=False)
        self._wake.set()

    def _lose(self, rec: TrajectoryRecord, why: str) -> None:
        """The trajectory's environment is gone (or is closed on sight): every action
        answers 409 with ``why`` from now on."""
        rec.state, rec.ended = TrajectoryState.LOST, why
        log.warning("trajectory %s lost: %s", rec.id, why)

    def _background(self, work: Coroutine[Any, Any, Any] | asyncio.Future[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never unretrieved

    async def _leave(self, link: AgentLink) -> None:
        if link.node not in self.node_cores:
            return
        drained = self.core.drain_node(link.node)
        del self.node_cores[link.node]
        self.node_gpus.pop(link.node, None)
        self.h2d_gbps.pop(link.node, None)
        self.loads.pop(link.node, None)
        lost = _err("node_lost", f"node {link.node} left the pool", retryable=True)
        for aid in (*drained.running, *drained.dropped):
            rec = self.actions.get(aid)
            if rec is not None:
                if rec.task is not None:
                    rec.task.cancel()
                key = getattr(rec.request, "idempotency_key", None)
                if key is not None and rec.kind == "exec":
                    # Its outcome is its agent's to tell: a retry of the key goes to the
                    # agent (a replay, a first run, or "unknown"), not to a kept node_lost.
                    self.idempotent.forget(rec.tenant, key, rec)
                self._finish(rec, ActionStatus.ERROR, error=lost)
        away = [
            t for t in drained.trajectories
            if t in self.trajectories and self.trajectories[t].state is TrajectoryState.OPEN
        ]  # fmt: skip
        now = self.clock()
        for tid in away:
            self.trajectories[tid].state = TrajectoryState.AWAY
            self.trajectories[tid].away_since = now
        if away:
            self._background(self._lose_after_grace(link.node, away, now))
        log.log(
            logging.WARNING if self.accepting else logging.INFO,  # expected at shutdown
            "node %s left: %d actions ended, %d trajectories wait %.0f s for its agent",
            link.node,
            len(drained.running) + len(drained.dropped),
            len(away),
            self.config.agent_grace_s,
        )
        self._wake.set()

    async def _lose_after_grace(self, node: str, tids: Sequence[str], since: float) -> None:
        """The trajectories of an agent that did not come back in time are lost (their
        environments, if they still live, are closed when it does come back). Only the
        absence that began at ``since``: one that came back and left again has its own."""
        await asyncio.sleep(self.config.agent_grace_s)
        lost = [
            rec for t in tids
            if (rec := self.trajectories.get(t)) is not None
            and rec.state is TrajectoryState.AWAY and rec.away_since == since
        ]  # fmt: skip
        for rec in lost:
            self._lose(rec, f"the agent of node {node} did not come back in "
                            f"{self.config.agent_grace_s:.0f} s")  # fmt: skip
        if lost:
            log.warning(
                "node %s: its agent did not come back in %.0f s: %d trajectories lost",
                node,
                self.config.agent_grace_s,
                len(lost),
            )

    # ---- trajectories --------------------------------------------------------------
    def all_agents_joined(self) -> None:
        """Whoever knows every agent is back (the embedded mode, with its one) ends the
        window in which an unknown trajectory may still be an agent's."""
        self.reconnect_until = 0.0

    def trajectory(self, tenant: str, tid: str) -> TrajectoryRecord:
        rec = self.trajectories.get(tid)
        if rec is None and self.config.envs and self.clock() < self.reconnect_until:
            raise EngineError(
                "unavailable",
                "trajectory",
                f"{tid} is not known yet: this scheduler has just started and node agents "
                "are still reconnecting; retry",
            )
        if rec is None or rec.tenant != tenant:  # another tenant's trajectory does not exist
            raise EngineError("not_found", "trajectory", f"{tid} does not exist")
        return rec

    async def open_trajectory(self, tenant: str, req: OpenTrajectory) -> TrajectoryRecord:
        self._admitting()
        if self.draining:
            raise EngineError(
                "unavailable", "service", "the pool is being deleted: no new trajectories"
            )
        env = self.config.envs.get(req.env)
        if env is None:
            known = ", ".join(sorted(self.config.envs)) or "none"
            raise EngineError(
                "invalid", "env", f"unknown TrajectoryEnv {req.env!r} (known: {known})"
            )
        tid = req.id or f"t-{secrets.token_hex(6)}"
        if tid in self.trajectories:
            raise EngineError("conflict", "id", f"trajectory {tid} already exists")
        try:
            self.core.open_trajectory(tid, env.spec.memory_gb, req.expected_steps)
        except SchedulingError as e:
            raise EngineError("invalid", e.field, e.message) from None
        node = self.core.cpu.choose_node(env.spec.memory_gb, 0, {})
        if node is None:
            self.core.close_trajectory(tid, finished=False)
            raise EngineError(
                "overloaded" if self.hub.links else "unavailable",
                "env",
                f"no node has {env.spec.memory_gb} GiB free for a new trajectory",
            )
        self.core.place_trajectory(tid, node)
        rec = TrajectoryRecord(tid, tenant, req.env, node, dict(req.labels), time.time(), env)
        self.trajectories[tid] = rec
        try:
            meta = TrajectoryMeta(
                id=tid, tenant=tenant, env=req.env, labels=dict(req.labels), opened_at=rec.opened_at
            )
            reply = await self._ask(node, op="open", trajectory=tid, env=env.spec, meta=meta)
        except BaseException:
            self._forget(rec)
            raise
        if not reply.ok:
            self._forget(rec)
            why = f" ({reply.reason})" if reply.reason else ""
            if reply.reason:
                self.problems.note(reply.reason, f"TrajectoryEnv {req.env}",
                                   f"node {node}: {reply.error}", self.clock())  # fmt: skip
            # A cause that retrying cannot fix (no image) is "failed"; anything else
            # (a timeout, an eviction, no cause given) may work on the next try.
            kind: ErrorKind = "failed" if reply.reason and not reply.retryable else "unavailable"
            raise EngineError(kind, "env", f"opening on {node} failed{why}: {reply.error}")
        rec.open_s, rec.warm = reply.opened_s, reply.warm
        log.info(
            "trajectory opened",
            extra={
                "trajectory": tid,
                "tenant": tenant,
                "env": req.env,
                "node": node,
                "open_s": reply.opened_s,
                "warm": reply.warm,
            },
        )
        return rec

    def cancel_trajectory(self, tenant: str, tid: str) -> int:
        """Cancel every queued and running action of a trajectory, which stays open."""
        self.trajectory(tenant, tid)  # 404 for a stranger's
        mine = [a for a, r in self.actions.items() if r.trajectory == tid and r.tenant == tenant]
        return sum(self.cancel(tenant, aid) for aid in mine)

    async def close_trajectory(self, tenant: str, tid: str) -> TrajectoryRecord:
        rec = self.trajectory(tenant, tid)
        if rec.state in (TrajectoryState.CLOSED, TrajectoryState.CLOSING):
            return rec
        had_environment = rec.state is TrajectoryState.OPEN
        rec.state = TrajectoryState.CLOSING  # before any await: no new action gets in now
        for aid in [a for a, r in self.actions.items() if r.trajectory == tid]:
            self.cancel(tenant, aid)
        running = [self.actions[a].task for a in rec.running if a in self.actions]
        await asyncio.gather(*(t for t in running if t is not None), return_exceptions=True)
        if had_environment and rec.node in self.hub.links:
            with contextlib.suppress(EngineError):
                await self._ask(rec.node, op="close", trajectory=tid)
        elif rec.node is not None and rec.node not in self.hub.links:
            # Its agent is away: when it comes back it is told to close it, not asked
            # to hand it back.
            self.closed_away.setdefault(rec.node, set()).add(tid)
        self._forget(rec)
        rec.state = TrajectoryState.CLOSED
        log.info("trajectory closed", extra={"trajectory": tid, "actions": rec.actions})
        return rec

    def _forget(self, rec: TrajectoryRecord) -> None:
        """Drop a trajectory from the engine and the core."""
        self._release(rec, ActionStatus.CANCELLED, finished=rec.actions > 0)
        self.trajectories.pop(rec.id, None)

    def _release(
        self,
        rec: TrajectoryRecord,
        status: ActionStatus,
        error: ErrorInfo | None = None,
        *,
        finished: bool,
    ) -> None:
        """Give the trajectory's units back to the core: anything of it still running
        (an adopted action, one whose environment ended) is completed there, so its
        cores and memory never leak; its queued actions end with ``status``."""
        for aid in [a for a, r in self.core.running.items() if r.action.trajectory == rec.id]:
            with contextlib.suppress(SchedulingError):
                self.core.complete(aid, self.clock(), ok=False)
        if rec.id in self.core.trajectories:
            for aid in self.core.close_trajectory(rec.id, finished=finished):
                stale = self.actions.get(aid)
                if stale is not None:
                    self._finish(stale, status, error=error)

    # ---- actions -------------------------------------------------------------------
    def submit_batch(self, tenant: str, items: Sequence[BatchItem]) -> list[ActionRecord]:
        """Admit every item or none: an item refused withdraws the ones this call admitted
        before it (their keys too, so a retry runs them)."""
        self._admitting(extra=len(items))
        admitted: list[ActionRecord] = []
        fresh: list[ActionRecord] = []  # created here, not earlier actions found by key
        try:
            for item in items:
                before = len(self.actions)
                if item.exec is not None:
                    assert item.trajectory is not None
                    rec = self.submit_exec(tenant, item.trajectory, item.exec)
                elif item.score is not None:
                    assert item.service is not None
                    rec = self.submit_service(tenant, item.service, item.score)
                else:
                    assert item.api is not None
                    req = item.lease if item.lease is not None else item.call
                    assert req is not None
                    rec = self.lease_api(tenant, item.api, req)
                admitted.append(rec)
                if len(self.actions) > before:
                    fresh.append(rec)
        except EngineError:
            for rec in fresh:
                key = getattr(rec.request, "idempotency_key", None)
                if key is not None:  # first: a cancelled action's key would keep its answer
                    self.idempotent.forget(tenant, key, rec)
                self.cancel(tenant, rec.id)
            raise
        return admitted

    def _repeat(self, tenant: str, key: str | None, target: str) -> ActionRecord | None:
        """The action an idempotency key already names; a key reused for another
        operation or target is a conflict, not a replay."""
        if key is None:
            return None
        again = self.idempotent.get(tenant, key)
        if again is not None and again.target != target:
            raise EngineError(
                "conflict", "idempotency_key", f"{key!r} was used for {again.target}, not {target}"
            )
        if isinstance(again, Remembered):
            return self._replay(tenant, again)
        return again

    def _replay(self, tenant: str, kept: Remembered) -> ActionRecord:
        """A stand-in for an ended keyed action: its answer, ready."""
        result = ActionResult.model_validate_json(kept.result)
        fut: asyncio.Future[ActionResult] = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return ActionRecord(
            kept.id,
            tenant,
            result.trajectory,
            result.kind,
            None,
            None,
            kept.target,
            self.clock(),
            fut,
            answer=kept.result,
        )

    def submit_exec(self, tenant: str, tid: str, req: ExecRequest) -> ActionRecord:
        """Queue an exec action; ``await record.done`` for its result."""
        again = self._repeat(tenant, req.idempotency_key, f"exec on {tid}")
        if again is not None:
            return again
        self._admitting()
        traj = self._usable(tenant, tid)
        env = self.env_of(traj)
        argv, spec = self._exec_spec(env, req)
        rec = self._record(tenant, tid, "exec", req, argv, target=f"exec on {tid}")
        try:
            self.core.submit(rec.id, tid, spec, rec.submitted)
        except SchedulingError as e:
            raise EngineError("invalid", e.field, e.message) from None
        traj.actions += 1
        self._admit(rec, req.queue_timeout_s, req.idempotency_key)
        return rec

    def _usable(self, tenant: str, tid: str) -> TrajectoryRecord:
        """An open trajectory of ``tenant``; 503 (retry) while its agent is away."""
        traj = self.trajectory(tenant, tid)
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

    def _exec_spec(self, env: EnvConfig, req: ExecRequest) -> tuple[list[str] | None, ActionSpec]:
        cpu, t1, eff, argv = req.cpu, req.t1_s, req.efficiency, req.argv
        kind = req.type
        if req.profile is not None:
            prof = env.profiles.get(req.profile)
            if prof is None:
                known = ", ".join(sorted(env.profiles)) or "none"
                raise EngineError(
                    "invalid",
                    "profile",
                    f"{env.spec.name} has no profile {req.profile!r} (known: {known})",
                )
            argv = [*prof.command, *req.args]
            cpu = cpu if cpu is not None else prof.cpu
            t1 = t1 if t1 is not None else prof.t1_s
            eff = eff if eff is not None else prof.efficiency
            kind = kind or f"exec:{env.spec.name}/{req.profile}"
        cores = cpu if cpu is not None else env.cpu
        shape: tuple[Any, ...] = (cores, t1, eff, kind)
        try:
            spec = self._specs.get(shape)
        except TypeError:  # an unhashable part (an efficiency table): no caching
            shape, spec = (), None
        if spec is None:  # a handful of shapes recur: validate each once
            try:
                spec = ActionSpec(kind="exec", cpu=cores, t1_s=t1, efficiency=eff, type=kind)
            except ValueError as e:
                raise EngineError("invalid", "cpu", str(e)) from None
            if shape and len(self._specs) < 10_000:
                self._specs[shape] = spec
        return argv, spec

    def lease_api(
        self, tenant: str, api: str, req: ApiLeaseRequest | ApiCallRequest
    ) -> ActionRecord:
        """Queue a lease of ``req.units`` of an API quota (the result carries the lease
        id), or a call the service makes for the caller once the quota admits it."""
        what = f"{'lease' if isinstance(req, ApiLeaseRequest) else 'call'} of {api}"
        again = self._repeat(tenant, req.idempotency_key, what)
        if again is not None:
            return again
        self._admitting()
        configured = {a.name for a in self.config.apis}
        if api not in configured or api not in self.core.quotas:
            known = ", ".join(sorted(configured)) or "none"
            raise EngineError("not_found", "api", f"unknown API quota {api!r} (known: {known})")
        if isinstance(req, ApiCallRequest) and api not in self.config.endpoints:
            raise EngineError(
                "invalid", "api", f"quota {api!r} has no endpoint: lease it and call it yourself"
            )
        units = req.units if isinstance(req, ApiLeaseRequest) else 1
        # ``quotas`` are units beyond the one an api action holds anyway.
        spec = ActionSpec(kind="api", api=api, quotas={api: units - 1} if units > 1 else {})
        return self._submit_detached(tenant, "leases", req, spec, what)

    def _submit_detached(
        self,
        tenant: str,
        group: str,
        req: ApiLeaseRequest | ApiCallRequest | ServiceCallRequest,
        spec: ActionSpec,
        what: str,
    ) -> ActionRecord:
        """Queue an action that belongs to no trajectory (API leases and calls, service
        calls): the core counts it under the tenant's holder, ``~group/tenant``."""
        holder = f"~{group}/{tenant}"  # "~" is never in a trajectory id
        if holder not in self.core.trajectories:
            self.core.open_trajectory(holder)
        kind: Literal["service", "api"] = "service" if spec.kind == "service" else "api"
        rec = self._record(tenant, None, kind, req, None, target=what)
        try:
            self.core.submit(rec.id, holder, spec, rec.submitted)
        except SchedulingError as e:
            raise EngineError("invalid", e.field, e.message) from None
        self._admit(rec, req.queue_timeout_s, req.idempotency_key)
        return rec

    def release(self, tenant: str, lease: str) -> ActionResult:
        aid = self.leases.get(lease)
        rec = self.actions.get(aid) if aid else None
        if rec is None or rec.tenant != tenant:
            raise EngineError("not_found", "lease", f"{lease} is not held")
        return self._end_lease(rec)

    def _end_lease(self, rec: ActionRecord) -> ActionResult:
        assert rec.assignment is not None and rec.started is not None
        if rec.expiry is not None:
            rec.expiry.cancel()
        now = self.clock()
        with contextlib.suppress(SchedulingError):
            self.core.complete(rec.id, now)
        if rec.lease is not None:
            self.leases.pop(rec.lease, None)
        self.actions.pop(rec.id, None)
        self._wake.set()
        result = self._result(rec, ActionStatus.OK, exec_s=now - rec.started)
        self._ended(rec, result)
        return result

    def _ended(self, rec: ActionRecord, result: ActionResult) -> None:
        self.metrics.ended(result)
        if self.idempotent.in_flight(rec.id):  # what its submitter got (a lease: the grant)
            rec.answer = json_bytes(rec.done.result())
            self.idempotent.ended(rec, rec.target, rec.answer)
        if log.isEnabledFor(logging.INFO):  # its fields cost ~1% of the CPU at 2,000/s
            log.info(
                "action ended",
                extra={
                    "action": result.id,
                    "trajectory": result.trajectory,
                    "kind": result.kind,
                    "status": result.status.value,
                    "act_s": round(result.timings.act_s, 6),
                },
            )

    def cancel(self, tenant: str, aid: str) -> bool:
        """Cancel a queued or running action; False if it already ended."""
        rec = self.actions.get(aid)
        if rec is None or rec.tenant != tenant:
            return False
        rec.cancelled = True
        if rec.started is None:
            self.core.cancel(aid)
            self._finish(rec, ActionStatus.CANCELLED)
            return True
        if rec.task is not None:
            rec.task.cancel()  # the dispatch ends it as cancelled
        elif rec.kind == "api":
            self._end_lease(rec)
        else:  # adopted after a restart: only its agent holds it; its result follows
            node = rec.assignment.node if rec.assignment else None
            if rec.agent_key is not None and node is not None:
                self._background(self._ask(node, op="cancel", key=rec.agent_key))
        return True

    def _record(
        self,
        tenant: str,
        tid: str | None,
        kind: Literal["exec", "service", "api"],
        req: ExecRequest | ApiLeaseRequest | ApiCallRequest | ServiceCallRequest,
        argv: list[str] | None,
        *,
        target: str,
    ) -> ActionRecord:
        aid = f"a-{self._epoch}-{next(self._ids)}"  # unique across restarts by the epoch
        fut: asyncio.Future[ActionResult] = asyncio.get_running_loop().create_future()
        return ActionRecord(aid, tenant, tid, kind, req, argv, target, self.clock(), fut)

    def _admit(self, rec: ActionRecord, queue_timeout_s: float | None, key: str | None) -> None:
        self.actions[rec.id] = rec
        if key is not None:
            self.idempotent.remember(rec.tenant, key, rec)
        if queue_timeout_s is not None:
            rec.expiry = asyncio.get_running_loop().call_later(
                queue_timeout_s, self._queue_timeout, rec
            )
        self._wake.set()

    def _admitting(self, extra: int = 1) -> None:
        if not self.accepting:
            raise EngineError("unavailable", "service", "the scheduler is shutting down")
        if self.core.queued + extra > self.config.max_queued:
            self.metrics.rejected.labels(self.config.name).inc()
            raise EngineError("overloaded", "queue", f"{self.core.queued} actions are queued")

    def _queue_timeout(self, rec: ActionRecord) -> None:
        if rec.started is None and rec.id in self.actions:
            self.core.cancel(rec.id)
            self._finish(
                rec,
                ActionStatus.REJECTED,
                error=_err("queue_timeout", "not started within queue_timeout_s", True),
            )

    # ---- RewardService calls (the GPU manager) ----------------------------------------
    def _join_gpus(self, node: str, gpu: GpuWorkerInfo) -> None:
        """A node's GPU worker joins: its devices (as many as the pool's gpusPerNode allows,
        a power of two for buddy chunks) become a GPU node of the core, and it is told
        which services to load."""
        limit = min(len(gpu.devices), self.config.gpus_per_node or 8)
        count = max(k for k in CHUNK_SIZES if k <= limit)
        if count < len(gpu.devices):
            log.warning(
                "node %s: %d GPUs, buddy chunks use the first %d", node, len(gpu.devices), count
            )
        memory_gb = min(gpu.memory_bytes[:count]) / 2**30
        try:
            self.core.add_gpu_node(node, count, memory_gb)
        except SchedulingError as e:
            log.warning("the GPUs of %s cannot join: %s", node, e)
            return
        self.node_gpus[node] = list(gpu.devices[:count])
        self.h2d_gbps[node] = gpu.h2d_gbps
        log.info(
            "node %s: %d %s GPUs join, %.1f GiB each for services, host-to-device %.1f GB/s",
            node,
            count,
            gpu.backend,
            memory_gb,
            gpu.h2d_gbps,
        )
        self._background(self._sync_services(node))

    async def _sync_services(self, node: str) -> None:
        """Have ``node``'s worker hold exactly the pool's services (it loads each once into
        host memory); their measured sizes feed the restore estimates."""
        defs = [c.spec for c in self.config.services.values()]
        try:
            reply = await self._ask(node, op="services", services=defs)
        except EngineError as e:
            log.warning("services not synced to %s: %s", node, e.message)
            return
        if not reply.ok:
            log.warning("services not synced to %s: %s", node, reply.error)
            return
        if node in self.node_gpus:
            self._sync_resident(node, reply.resident)
            self.loads[node] = dict(reply.loaded)
            for name, load in sorted(reply.loaded.items()):
                if not load.ok:
                    log.warning("RewardService %s cannot load on %s: %s", name, node, load.error)
            self.core.set_services(self._service_specs())
            self.core.set_unloadable(node, (n for n, load in reply.loaded.items() if not load.ok))
            self._wake.set()

    def _service_specs(self) -> list[ServiceSpec]:
        return [self._service_spec(c) for c in self.config.services.values()]

    def _service_spec(self, cfg: ServiceConfig) -> ServiceSpec:
        """The core's view of a service. Its restore cost is the declared one, or the
        model's bytes over the slowest measured host-to-device bandwidth."""
        restore = cfg.restore_s
        if restore is None:
            restore = max(
                (
                    loads[cfg.spec.name].bytes / (self.h2d_gbps[node] * 1e9)
                    for node, loads in self.loads.items()
                    if cfg.spec.name in loads and node in self.h2d_gbps
                ),
                default=0.0,
            )
        return ServiceSpec(
            name=cfg.spec.name,
            gpu_memory_gb=cfg.spec.gpu_memory_gb,
            dop_choices=list(cfg.dop_choices),
            restore_s=restore,
            replicated=cfg.spec.replicated,
            # What the workers load: any change to it makes them reload the service.
            revision=hashlib.sha256(json_bytes(cfg.spec)).hexdigest()[:16],
        )

    def submit_service(self, tenant: str, service: str, req: ServiceCallRequest) -> ActionRecord:
        """Queue one call of a RewardService; ``await record.done`` for its result."""
        what = f"call of service {service}"
        again = self._repeat(tenant, req.idempotency_key, what)
        if again is not None:
            return again
        self._admitting()
        cfg = self.config.services.get(service)
        if cfg is None:
            known = ", ".join(sorted(self.config.services)) or "none"
            raise EngineError(
                "not_found", "service", f"unknown RewardService {service!r} (known: {known})"
            )
        if not self.node_gpus:
            raise EngineError("unavailable", "service", "no GPU node agent is connected")
        states = {n: loads[service] for n, loads in self.loads.items() if service in loads}
        if not any(s.ok for s in states.values()):
            why = "; ".join(f"{n}: {s.error}" for n, s in sorted(states.items()))
            raise EngineError(
                "unavailable",
                "service",
                f"{service} is loaded on no GPU node{': ' if why else ''}{why}",
            )
        return self._submit_detached(tenant, "services", req, self._call_spec(cfg, req), what)

    @staticmethod
    def _call_spec(cfg: ServiceConfig, req: ServiceCallRequest) -> ActionSpec:
        """The call as the elastic algorithm sees it: the DoPs it may get, and from the
        profiles measured for its input size a duration for each (as t1 and an
        efficiency table that reproduce them exactly)."""
        name = cfg.spec.name
        allowed = set(cfg.dop_choices)
        if req.gpu is not None:
            allowed &= set(allowed_units(req.gpu))
            if not allowed:
                raise EngineError(
                    "invalid",
                    "gpu",
                    f"no DoP in {list(allowed_units(req.gpu))} is one of {name}'s dopChoices "
                    f"{list(cfg.dop_choices)}",
                )
        durations = {k: d for k, d in cfg.durations(req.input_size).items() if k in allowed}
        kind = f"service:{name}"
        if not durations:  # unprofiled: the request's t1, else learned online
            return ActionSpec(
                kind="service",
                service=name,
                gpu=ChoicesDemand(choices=sorted(allowed)),
                t1_s=req.t1_s,
                type=kind,
            )
        if len(durations) == 1:  # one DoP: not elastic, and its duration is the estimate
            ((k, d),) = durations.items()
            return ActionSpec(
                kind="service", service=name, gpu=ChoicesDemand(choices=[k]), t1_s=d, type=kind
            )
        t1 = min(k * d for k, d in durations.items())
        table = {k: min(1.0, t1 / (k * d)) for k, d in durations.items()}
        return ActionSpec(
            kind="service",
            service=name,
            gpu=ChoicesDemand(choices=sorted(durations)),
            t1_s=t1,
            efficiency=TableEfficiency(table=table),
            type=kind,
        )

    async def _call(self, rec: ActionRecord, asg: Assignment) -> None:
        assert asg.node is not None and asg.chunk is not None
        assert isinstance(rec.request, ServiceCallRequest)
        req = rec.request
        gpus = self._devices(asg)
        service = self.core.running[rec.id].action.service
        t0 = self.clock()
        status, reply, error = ActionStatus.ERROR, None, None
        # The call's thread cannot be stopped once it runs: its chunk stays held until the
        # agent answers, even when the caller stops waiting (timeout, cancel).
        ask = asyncio.ensure_future(
            self._ask(asg.node, op="call", service=service, gpus=gpus, inputs=req.inputs)
        )
        try:
            reply = await asyncio.wait_for(asyncio.shield(ask), req.timeout_s)
            if reply.ok and reply.call is not None:
                status = ActionStatus.OK
            else:
                error = _err("service_failed", reply.error or "the agent refused the call")
        except asyncio.CancelledError:
            status = ActionStatus.CANCELLED
        except TimeoutError:
            status = ActionStatus.TIMEOUT
        except EngineError as e:
            error = _err("node_lost", e.message, retryable=True)
        now = self.clock()
        call = reply.call if reply is not None else None
        exec_s = call.exec_s if call is not None else 0.0
        restore_s = call.stats.restore_s + call.stats.evict_s if call is not None else 0.0
        if ask.done():
            self._complete_call(rec.id, ok=status is ActionStatus.OK, restore_s=restore_s)
        else:
            self._background(ask)

            def late(done: asyncio.Future[AgentReply]) -> None:
                """The call ended after its caller stopped waiting: not learned from, but
                if it ran, its instance is resident."""
                ran = not done.cancelled() and done.exception() is None and done.result().ok
                self._complete_call(rec.id, ok=False, resident=ran or None)

            ask.add_done_callback(late)
        self._finish(
            rec,
            status,
            error=error,
            exec_s=exec_s,
            restore_s=restore_s,
            overhead_s=max(0.0, (now - t0) - exec_s - restore_s),
            output=call.outputs if call is not None else None,
            service=call.stats if call is not None else None,
        )
        self._wake.set()

    def _sync_resident(self, node: str, resident: list[ResidentInstance]) -> None:
        """The core's residency view of ``node`` from its worker's report: the device
        indexes become the node's GPU positions; instances off the pool's GPUs are left out."""
        position = {d: i for i, d in enumerate(self.node_gpus[node])}
        found: list[tuple[str, int, int]] = []
        for r in resident:
            at = sorted(position.get(d, -1) for d in r.devices)
            if at and at[0] >= 0 and at == list(range(at[0], at[0] + len(at))):
                found.append((r.service, at[0], len(at)))
        self.core.sync_resident(node, found)

    def _devices(self, asg: Assignment) -> list[int]:
        """The device indexes of an assignment's GPU chunk (none for other actions)."""
        devices = self.node_gpus.get(asg.node or "", [])
        return [devices[g] for g in asg.chunk.gpus if g < len(devices)] if asg.chunk else []

    def _complete_call(
        self,
        aid: str,
        *,
        ok: bool,
        restore_s: float | None = None,
        resident: bool | None = None,
    ) -> None:
        if aid in self.core.running:
            self.core.complete(aid, self.clock(), ok=ok, restore_s=restore_s, resident=resident)
            self._wake.set()

    # ---- rounds and dispatch ---------------------------------------------------------
    async def _rounds(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = self.clock()
            try:
                rnd = self.core.schedule(now)
            except Exception:  # a bug must not stop the service: shed what triggered it
                log.exception("scheduling round failed; rejecting the newest queued action")
                self._reject_newest()
                await asyncio.sleep(0.01)
                self._wake.set()
                continue
            for asg in rnd.assignments:
                try:
                    self._start(asg, now)
                except Exception:  # one bad start must not end the loop
                    log.exception("starting %s failed", asg.action_id)
                    self._abandon(asg.action_id)
            if rnd.wake_at is not None:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = asyncio.get_running_loop().call_later(
                    max(0.0, rnd.wake_at - now), self._wake.set
                )

    def _abandon(self, aid: str) -> None:
        with contextlib.suppress(SchedulingError):
            self.core.complete(aid, self.clock(), ok=False)
        rec = self.actions.get(aid)
        if rec is not None:
            self._finish(rec, ActionStatus.ERROR, error=_err("start_failed", "could not start"))

    def _reject_newest(self) -> None:
        """A round raised: the newest queued action is the likeliest cause. Rejecting one
        per failed round isolates a poisonous request instead of stalling everyone."""
        for rec in reversed(list(self.actions.values())):
            if rec.started is None:
                self.core.cancel(rec.id)
                self._finish(
                    rec,
                    ActionStatus.REJECTED,
                    error=_err("scheduling_failed", "the scheduler could not place this action"),
                )
                return

    def _start(self, asg: Assignment, now: float) -> None:
        rec = self.actions[asg.action_id]
        rec.started, rec.assignment = now, asg
        if isinstance(rec.request, ApiCallRequest):
            if rec.expiry is not None:
                rec.expiry.cancel()
            rec.task = self._run(rec, self._proxy(rec, rec.request))
            return
        if rec.kind == "api":
            assert isinstance(rec.request, ApiLeaseRequest)
            lease = f"l-{secrets.token_hex(8)}"
            self.leases[lease] = rec.id
            rec.lease = lease
            if rec.expiry is not None:
                rec.expiry.cancel()
            rec.expiry = asyncio.get_running_loop().call_later(
                rec.request.hold_s, self._end_lease, rec
            )
            if not rec.done.done():
                rec.done.set_result(self._result(rec, ActionStatus.OK, lease=lease))
            return
        if rec.expiry is not None:
            rec.expiry.cancel()
        if rec.kind == "service":
            rec.task = self._run(rec, self._call(rec, asg))
            return
        if rec.trajectory is not None:
            self.trajectories[rec.trajectory].running.add(rec.id)
        rec.task = self._run(rec, self._dispatch(rec, asg))

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
        if not task.cancelled() and task.exception() is not None:
            log.error("action %s failed in the scheduler", rec.id, exc_info=task.exception())
        if rec.id in self.core.running:
            self.core.complete(rec.id, self.clock(), ok=False)
        if rec.trajectory in self.trajectories:
            self.trajectories[rec.trajectory].running.discard(rec.id)
        if task.cancelled():
            self._finish(rec, ActionStatus.CANCELLED)
        else:
            self._finish(rec, ActionStatus.ERROR, error=_err("internal", "the scheduler failed"))
        self._wake.set()

    async def _dispatch(self, rec: ActionRecord, asg: Assignment) -> None:
        assert asg.node is not None and isinstance(rec.request, ExecRequest)
        req = rec.request
        cores = [self.node_cores[asg.node][i] for i in asg.cores]
        env = self.env_of(self.trajectories[rec.trajectory or ""])
        timeout = req.timeout_s
        if timeout is None and req.profile is not None:
            timeout = env.profiles[req.profile].timeout_s
        msg = dict(
            op="session" if req.session else "exec",
            trajectory=rec.trajectory,
            argv=rec.argv,
            session=req.session,
            code=req.code,
            cores=cores,
            timeout_s=timeout,
            environ=dict(req.env),
            output_cap=req.output_cap,
            key=f"{rec.tenant}{KEY_SEP}{req.idempotency_key}" if req.idempotency_key else None,
        )
        t0 = self.clock()
        status, reply, error = ActionStatus.ERROR, None, None
        try:
            reply = await self._ask(asg.node, **msg)
            if reply.ok and reply.result is not None:
                status = ActionStatus.TIMEOUT if reply.result.timed_out else ActionStatus.OK
            elif reply.unknown:
                error = _err("outcome_unknown", reply.error or "its outcome is unknown")
            else:
                error = _err(
                    "exec_failed", reply.error or "the agent refused the action", reply.retryable
                )
                if reply.reason:  # the node's fault (its cgroups), not the command's
                    self.problems.note(reply.reason, f"node {asg.node}", reply.error or "", t0)
        except asyncio.CancelledError:
            status = ActionStatus.CANCELLED
        except EngineError as e:
            error = _err("node_lost", e.message, retryable=True)
        now = self.clock()
        if rec.id in self.core.running:
            self.core.complete(rec.id, now, ok=status is ActionStatus.OK)
        if rec.trajectory in self.trajectories:
            self.trajectories[rec.trajectory].running.discard(rec.id)
        out = reply.result if reply is not None else None
        exec_s = out.exec_s if out is not None else 0.0
        overhead = max(0.0, (now - t0) - exec_s)
        self._finish(rec, status, error=error, exec_s=exec_s, overhead_s=overhead, reply=reply)
        self._wake.set()

    async def _proxy(self, rec: ActionRecord, req: ApiCallRequest) -> None:
        """Make the call with the quota's credential; the answer goes back, the credential
        never does (nor into logs or errors)."""
        assert rec.assignment is not None
        api = rec.assignment.quotas[0][0] if rec.assignment.quotas else ""
        endpoint = self.config.endpoints.get(api)
        t0 = self.clock()
        status, output, error = ActionStatus.ERROR, None, None
        try:
            if endpoint is None:
                raise EngineError("invalid", "api", f"quota {api!r} lost its endpoint")
            # The credential's header is the service's alone, whatever its capitalisation.
            headers = {k: v for k, v in req.headers.items() if k.lower() != endpoint.header.lower()}
            if endpoint.credential is not None:
                headers[endpoint.header] = f"Bearer {endpoint.credential}"
            session = await self._http_session()
            async with session.request(
                req.method,
                endpoint.url.rstrip("/") + req.path,
                params=req.query,
                json=req.body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=req.timeout_s),
                allow_redirects=False,  # a redirect would carry the credential elsewhere
            ) as resp:
                raw = await resp.read()
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                output = {"status": resp.status, "body": body}
                status = ActionStatus.OK
        except asyncio.CancelledError:
            status = ActionStatus.CANCELLED
        except TimeoutError:
            status = ActionStatus.TIMEOUT
        except (aiohttp.ClientError, EngineError) as e:
            error = _err("api_failed", _scrub(str(e), endpoint), retryable=True)
        except Exception as e:  # anything else must still end the call and free its unit
            error = _err("api_failed", _scrub(f"{type(e).__name__}: {e}", endpoint))
        now = self.clock()
        if rec.id in self.core.running:
            self.core.complete(rec.id, now, ok=status is ActionStatus.OK)
        self._finish(rec, status, error=error, exec_s=now - t0, output=output)
        self._wake.set()

    async def _http_session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def _ask(self, node: str | None, **fields: Any) -> AgentReply:
        link = self.hub.links.get(node or "")
        if link is None:
            raise EngineError("unavailable", "node", f"node {node} has no agent connected")
        try:
            return await link.request(AgentRequest(rid=link.next_rid(), **fields))
        except (AgentGoneError, RuntimeError, OSError) as e:  # incl. a socket closing under us
            raise EngineError("unavailable", "node", f"node {node}: {e}") from None

    # ---- results -----------------------------------------------------------------------
    def _finish(self, rec: ActionRecord, status: ActionStatus, **details: Any) -> None:
        """End an action: its result (``details`` as for ``_result``) goes to its waiter."""
        if rec.expiry is not None:
            rec.expiry.cancel()
        self.actions.pop(rec.id, None)
        if not rec.done.done():
            result = self._result(rec, status, **details)
            rec.done.set_result(result)
            self._ended(rec, result)

    def _result(
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
        now = self.clock()
        queued = (rec.started if rec.started is not None else now) - rec.submitted
        asg = rec.assignment
        out = reply.result if reply is not None else None
        # Validated construction on purpose: model_construct inspects default factories'
        # signatures on every call and costs more (py-spy, docs/benchmarks.md).
        alloc = Allocation()
        if asg is not None:
            node_cores = self.node_cores.get(asg.node or "", [])
            alloc = Allocation(
                node=asg.node,
                cores=[node_cores[i] for i in asg.cores if i < len(node_cores)],
                gpus=self._devices(asg),
                dop=asg.units if asg.cores or asg.chunk else 0,
                path=out.path if out is not None else None,
                fallback=(out.fallback or None) if out is not None else None,
            )
        return ActionResult(
            id=rec.id,
            trajectory=rec.trajectory,
            kind=rec.kind,
            status=status,
            exit_code=out.exit_code if out is not None else None,
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
        )


def _err(code: str, message: str, retryable: bool = False) -> ErrorInfo:
    return ErrorInfo(code=code, message=message, retryable=retryable)


def _scrub(text: str, endpoint: ApiEndpoint | None) -> str:
    """An error message without the credential, whatever the library put in it."""
    if endpoint is not None and endpoint.credential:
        text = text.replace(endpoint.credential, "***")
    return text


def check_id(text: str, field: str) -> None:
    if not valid_id(text):
        raise EngineError("invalid", field, f"{text!r} must be letters, digits, _ . - (≤ 128)")
