"""Trajectories from opening to closing: a node with the memory, the environment its agent
opens there, and what ends with it (its queued actions, its units in the core)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict

from tangram.api.reasons import Reason
from tangram.api.wire import (
    MAX_KEY_CHARS,
    OPEN_KEYS_FEATURE,
    ActionStatus,
    AgentClose,
    AgentOpen,
    ErrorInfo,
    OpenTrajectory,
    TrajectoryInfo,
    TrajectoryMeta,
    TrajectoryState,
)
from tangram.scheduler.core.scheduler import SchedulingError
from tangram.service.outcomes import Outcomes
from tangram.service.records import EngineError, ErrorKind, TrajectoryRecord, err
from tangram.service.state import PoolState

log = logging.getLogger("tangram.service")

# Opens remembered by idempotency key: a retry comes within seconds of its first try.
MAX_OPEN_KEYS = 4096
IDLE_CHECK_S = 5.0  # how often idle trajectories are looked for (idleTimeoutSeconds)
_IDLING = (TrajectoryState.OPEN, TrajectoryState.LOST)  # closed by idleTimeoutSeconds


class Trajectories:
    def __init__(self, state: PoolState, outcomes: Outcomes) -> None:
        self.s = state
        self.outcomes = outcomes
        # node -> keys of environments its agent may still hold that nothing here answers
        # for: closed while their agent was away or with the close cut off, opens whose
        # answer was lost, stale ones it handed back. Handed back, they are closed, not
        # revived; each is kept until an AgentClose of it answers ok, or a hello of its
        # agent does not list it (gone).
        self.to_close: dict[str, set[str]] = {}
        # (tenant, idempotency key) -> the open it started (its request's digest, and its
        # record once opened), newest last: a retry whose first answer was lost gets that
        # one. Agents keep the key with the trajectory, for a scheduler restarted meanwhile.
        self._opens: OrderedDict[tuple[str, str], tuple[str, asyncio.Future[TrajectoryRecord]]] = (
            OrderedDict()
        )
        # (tenant, idempotency key) of opens given up by key before any open of it came
        # (``close_by_key``), newest last; apart, so that they evict no open's key.
        self._given_up: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def open(self, tenant: str, req: OpenTrajectory) -> TrajectoryRecord:
        key = req.idempotency_key
        if key is None:
            return await self._open(tenant, req)
        tenant_key = (tenant, key)
        if tenant_key in self._given_up:
            raise EngineError(
                "conflict",
                "idempotency_key",
                f"{key} was given up by its client (closed by key) before this open came: "
                "open under a new key",
            )
        known = self._opens.get(tenant_key)
        if known is not None:
            return await self._again(tenant, req, *known)
        digest = req.digest()
        opening: asyncio.Future[TrajectoryRecord] = asyncio.get_running_loop().create_future()
        self._remember(tenant_key, digest, opening)
        try:
            rec = await self._open(tenant, req, (key, digest))
        except BaseException as e:
            # Refused or failed: nothing was opened, so a retry tries again.
            if self._opens.get(tenant_key, (None, None))[1] is opening:
                del self._opens[tenant_key]
            if isinstance(e, Exception):
                opening.set_exception(e)
                opening.exception()  # (retrieved: no retry may be waiting)
            else:  # cancelled
                opening.cancel()
            raise
        opening.set_result(rec)
        return rec

    def _remember(
        self, tenant_key: tuple[str, str], digest: str, opening: asyncio.Future[TrajectoryRecord]
    ) -> None:
        self._opens[tenant_key] = (digest, opening)
        while len(self._opens) > MAX_OPEN_KEYS:
            self._opens.popitem(last=False)

    async def close_by_key(self, tenant: str, key: str) -> TrajectoryInfo:
        """Close the trajectory that the open of idempotency key ``key`` made, or is making
        (its client gave up on that open: cancelled, timed out). One still opening is
        closed as soon as its agent has made it, in the background: answered ``closing``
        at once. A key no open is known by is kept as given up (404): an open of it that
        comes later is refused, and a trajectory an agent hands back under it, after a
        restart, is closed."""
        tenant_key = (tenant, key)
        known = self._opens.get(tenant_key)
        rec = None
        if known is not None:
            opening = known[1]
            if not opening.done():  # its record is made before the first await of _open
                rec = next(
                    (t for t in self.s.trajectories.values()
                     if t.tenant == tenant and t.open_key and t.open_key[0] == key),
                    None,
                )  # fmt: skip
            elif not opening.cancelled() and opening.exception() is None:
                rec = opening.result()
        if rec is None:
            if known is None and len(key) <= MAX_KEY_CHARS:  # (a longer one opens nothing)
                self._given_up[tenant_key] = None
                while len(self._given_up) > MAX_OPEN_KEYS:
                    self._given_up.popitem(last=False)
            raise EngineError(
                "not_found",
                "idempotency_key",
                f"no trajectory is open under idempotency key {key}: an open of it that "
                "comes later is refused",
            )
        if rec.state.closed or self.s.named.get((tenant, rec.id)) is not rec:
            return rec.info()  # closed already (its id may name a newer one now)
        if rec.opening is not None:  # its agent is still making it: closed once made
            self.s.background(self.close(tenant, rec.id))
            return rec.info().model_copy(update={"state": TrajectoryState.CLOSING})
        return (await self.close(tenant, rec.id)).info()

    def opened_again(self, meta: TrajectoryMeta) -> bool:
        """Whether a retry of the open that made ``meta``'s trajectory has opened another
        since (its agent came back after the retry): the client has that one, and never
        learnt of this one; or its client gave the open up (``close_by_key``)."""
        if meta.open_key is None:
            return False
        return (meta.tenant, meta.open_key) in self._opens or (
            (meta.tenant, meta.open_key) in self._given_up
        )

    def taken_back(self, rec: TrajectoryRecord) -> None:
        """A trajectory an agent handed back after a restart: its open's retry gets it."""
        if rec.open_key is None:
            return
        opened: asyncio.Future[TrajectoryRecord] = asyncio.get_running_loop().create_future()
        opened.set_result(rec)
        self._remember((rec.tenant, rec.open_key[0]), rec.open_key[1], opened)

    async def _again(
        self,
        tenant: str,
        req: OpenTrajectory,
        digest: str,
        opening: asyncio.Future[TrajectoryRecord],
    ) -> TrajectoryRecord:
        """A retry of an open: what the first try opened, once it has."""
        if req.digest() != digest:
            first = f" (trajectory {opening.result().id})" if opening.done() else ""
            raise EngineError(
                "conflict",
                "idempotency_key",
                f"{req.idempotency_key} was used for another open{first}: a retry repeats "
                "its request",
            )
        rec = await asyncio.shield(opening)
        if self.s.named.get((tenant, rec.id)) is not rec:
            raise EngineError(
                "conflict",
                "idempotency_key",
                f"{req.idempotency_key} opened trajectory {rec.id}, which has since ended",
            )
        return rec

    async def _open(
        self, tenant: str, req: OpenTrajectory, open_key: tuple[str, str] | None = None
    ) -> TrajectoryRecord:
        """Open it; ``open_key``: its idempotency key and its request's digest."""
        s = self.s
        s.admitting(tenant)
        if s.draining:
            raise EngineError(
                "unavailable", "service", "the pool is being deleted: no new trajectories"
            )
        env = s.config.envs.get(req.env)
        if env is None:
            known = ", ".join(sorted(s.config.envs)) or "none"
            raise EngineError(
                "not_found", "env", f"unknown TrajectoryEnv {req.env!r} (known: {known})"
            )
        limit = s.config.limits(tenant).max_trajectories
        if limit is not None and self._held(tenant) >= limit:
            raise s.overloaded(
                "trajectory",
                f"tenant {tenant} has {limit} trajectories open, its limit "
                "(spec.access.tenants[].maxTrajectories); close one first",
            )
        tid = req.id or f"t-{secrets.token_hex(6)}"
        if (tenant, tid) in s.named:
            raise EngineError("conflict", "id", f"trajectory {tid} already exists")
        key = self.free_key(tid)
        try:
            s.core.open_trajectory(key, env.spec.memory_gb, req.expected_steps, tenant=tenant)
        except SchedulingError as e:
            if e.field == "memory_gb":
                raise self._never_fits(req.env, env.spec.memory_gb) from None
            raise EngineError("invalid", e.field, e.message) from None
        node = s.core.cpu.choose_node(env.spec.memory_gb, 0, {})  # (none that is leaving)
        if node is None:
            s.core.close_trajectory(key, finished=False)
            why = f"no node has {env.spec.memory_gb} GiB free for a new trajectory"
            if any(not link.leaving for link in s.hub.links.values()):
                raise s.overloaded("env", why)
            if s.hub.links:  # each of their nodes takes no new work until its agent is back
                why = "no node takes new trajectories: the agents connected are stopping"
            else:  # (not memory: there is no node to have any)
                why = "no node agent is connected: no node to open a trajectory on"
                if s.reconnecting():
                    why += " (this scheduler has just started: they may be reconnecting)"
            raise EngineError("unavailable", "env", why)
        s.core.place_trajectory(key, node)
        rec = TrajectoryRecord(tid, tenant, req.env, node, dict(req.labels), s.wall(), env, key=key)
        rec.open_key, rec.env_vars = open_key, dict(req.env_vars)
        made = rec.opening = asyncio.get_running_loop().create_future()
        s.add_trajectory(rec)
        link = s.hub.links.get(node)  # (none: the ask below fails as it should)
        keeps_key = link is not None and OPEN_KEYS_FEATURE in link.hello.features
        try:
            reply = await s.ask(
                node, AgentOpen(trajectory=key, env=env.spec, meta=rec.meta(keeps_key))
            )
        except BaseException:
            made.set_result(False)
            self.close_later(node, key)  # the agent may have made it: closed on its return
            if not rec.state.closed:  # (its agent gone meanwhile: AWAY) a close forgets
                self.forget(rec)  # it itself
            raise
        made.set_result(reply.ok)
        rec.opening = None
        if rec.state.closed:  # closed meanwhile: the close ends it
            raise EngineError("conflict", "trajectory", f"{tid} was closed while it opened")
        if not reply.ok:
            self.forget(rec)
            why = f" ({reply.reason})" if reply.reason else ""
            if reply.reason:
                s.problems.note(reply.reason, f"TrajectoryEnv {req.env}",
                                f"node {node}: {reply.error}", s.clock())  # fmt: skip
            # A cause that retrying cannot fix (no image) is "failed"; anything else
            # (a timeout, an eviction, no cause given) may work on the next try.
            kind: ErrorKind = "failed" if reply.reason and not reply.retryable else "unavailable"
            raise EngineError(kind, "env", f"opening on {node} failed{why}: {reply.error}")
        rec.open_s, rec.warm = reply.opened_s, reply.warm
        s.metrics.opened.labels(s.config.name).inc()
        log.info(
            "trajectory opened",
            extra={
                "trajectory": key,
                "tenant": tenant,
                "env": req.env,
                "node": node,
                "open_s": reply.opened_s,
                "warm": reply.warm,
            },
        )
        return rec

    def _never_fits(self, env: str, memory_gb: float) -> EngineError:
        """The open of a TrajectoryEnv whose memory no node connected has for sandboxes,
        free or not (the core refuses it): the error names the field and the largest
        node, and is noted against the TrajectoryEnv, whose status shows it."""
        s = self.s
        largest = max(s.core.cpu.nodes.values(), key=lambda n: (n.memory_gb, n.name))
        why = (
            f"TrajectoryEnv {env} asks spec.memoryGiB {memory_gb:g} and no node of the pool "
            f"has that much for sandboxes (the most: {largest.memory_gb:g} GiB, node "
            f"{largest.name}): lower it, or add a node with more memory"
        )
        s.problems.note(Reason.MEMORY_DOES_NOT_FIT, f"TrajectoryEnv {env}", why, s.clock())
        return EngineError("invalid", "env", f"{why} ({Reason.MEMORY_DOES_NOT_FIT})")

    def free_key(self, tid: str) -> str:
        """A pool-wide key for a new trajectory its tenant calls ``tid``: ``tid`` itself
        unless another tenant's trajectory has it, or an environment of that key, closed
        while its agent was away, is still to be removed on the agent's return."""
        s, key = self.s, tid
        while (
            key in s.trajectories
            or key in s.core.trajectories
            or any(key in keys for keys in self.to_close.values())
        ):
            key = f"{tid[:119]}.{secrets.token_hex(4)}"  # still an id: ≤ 128, [A-Za-z0-9_.-]
        return key

    def cancel_actions(self, tenant: str, tid: str) -> int:
        """Cancel every queued and running action of a trajectory, which stays open."""
        key = self.s.trajectory(tenant, tid).key  # 404 for a stranger's
        mine = [a for a, r in self.s.actions.items() if r.trajectory == key]
        return sum(self.outcomes.cancel(tenant, aid) for aid in mine)

    async def close(self, tenant: str, tid: str) -> TrajectoryRecord:
        s = self.s
        try:
            rec = s.trajectory(tenant, tid)
        except EngineError as e:
            recent = s.closed.get((tenant, tid))
            if e.kind != "not_found" or recent is None:
                raise
            return recent  # a retry of a close whose answer was lost
        if rec.state.closed:
            if rec.closing is not None:
                await asyncio.shield(rec.closing)
            return rec
        rec.closing = closed = asyncio.get_running_loop().create_future()
        try:
            return await self._close(rec)
        finally:
            closed.set_result(None)

    async def _close(self, rec: TrajectoryRecord) -> TrajectoryRecord:
        s, tenant = self.s, rec.tenant
        had_environment = rec.state is TrajectoryState.OPEN
        rec.state = TrajectoryState.CLOSING  # before any await: no new action gets in now
        for aid in [a for a, r in s.actions.items() if r.trajectory == rec.key]:
            self.outcomes.cancel(tenant, aid)
        running = [s.actions[a].task for a in rec.running if a in s.actions]
        await asyncio.gather(*(t for t in running if t is not None), return_exceptions=True)
        if rec.opening is not None:  # its agent is still making it: close what it makes
            had_environment = await asyncio.shield(rec.opening)
        if had_environment and rec.node in s.hub.links:
            if not await self.close_on(rec.node, rec.key):
                self.close_later(rec.node, rec.key)  # cut off or refused: told again on return
        elif rec.node is not None and rec.node not in s.hub.links:
            # Its agent is away: when it comes back it is told to close it, not asked
            # to hand it back.
            self.close_later(rec.node, rec.key)
        self.forget(rec)
        rec.state = TrajectoryState.CLOSED
        s.metrics.closed.labels(s.config.name).inc()
        s.was_closed(rec)
        log.info("trajectory closed", extra={"trajectory": rec.key, "actions": rec.actions})
        return rec

    def idle(self, now: float) -> list[TrajectoryRecord]:
        """Open and lost trajectories whose env's ``idleTimeoutSeconds`` passed since they
        were last in use (a lost one: since it was lost, or asked for), with nothing queued
        or running, and no timeout of their own (``timed``). A lost one holds nothing, but
        its record and its id would stay for good: its client reads it as lost until then,
        and learns it was closed after."""
        s = self.s
        if not any(e.idle_timeout_s for e in s.config.envs.values()):
            return []
        busy = {a.trajectory for a in s.actions.values()}
        return [
            t
            for t in s.trajectories.values()
            if t.state in _IDLING
            and t.opening is None
            and t.key not in busy
            and not t.transfers
            and not t.timed
            and (limit := s.env_of(t).idle_timeout_s) is not None
            and now - t.active_at >= limit
        ]

    async def close_idle_forever(self, every_s: float = IDLE_CHECK_S) -> None:
        """Close idle trajectories (``idle``): a rollout worker that died never closes
        its own, and its environment would hold the node's memory for good."""
        while True:
            await asyncio.sleep(every_s)
            self.close_idle(self.s.clock())

    def close_idle(self, now: float) -> None:
        """Close (in the background) the trajectories idle at ``now``, saying why."""
        for rec in self.idle(now):
            limit = self.s.env_of(rec).idle_timeout_s
            setting = f"TrajectoryEnv {rec.env} idleTimeoutSeconds"
            if rec.state is TrajectoryState.LOST:
                rec.ended = f"lost ({rec.ended}), then closed after {limit:g} s ({setting})"
            else:
                rec.ended = f"idle for {limit:g} s ({setting})"
            log.info("trajectory %s closed: %s", rec.key, rec.ended)
            self.s.background(self.close(rec.tenant, rec.id))

    def _held(self, tenant: str) -> int:
        """The tenant's trajectories that count against its maxTrajectories: a lost one
        holds no environment, and answers only to be closed."""
        return sum(
            t.tenant == tenant and t.state is not TrajectoryState.LOST
            for t in self.s.trajectories.values()
        )

    def close_later(self, node: str, key: str) -> None:
        """``key``'s environment on ``node`` goes when its agent can be told (its hello)."""
        self.to_close.setdefault(node, set()).add(key)

    async def close_on(self, node: str, key: str) -> bool:
        """Ask ``node``'s agent to close ``key``'s environment; whether it said it did (it
        is then no longer one to close)."""
        try:
            reply = await self.s.ask(node, AgentClose(trajectory=key))
        except EngineError:
            return False  # its link went
        if not reply.ok:
            log.warning("node %s did not close trajectory %s: %s", node, key, reply.error)
            return False
        keys = self.to_close.get(node, set())
        keys.discard(key)
        if not keys:
            self.to_close.pop(node, None)
        return True

    def forget(self, rec: TrajectoryRecord) -> None:
        """Drop a trajectory from the engine and the core."""
        self.release(rec, ActionStatus.CANCELLED, finished=rec.actions > 0)
        self.s.drop_trajectory(rec)

    def release(
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
        core = self.s.core
        for aid in [a for a, r in core.running.items() if r.action.trajectory == rec.key]:
            with contextlib.suppress(SchedulingError):
                core.complete(aid, self.s.clock(), ok=False)
        if rec.key in core.trajectories:
            for aid in core.close_trajectory(rec.key, finished=finished):
                stale = self.s.actions.get(aid)
                if stale is not None:
                    self.outcomes.finish(stale, status, error=error)

    def lose(self, rec: TrajectoryRecord, why: str) -> None:
        """The trajectory's environment is gone (or is closed on sight): every action
        answers 409 with ``why`` from now on."""
        rec.state, rec.ended = TrajectoryState.LOST, why
        rec.active_at = self.s.clock()  # its client has the idle timeout to read it as lost
        log.warning("trajectory %s lost: %s", rec.key, why)

    def environment_lost(self, tid: str, reason: str, message: str) -> None:
        """A trajectory's environment ended by itself (evicted, killed, deleted): the
        trajectory is lost; its queued actions end with why, its running ones when their
        agent answers (their cores come back now: nothing runs in a sandbox that ended)."""
        rec = self.s.trajectories.get(tid)
        if rec is None or rec.state not in (TrajectoryState.OPEN, TrajectoryState.AWAY):
            return
        self.s.problems.note(reason, f"TrajectoryEnv {rec.env}", message, self.s.clock())
        self.lose(rec, f"{message} ({reason})")
        error = err("environment_lost", f"trajectory {rec.id} is lost: {rec.ended}")
        self.release(rec, ActionStatus.ERROR, error, finished=False)
        self.s.wake.set()
