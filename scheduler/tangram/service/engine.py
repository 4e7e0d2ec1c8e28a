"""The service's engine: the core scheduler driven by events, in parts.

Requests become core actions (``admission``); a round runs whenever something arrived,
finished, or a rate window is due (``rounds``); each assignment goes where it runs — a
node's agent for exec actions, its GPU worker for RewardService calls (``gpu_calls``), the
quota's endpoint or the caller for API calls and leases (``api_calls``) — and its result
resolves the future the HTTP handler awaits (``outcomes``). Agents joining and leaving
(``membership``) bring nodes and trajectories in and take them out (``trajectories``).

The engine builds the parts around one shared state (``state``) and is what the HTTP
handlers, the action stream and the embedded mode hold: its lifecycle, the pool's figures,
reconfiguration, and each operation, passed to the part it belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tangram.api.cluster import ClusterSpec
from tangram.api.learned import MAX_CLOSING, MAX_PROGRESS, LearnedProgress, LearnedState
from tangram.api.wire import (
    ActionResult,
    ActionStatus,
    ApiCallRequest,
    ApiLeaseRequest,
    BatchItem,
    ExecRequest,
    OpenTrajectory,
    PoolFigures,
    ServiceCallRequest,
    TrajectoryInfo,
    TrajectoryState,
)
from tangram.scheduler.core.scheduler import Scheduler, SchedulerConfig
from tangram.service.admission import Admission
from tangram.service.agents import AgentHub
from tangram.service.api_calls import ApiCalls
from tangram.service.changes import named_changes
from tangram.service.config import PoolConfig
from tangram.service.files import Files
from tangram.service.gpu_calls import GpuCalls
from tangram.service.learned_file import SAVE_EVERY_S, LearnedStore, read_state, write_state
from tangram.service.live import LiveExec
from tangram.service.membership import Membership
from tangram.service.metrics import LiveFigures, Metrics, Units
from tangram.service.outcomes import Outcomes
from tangram.service.records import ActionRecord, TrajectoryRecord
from tangram.service.rounds import Rounds
from tangram.service.state import PoolState
from tangram.service.trajectories import Trajectories

log = logging.getLogger("tangram.service")

__all__ = ["Engine"]


# The states of a trajectory that holds an environment, or may (its agent away).
_HOLDING = (TrajectoryState.OPEN, TrajectoryState.AWAY, TrajectoryState.CLOSING)
# The states tangram_trajectories shows: every one but closed.
_SHOWN = frozenset(TrajectoryState) - {TrajectoryState.CLOSED}


class Engine:
    def __init__(
        self,
        config: PoolConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        hub: AgentHub | None = None,
    ) -> None:
        """``hub``: where agents connect (one is made from the config without it)."""
        core = Scheduler(ClusterSpec(apis=list(config.apis)), config.scheduling)
        core.set_tenants(*config.shares())
        self.hub = hub or AgentHub(config.heartbeat_timeout_s)
        self.metrics = Metrics(config.name, self.live)
        self.state = s = PoolState(config, core, self.hub, self.metrics, clock=clock)
        self.outcomes = Outcomes(s)
        self.gpu = GpuCalls(s, self.outcomes)
        self.api = ApiCalls(s, self.outcomes)
        self.lifecycle = Trajectories(s, self.outcomes)
        self.admission = Admission(s, self.outcomes, self.gpu, self.api)
        self.membership = Membership(s, self.outcomes, self.lifecycle, self.gpu)
        self.files = Files(s)  # no queue, no round: straight to the trajectory's agent
        self.rounds = Rounds(s, self.outcomes, self.gpu, self.api)
        self.hub.attach(self.membership.join, self.membership.leave, self.membership.orphan,
                        self.membership.second_agent, self.membership.stopping)  # fmt: skip
        # The pool's definitions anew (set by the CLI): from pushed documents, or with None
        # from the files; POST /v1/admin/reload calls it (in a thread: it may do I/O).
        self.reloader: Callable[[str | None], PoolConfig] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._learned: tuple[LearnedStore, float] | None = None  # where, how often saved
        self._save_error: str | None = None  # the last save's, until one succeeds
        self._saved: LearnedState | None = None  # what the file holds (loaded or saved)
        self.resumed: LearnedState | None = None  # what an earlier scheduler had learned
        self._unread: str | None = None  # why the store could not be read, until it can
        self._quotas_due: LearnedState | None = None  # its leases and windows, for ``start``
        core.set_services(self.gpu.service_specs())

    # ---- the shared state, as the handlers read it -------------------------------------
    @property
    def config(self) -> PoolConfig:
        return self.state.config

    @property
    def core(self) -> Scheduler:
        return self.state.core

    @property
    def trajectories(self) -> dict[str, TrajectoryRecord]:
        return self.state.trajectories

    # ---- lifecycle ---------------------------------------------------------------------
    def keep_learned(self, store: LearnedStore, every_s: float = SAVE_EVERY_S) -> bool:
        """Resume from what an earlier scheduler learned and saved in ``store``, and save
        there every ``every_s`` from ``start`` on, and at ``stop``. True if it resumed."""
        self._learned = (store, every_s)
        try:
            self._resume(read_state(store))
        except OSError as e:
            self._unread = str(e)
            log.error(
                "cannot read the learned state %s: %s; starting without it, and saving "
                "nothing over it until it can be read",
                store.where,
                e,
            )
        return self.resumed is not None

    def _resume(self, state: LearnedState | None) -> None:
        self._unread, self.resumed, self._saved = None, state, state
        if state is not None:
            self.core.resume(state)
            for node, keys in state.closing.items():  # (before any agent's hello)
                for key in keys:
                    self.lifecycle.close_later(node, key)
            self._quotas_due = state
            self.state.progress_due = dict(state.progress)  # (for the agents' hellos)
            if self._tasks:  # (read late: the store could not be read at the start)
                self._resume_quotas()

    def _resume_quotas(self) -> None:
        """The leases held and the rate windows the resumed state holds, taken back once
        the event loop runs (a lease's hold is a timer on it)."""
        state, self._quotas_due = self._quotas_due, None
        if state is not None and (state.leases or state.windows):
            taken = self.api.resume(state.leases, state.windows)
            windows = ", ".join(sorted(state.windows)) or "none"
            log.info("API quotas resumed: %d of %d leases still held; the rate windows of %s",
                     taken, len(state.leases), windows)  # fmt: skip

    def learned_note(self) -> str:
        """What a start says of the learned state: where it is kept, and what it resumed."""
        if self._learned is None:
            return "learned state: not kept"
        where, state = self._learned[0].where, self.resumed
        if self._unread is not None:
            return f"learned state: {where} (cannot be read: {self._unread})"
        if state is None:
            return f"learned state: {where} (nothing to resume)"
        return (
            f"learned state: {where}, resumed (action types: {len(state.profiles)}, "
            f"trajectory lengths: {len(state.lengths)})"
        )

    async def save_learned(self) -> None:
        """Save what the core learned (a failure is logged: the next save tries again)."""
        if self._learned is None:
            return
        store = self._learned[0]
        try:
            if self._unread is not None:  # what it holds comes first: try again to read it
                self._resume(await asyncio.to_thread(read_state, store))
                log.warning("the learned state %s can be read now: %s", store.where,
                            "resumed it" if self.resumed else "nothing to resume")  # fmt: skip
            state = self._kept()
            if state == self._saved:  # an idle scheduler writes nothing
                return
            await asyncio.to_thread(write_state, store, state)
        except OSError as e:
            if str(e) != self._save_error:  # said once, not every SAVE_EVERY_S
                log.error("cannot save the learned state to %s: %s", store.where, e)
            self._save_error = str(e)
        else:
            self._saved, self._save_error = state, None

    def _kept(self) -> LearnedState:
        """What the next scheduler resumes: what the core learned, the environments still
        to close (their trajectories closed while their agents were away), the API leases
        held and the starts the quotas' rate windows count."""
        closing, room = {}, MAX_CLOSING
        for node, keys in sorted(self.lifecycle.to_close.items()):
            kept = sorted(keys)[:room]
            if kept:
                closing[node], room = kept, room - len(kept)
        leases, windows = self.api.kept()
        learned = self.core.learned()  # here: the core is the loop's alone
        # Those furthest along, whose lengths a restart would lose the most of; not one
        # whose steps before an earlier restart are unknown (its count would pass as whole).
        known = [
            (t.steps_done, rec)
            for rec in self.state.trajectories.values()
            if (t := self.core.trajectories.get(rec.key)) is not None and t.length_known
        ]
        known.sort(key=lambda k: (-k[0], k[1].key))
        progress: dict[str, LearnedProgress] = {}
        for _, rec in known[:MAX_PROGRESS]:
            done = self.core.progress(rec.key)
            progress[rec.key] = done.model_copy(update={"actions": rec.actions})
        extra = {"closing": closing, "leases": leases, "windows": windows, "progress": progress}
        update = {name: value for name, value in extra.items() if value}
        return learned.model_copy(update=update) if update else learned

    async def _save_learned_every(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self.save_learned()

    async def start(self) -> None:
        self._resume_quotas()  # (before anything is admitted: held units stay held)
        self._tasks = [
            asyncio.create_task(self.rounds.run(), name="rounds"),
            asyncio.create_task(self.hub.watch(), name="heartbeats"),
            asyncio.create_task(self.lifecycle.close_idle_forever(), name="idle trajectories"),
        ]
        if self._learned is not None:
            saving = self._save_learned_every(self._learned[1])
            self._tasks.append(asyncio.create_task(saving, name="learned"))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop admitting; give running actions ``grace_s`` to finish, cancel the rest."""
        await self.wind_down(grace_s)
        # Then the loops, and what they left running in the background (an agent's grace,
        # a cancel to tell it): none of it outlives the engine.
        spawned = self.state.spawned()
        for t in (*self._tasks, *spawned):
            t.cancel()
        await asyncio.gather(*self._tasks, *spawned, return_exceptions=True)
        await self.save_learned()  # with what the last runs taught
        if self._learned is not None:
            self._learned[0].close()
        await self.api.close()

    async def wind_down(self, grace_s: float, hurry: asyncio.Event | None = None) -> None:
        """Stop admitting; end queued actions (retryable); give running ones ``grace_s``
        to finish (less if ``hurry`` is set meanwhile), and cancel those still running."""
        s = self.state
        s.accepting = False
        for rec in list(s.actions.values()):
            if rec.started is None:
                s.core.cancel(rec.id)
                self.outcomes.finish(rec, ActionStatus.CANCELLED, error=s.stopped(ran=False))
        running = [r.task for r in s.actions.values() if r.task is not None]
        if not running:
            return
        # (cancelling a wait leaves what it waits for running)
        waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(asyncio.wait(running))}
        if hurry is not None:
            waits.add(asyncio.ensure_future(hurry.wait()))
        await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        s.hurried = hurry is not None and hurry.is_set()  # (what the killed ones are told)
        for w in waits:
            w.cancel()
        late = [t for t in running if not t.done()]
        for t in late:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*waits, *late, return_exceptions=True)

    async def end_drain(self) -> None:
        """Its pool was deleted and the drain's time ran out, with trajectories still open:
        end every action now, saying so (``pool_deleted``), before the pool's objects go
        (agents and sandboxes going first would fail them with what a missing sandbox
        says). The scheduler admits nothing more."""
        if self.state.ended is None:
            self.state.ended = "the ActionPool was deleted and its drainSeconds ran out"
            log.warning("drain ended: %s", self.state.ended)
        await self.wind_down(0.0)

    def running(self) -> int:
        """How many actions run now (started, not ended)."""
        return sum(1 for r in self.state.actions.values() if r.task is not None)

    @property
    def ready(self) -> bool:
        """Admitting, and able to run something: an agent is connected that did not say
        it stops, or the pool has no environments and no RewardServices (API quotas only:
        nothing needs a node). A stopping agent's node takes no new work
        (``Membership.stopping``): with only such agents, a new trajectory is refused
        (503) and a new call waits, as with none. Readiness only (``/readyz``): the
        liveness probe (``/healthz``) stays ok, and the scheduler's Service publishes a
        pod that is not ready, so that agents, the next ones too, still reach it."""
        needs_node = bool(self.config.envs or self.config.services)
        if not self.state.accepting:
            return False
        return not needs_node or any(not link.leaving for link in self.hub.links.values())

    def all_agents_joined(self) -> None:
        """Whoever knows every agent is back (the embedded mode, with its one) ends the
        window in which an unknown trajectory may still be an agent's."""
        self.state.reconnect_until = 0.0

    # ---- figures -----------------------------------------------------------------------
    def figures(self) -> PoolFigures:
        """What the operator copies into the ActionPool's status."""
        s, core = self.state, self.state.core
        nodes = core.cpu.nodes.values()
        gpus = core.gpu.nodes.values()
        return PoolFigures(
            pool=s.config.name,
            epoch=s.epoch,
            accepting=s.accepting,
            draining=s.draining,
            nodes=len(self.hub.links),
            stopping=sum(1 for link in self.hub.links.values() if link.leaving),
            cores=sum(n.cores for n in nodes),
            cores_in_use=sum(n.cores - n.free_cores for n in nodes),
            gpus=sum(n.gpus for n in gpus),
            gpus_in_use=sum(n.gpus - n.free_gpus for n in gpus),
            queue_depth=core.queued,
            running=sum(1 for r in s.actions.values() if r.started is not None),
            # (a lost one holds no environment: a drain must not wait for its client to
            # close it, nor the status count it as open)
            trajectories=sum(1 for t in s.trajectories.values() if t.state in _HOLDING),
            apis={name: q.in_use for name, q in sorted(core.quotas.items())},
            environments=len(s.config.envs),
            problems=s.problems.recent(s.clock()),
        )

    def live(self) -> LiveFigures:
        """What the metrics' gauges show, taken when they are scraped."""
        s, core = self.state, self.state.core
        units: list[Units] = []
        for name, node in core.cpu.nodes.items():
            units.append(Units("cpu", name, node.cores, node.cores - node.free_cores))
            units.append(Units("memory_gb", name, node.memory_gb, node.memory_used_gb))
        for name, gpu in core.gpu.nodes.items():
            units.append(Units("gpu", name, gpu.gpus, gpu.gpus - gpu.free_gpus))
        for name, q in core.quotas.items():
            units.append(Units(f"api:{name}", "", q.concurrency, q.in_use))
        # Every state a held trajectory can be in, 0 when none is: a series that vanishes
        # reads as no data. Not "closed": a closed one is no longer held (it was always 0).
        states = dict.fromkeys((st.value for st in TrajectoryState if st in _SHOWN), 0)
        for rec in s.trajectories.values():
            if rec.state in _SHOWN:
                states[rec.state.value] += 1
        resident: dict[tuple[str, str], int] = {}
        for inst in core.gpu.resident:
            key = (inst.service, inst.chunk.node)
            resident[key] = resident.get(key, 0) + 1
        memory: dict[tuple[str, int], float] = {}
        for name, gpus in core.gpu.nodes.items():
            devices = s.node_gpus.get(name, [])
            for g, gb in enumerate(gpus.used_gb):
                # Rounded to a byte's worth: a sum of decimal GiB (0.1 + 0.2) is not one,
                # and read 0.30000000000000004.
                memory[(name, devices[g] if g < len(devices) else g)] = round(gb, 9)
        now = time.monotonic()  # as the links' last_seen
        return LiveFigures(
            queue_depth=core.queued,
            units=units,
            agents_seen_s={n: now - link.last_seen for n, link in self.hub.links.items()},
            trajectories=states,
            resident=resident,
            gpu_memory_gb=memory,
            core_prices=core.core_prices(),
            think_s=core.returns.think.mean,
            thinking={n: core.returns.thinking.get(n, 0) for n in core.cpu.nodes},
        )

    # ---- configuration -----------------------------------------------------------------
    async def reload(self, text: str | None) -> list[str]:
        """Apply the reloader's definitions (``text``: pushed documents; None: the files)
        and say what changed; ValueError, with the running ones kept, when they are wrong.
        In a thread: resolving secretRefs may ask the API server."""
        assert self.reloader is not None
        return self.reconfigure(await asyncio.to_thread(self.reloader, text))

    def reconfigure(self, config: PoolConfig) -> list[str]:
        """Apply new pool, environment and quota definitions while running; nothing
        queued is dropped. Returns what changed (and what could not), for the log."""
        s = self.state
        changes: list[str] = []
        old = s.config
        changes += named_changes("env", old.envs, config.envs)
        # Each by name and what changed in it: the list of those left said neither what
        # went nor what was edited.
        changes += named_changes("RewardService", old.services, config.services)
        if old.apis != config.apis:
            s.core.set_quotas(config.apis)
            quotas = ({a.name: a for a in apis} for apis in (old.apis, config.apis))
            changes += named_changes("API quota", *quotas)
        # Named only: an endpoint holds its credential (a rotated Secret is such a change).
        moved = sorted(
            name
            for name in set(old.endpoints) | set(config.endpoints)
            if old.endpoints.get(name) != config.endpoints.get(name)
        )
        if moved:
            changes.append("API endpoints or credentials of " + ", ".join(moved))
            self.api.reconfigured(old.endpoints, config.endpoints)
        if config.scheduling != old.scheduling:
            s.core.set_config(config.scheduling)
            changes.append("scheduling" + _reordered(old.scheduling, config.scheduling,
                                                     s.core.queued))  # fmt: skip
        if old.tenants != config.tenants:
            s.core.set_tenants(*config.shares())
            changes.append("tenants " + (", ".join(sorted(config.tenants)) or "none"))
        changes += [
            f"{field} {_shown(getattr(old, attr))} -> {_shown(getattr(config, attr))}"
            for attr, field in _READ_AS_NEEDED
            if getattr(old, attr) != getattr(config, attr)
        ]
        # Agents size their core sets when they start, and the name keys the learned state
        # and the metrics: reported, and the running values kept so the config says what is.
        unapplied = [
            f"{what} {before} -> {after}"
            for what, before, after in (
                ("idleCores", old.idle_cores, config.idle_cores),
                ("coresPerNode", old.cores_per_node or "all", config.cores_per_node or "all"),
                ("pool name", old.name, config.name),
            )
            if before != after
        ]
        if unapplied:
            changes.append("needs a restart, kept as running: " + ", ".join(unapplied))
        s.config = replace(
            config,
            name=old.name,
            idle_cores=old.idle_cores,
            cores_per_node=old.cores_per_node,
        )
        if old.services != config.services or config.services:
            # Unchanged too: each worker loads again the services whose files changed (a
            # weights file renamed over the old one, an edited entry point module), which
            # no document shows.
            self.gpu.services_changed()
        if old.envs != config.envs:
            for node in self.hub.links:
                s.keep_warm(node)
        self.hub.heartbeat_timeout_s = config.heartbeat_timeout_s
        s.wake.set()
        return changes

    # ---- operations --------------------------------------------------------------------
    def trajectory(self, tenant: str, tid: str) -> TrajectoryRecord:
        return self.state.trajectory(tenant, tid)

    async def open_trajectory(self, tenant: str, req: OpenTrajectory) -> TrajectoryRecord:
        return await self.lifecycle.open(tenant, req)

    async def close_trajectory(self, tenant: str, tid: str) -> TrajectoryRecord:
        return await self.lifecycle.close(tenant, tid)

    async def close_opened(self, tenant: str, key: str) -> TrajectoryInfo:
        """Close what the open of idempotency key ``key`` opened (``Trajectories.close_by_key``)."""
        return await self.lifecycle.close_by_key(tenant, key)

    def cancel_trajectory(self, tenant: str, tid: str) -> int:
        return self.lifecycle.cancel_actions(tenant, tid)

    def submit_exec(
        self, tenant: str, tid: str, req: ExecRequest, live: LiveExec | None = None
    ) -> ActionRecord:
        return self.admission.submit_exec(tenant, tid, req, live)

    def submit_service(self, tenant: str, service: str, req: ServiceCallRequest) -> ActionRecord:
        return self.admission.submit_service(tenant, service, req)

    def lease_api(
        self, tenant: str, api: str, req: ApiLeaseRequest | ApiCallRequest
    ) -> ActionRecord:
        return self.admission.lease_api(tenant, api, req)

    def submit_batch(
        self, tenant: str, items: Sequence[BatchItem], numbers: Sequence[int] | None = None
    ) -> list[ActionRecord]:
        """``numbers``: each item's place in the request, which a refusal names."""
        return self.admission.submit_batch(tenant, items, numbers)

    def cancel(self, tenant: str, aid: str) -> bool:
        return self.outcomes.cancel(tenant, aid)

    def release(self, tenant: str, lease: str) -> ActionResult:
        return self.outcomes.release(tenant, lease)


# Settings read where they apply (a request's admission, a node joining, an agent
# leaving): a reload changes them with nothing more to do than say so, by their fields.
_READ_AS_NEEDED = (
    ("max_queued", "spec.admission.maxQueued"),
    ("max_request_bytes", "spec.admission.maxRequestBytes"),
    ("max_file_bytes", "spec.admission.maxFileBytes"),
    ("access_namespaces", "spec.access.namespaces"),
    ("access_service_accounts", "spec.access.serviceAccounts"),
    ("gpus_per_node", "spec.gpu.gpusPerNode (nodes joining from now on)"),
    ("agent_grace_s", "spec.scheduler.agentGraceSeconds"),
    ("heartbeat_timeout_s", "heartbeat timeout"),
)


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _reordered(old: SchedulerConfig, new: SchedulerConfig, queued: int) -> str:
    """What a scheduling change did to the queue's order, by the ActionPool's fields
    (empty: the order is the same)."""
    flag = {True: "true", False: "false"}
    moved = []
    if old.ordering != new.ordering:
        moved.append(f"spec.scheduling.ordering {old.ordering} -> {new.ordering}")
    if old.tenant_fairness != new.tenant_fairness:
        moved.append(f"spec.scheduling.tenantFairness {flag[old.tenant_fairness]} -> "
                     f"{flag[new.tenant_fairness]}")  # fmt: skip
    if not moved:
        return ""
    plural = "" if queued == 1 else "s"
    return f" ({', '.join(moved)}: {queued} queued action{plural} re-ordered)"
