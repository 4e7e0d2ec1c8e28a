"""The scheduler: one action queue, elastic rounds, resource bookkeeping.

``Scheduler`` is synchronous and deterministic: every method takes the time as an argument
and returns plain data. The service (HTTP), the node agent and the simulator all drive this
one object. A round (``schedule``) plans (``planning``: which actions start, where, with how
many units, and why the others wait), then commits the plan: it places the trajectories,
allocates exact cores (NUMA-aware), GPU chunks (buddy, residency-aware) and quota units, and
returns the assignments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from types import MappingProxyType

from tangram.api.action import ActionKind, ActionSpec
from tangram.api.cluster import ApiSpec, ClusterSpec, ServiceSpec
from tangram.api.learned import (
    MAX_KIND_CHARS,
    MAX_LENGTHS,
    MAX_PROFILES,
    MAX_SECONDS,
    MAX_STEPS,
    MAX_TYPE_CHARS,
    LearnedMean,
    LearnedProgress,
    LearnedState,
)
from tangram.scheduler.core.actions import Action, Running, Trajectory, needs
from tangram.scheduler.core.admission import quota_limit, resolve, too_wide
from tangram.scheduler.core.config import SchedulerConfig, SchedulingError
from tangram.scheduler.core.cpu_pool import CpuPool
from tangram.scheduler.core.decisions import (
    Ahead,
    Assignment,
    Drained,
    Invalid,
    Plan,
    Round,
    Start,
)
from tangram.scheduler.core.dp import chunk_level
from tangram.scheduler.core.fair import FairQueue
from tangram.scheduler.core.gpu_pool import Chunk, GpuPool, Instance
from tangram.scheduler.core.ordering import POLICIES, ActionQueue, LengthModel
from tangram.scheduler.core.planning import plan_round, price_of
from tangram.scheduler.core.pricing import NodePrice
from tangram.scheduler.core.profiles import ProfileBook
from tangram.scheduler.core.quota_pool import Quota
from tangram.scheduler.core.resource import GPU, PLACE, Resource
from tangram.scheduler.core.returns import Returns, RunningMean
from tangram.scheduler.core.shares import (
    EQUAL,
    POOL_CORES,
    Holdings,
    RoundCaps,
    TenantShare,
    over_share,
    units_held,
)
from tangram.scheduler.core.sizing import Sizing

# Re-exported: callers import these from here.
__all__ = [
    "Action",
    "Assignment",
    "Drained",
    "Invalid",
    "Plan",
    "Round",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingError",
]

# Why a planned call did not start (Round.refused).
_NO_LANDING = f"{GPU} (no free chunk can host its service after this round's earlier starts)"


class Scheduler:
    def __init__(self, cluster: ClusterSpec, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.cpu = CpuPool.build((n.name, n.cpus, n.numa_nodes, n.memory_gb) for n in cluster.nodes)
        self.gpu = GpuPool.build(
            ((n.name, n.gpus, n.gpu_memory_gb) for n in cluster.nodes),
            {s.name: s.gpu_memory_gb for s in cluster.services},
            (s.name for s in cluster.services if s.replicated),
            {s.name: s.max_calls for s in cluster.services},
        )
        self.services = {s.name: s for s in cluster.services}
        # Services removed while calls of theirs ran: kept in ``services`` until the last
        # of those ends, and taking no new call.
        self.retired: set[str] = set()
        self.quotas = {a.name: Quota.of(a) for a in cluster.apis}
        # Quotas removed while queued or running actions needed them: kept in ``quotas``
        # until the last of those has ended or left the queue.
        self.retired_quotas: set[str] = set()
        # ``_capacity``'s answers by its ``cordoned``, summed once: a submit asks for them
        # while some tenant is capped. Dropped wherever their inputs change (the nodes,
        # their cordons, the quotas and their concurrency): ``_capacity_changed``.
        self._capacities: dict[bool, Mapping[Resource, int]] = {}
        self.book = ProfileBook()
        self.sizing = Sizing(
            self.cpu, self.book, self.config, _biggest(self.cpu), _biggest(self.cpu, cordoned=True)
        )
        self.lengths = LengthModel()
        # Mean queueing time of recently started actions (shortest-remaining's ageing),
        # over the starts of rounds (``_commit``); an adopted action never queued here.
        self.recent_wait = RunningMean()
        # Mean work (units held times seconds) of the recent runs of each kind of action
        # (``_work_kind``): fair queuing's length of an action of a type not known yet.
        self.recent_work: dict[str, RunningMean] = {}
        self.returns = Returns()  # thinking trajectories per node, learned think time
        self.trajectories: dict[str, Trajectory] = {}
        # Trajectories a drain closed while runs of theirs went on elsewhere (a service
        # call on another node's GPUs, an API call): their ends still settle them here,
        # and the trajectory, opened again (its agent came back), counts them as its own.
        self.closing: dict[str, Trajectory] = {}
        self.actions: dict[str, Action] = {}
        self.shares: dict[str, TenantShare] = {}  # by tenant; others get default_share
        self.default_share = EQUAL
        self.queue: ActionQueue | FairQueue = self._new_queue(self.config)
        self.running: dict[str, Running] = {}
        self.queued_by_tenant: dict[str, int] = {}  # the queue's actions, by tenant
        self._seq = 0
        # Queued demand per resource, so a round stops walking once every resource anyone
        # waits for is blocked (a round then costs O(candidates), not O(queue)).
        self.waiting: dict[Resource, int] = {}
        self.queued_work: dict[Resource, float] = {}  # their core-seconds (the core price)
        self.queued_calls: dict[str, int] = {}  # queued calls of each service (joins)
        # Queued actions the pool as it is now cannot host (the nodes, GPUs or quota limit
        # they need left): they wait for one that can, hold nobody back (rounds skip them,
        # the estimate leaves them out) and are not in ``waiting``.
        self.stranded: set[str] = set()
        # Queued actions refused since the last round (``Invalid``), for the next to report.
        self.invalid: list[Invalid] = []

    # ---- trajectories -------------------------------------------------------------
    def open_trajectory(
        self, tid: str, memory_gb: float = 0.0, hint_steps: int | None = None, *, tenant: str = ""
    ) -> None:
        if tid in self.trajectories:
            raise SchedulingError("trajectory", f"{tid} is already open")
        if memory_gb < 0:
            raise SchedulingError("memory_gb", "must be >= 0")
        if self.cpu.nodes and all(memory_gb > n.memory_gb for n in self.cpu.nodes.values()):
            raise SchedulingError("memory_gb", f"{memory_gb} GB exceeds every node's memory")
        traj = Trajectory(id=tid, memory_gb=memory_gb, hint_steps=hint_steps, tenant=tenant)
        gone = self.closing.pop(tid, None)
        if gone is not None:  # a drain closed it while runs of it went on: they are its own
            traj.in_flight = gone.in_flight
            traj.steps_done, traj.busy_s = gone.steps_done, gone.busy_s
        self.trajectories[tid] = traj

    def close_trajectory(self, tid: str, finished: bool = True) -> list[str]:
        """Close a trajectory; its queued actions are dropped and returned.

        Running actions must end (``complete``) first.
        """
        traj = self._traj(tid)
        # None queued or running (most closes): no need to look.
        if traj.in_flight and any(r.action.trajectory == tid for r in self.running.values()):
            raise SchedulingError("trajectory", f"{tid} still has running actions")
        return self._close(traj, finished)

    def _close(self, traj: Trajectory, finished: bool) -> list[str]:
        """Close ``traj``: drop its queued actions (returned) and unplace it. Runs of it
        that go on (a drain closes it under them) keep it in ``closing`` until they end."""
        tid = traj.id
        dropped: list[str] = []
        if traj.in_flight:
            dropped = [a.id for a in self.actions.values() if a.trajectory == tid]
        for aid in dropped:
            self._dequeue(aid)
        if traj.in_flight == 0:  # it was thinking on its node
            self.returns.stops_thinking(self.cpu.placement.get(tid))
        self.cpu.unplace(tid)
        if finished and traj.length_known:
            self.lengths.finished(traj.steps_done)
        del self.trajectories[tid]
        if traj.in_flight:
            self.closing[tid] = traj
        return dropped

    def assume_recent_wait(self, wait_s: float) -> None:
        """Start from a learned recent mean queueing time (``tangram explain`` replays a
        round of a scheduler that had one); later starts move it as after 100 seen."""
        self.recent_wait.assume(_learned("recent_wait_s", wait_s))

    def assume_think_time(self, think_s: float) -> None:
        """Start from a learned mean think time (``tangram explain``), as ``assume_recent_wait``."""
        self.returns.think.assume(_learned("think_s", think_s))

    def assume_exec_action(self, core_s: float, run_s: float) -> None:
        """Start from a learned mean exec action at its smallest size: ``core_s``
        core-seconds over ``run_s`` seconds (``tangram explain``; the offered load)."""
        core_s, run_s = _learned("exec_core_s", core_s), _learned("exec_run_s", run_s)
        self.returns.work.assume(core_s)
        self.returns.run.assume(run_s)

    @property
    def recent_wait_s(self) -> float:
        return self.recent_wait.mean

    def learned(self) -> LearnedState:
        """What this scheduler learned from the runs it saw, for the next one to resume."""
        r = self.returns
        return LearnedState(
            profiles=self.book.export(MAX_PROFILES, MAX_TYPE_CHARS),
            lengths=self.lengths.export(MAX_LENGTHS),
            recent_wait_s=self.recent_wait.export(),
            think_s=r.think.export(),
            exec_core_s=r.work.export(),
            exec_run_s=r.run.export(),
            recent_work=_most_seen(self.recent_work, MAX_PROFILES),
        )

    def resume(self, learned: LearnedState) -> None:
        """Start from what an earlier scheduler learned (``learned``), as if it had seen
        those runs here; what this one saw of the same types is replaced."""
        self.book.restore(learned.profiles)
        self.lengths.restore(learned.lengths)
        self.recent_wait.restore(learned.recent_wait_s)
        r = self.returns
        r.think.restore(learned.think_s)
        r.work.restore(learned.exec_core_s)
        r.run.restore(learned.exec_run_s)
        for kind, mean in learned.recent_work.items():
            self.recent_work.setdefault(kind, RunningMean()).restore(mean)

    def progress(self, tid: str) -> LearnedProgress:
        """What an open trajectory has done, for a restarted scheduler (``resume_progress``)."""
        t = self._traj(tid)
        hint = None if t.hint_steps is None else min(t.hint_steps, MAX_STEPS)
        return LearnedProgress(steps=min(t.steps_done, MAX_STEPS), hint_steps=hint,
                               busy_s=min(t.busy_s, MAX_SECONDS),
                               hint_at=min(t.hint_at, MAX_STEPS))  # fmt: skip

    def resume_progress(self, tid: str, progress: LearnedProgress | None) -> None:
        """An open trajectory taken back after a restart goes on from what it had done
        (``progress``); without it, its length is not learned when it ends."""
        t = self._traj(tid)
        if progress is None:
            t.length_known = False
            return
        t.steps_done, t.busy_s = progress.steps, progress.busy_s
        t.hint_steps, t.hint_at = progress.hint_steps, progress.hint_at

    def windows(self, now: float) -> dict[str, list[float]]:
        """The starts each rate-limited quota's window counts at ``now``, oldest first
        (none: left out), for a restarted scheduler to count too (``resume_windows``)."""
        kept: dict[str, list[float]] = {}
        for name, q in sorted(self.quotas.items()):
            q.window_room(now)  # (drops the starts that no longer count)
            if q.per_period is not None and q.starts:
                kept[name] = list(q.starts)
        return kept

    def resume_windows(self, starts: Mapping[str, Sequence[float]]) -> None:
        """Count an earlier scheduler's starts (``windows``, as times of this clock) in the
        rate windows of the quotas still configured: a restart does not reopen a window."""
        for name, times in starts.items():
            q = self.quotas.get(name)
            if q is not None:
                q.resume(times)

    def place_trajectory(self, tid: str, node: str) -> None:
        """Pin a trajectory to a node (its environment already lives there)."""
        traj = self._traj(tid)
        if node not in self.cpu.nodes:
            raise SchedulingError("node", f"unknown CPU node {node!r}")
        if node in self.cpu.cordoned:
            raise SchedulingError("node", f"{node} takes no new trajectories: it is leaving")
        if tid in self.cpu.placement:
            raise SchedulingError(
                "trajectory", f"{tid} is already placed on {self.cpu.placement[tid]}"
            )
        if self.cpu.nodes[node].free_memory_gb + 1e-9 < traj.memory_gb:
            raise SchedulingError("node", f"{node} lacks {traj.memory_gb} GB for {tid}")
        self._place(tid, node)

    # ---- nodes (a service adds them as agents register, drains them when they leave)
    def add_node(self, name: str, cores: int, numa_nodes: int = 1, memory_gb: float = 0.0) -> None:
        if name in self.cpu.nodes:
            raise SchedulingError("node", f"{name} is already part of the pool")
        if cores < 0 or numa_nodes < 1 or (cores and cores % numa_nodes):
            raise SchedulingError(
                "cores", f"{cores} cores cannot split over {numa_nodes} NUMA nodes"
            )
        self.cpu.add(name, cores, numa_nodes, memory_gb)
        self._nodes_changed()

    def add_gpu_node(self, name: str, gpus: int, memory_gb: float) -> None:
        """A node's GPUs join the pool: ``gpus`` (1, 2, 4 or 8) of ``memory_gb`` each, the
        memory services may use. A node may have cores, GPUs or both."""
        if name in self.gpu.nodes:
            raise SchedulingError("node", f"{name}'s GPUs are already part of the pool")
        if memory_gb <= 0:
            raise SchedulingError("memory_gb", f"GPU memory must be positive, got {memory_gb}")
        try:
            self.gpu.add_node(name, gpus, memory_gb)
        except ValueError as e:
            raise SchedulingError("gpus", str(e)) from None
        self._nodes_changed()

    def set_services(self, services: Sequence[ServiceSpec]) -> None:
        """New RewardService definitions. A removed service's queued calls are refused
        (``invalid``, reported by the next round: the workers no longer hold it); its
        running calls go on, their instances dropped as they end, and the service itself
        once the last has ended (``retired``). A changed footprint drops its idle
        instances."""
        wanted = {s.name: s for s in services}
        if wanted == self.services and not self.retired:
            return  # (each agent's sync says them again: no recount of the queue for that)
        running = {r.action.service for r in self.running.values()}
        for name in [n for n in self.services if n not in wanted]:
            why = f"RewardService {name} was removed from the pool"
            for a in [a for a in self.actions.values() if a.service == name]:
                self._dequeue(a.id)
                self.invalid.append(Invalid(action_id=a.id, field="service", message=why))
            if name in running:
                self.retired.add(name)
                self.gpu.forget(name)  # its instances go as their calls end, as the workers'
            else:
                self._drop_service(name)
        for spec in wanted.values():
            self.retired.discard(spec.name)
            self.services[spec.name] = spec
            self.gpu.set_service(
                spec.name, spec.gpu_memory_gb, spec.replicated, spec.revision, spec.max_calls
            )
        self._recount()  # a footprint may fit the GPUs no more, or again

    def _drop_service(self, name: str) -> None:
        self.retired.discard(name)
        self.services.pop(name, None)
        self.gpu.remove_service(name)

    def _drop_retired(self) -> None:
        """Drop the removed services whose last running call has ended."""
        running = {r.action.service for r in self.running.values()}
        for name in [n for n in self.retired if n not in running]:
            self._drop_service(name)

    def sync_resident(self, node: str, instances: Iterable[tuple[str, int, int]]) -> None:
        """What ``node``'s worker holds in GPU memory: ``(service, first GPU, GPUs)``, least
        recently used first (after a restart or a reconnect the scheduler knows nothing)."""
        if node not in self.gpu.nodes:
            raise SchedulingError("node", f"{node} has no GPUs in the pool")
        self.gpu.sync_node(node, instances)

    def set_unloadable(
        self, node: str, services: Iterable[str], *, loading: Iterable[str] = ()
    ) -> None:
        """The services ``node``'s GPU worker could not load: no call of them is placed
        there (others may still run them). ``loading``: those it is loading and has not
        answered for yet (the node joined, or they were edited): no call of them is placed
        there either until it has (the worker would refuse it), but they are not refused
        for want of a node: they wait, as for a node that is busy."""
        if node not in self.gpu.nodes:
            raise SchedulingError("node", f"{node} has no GPUs in the pool")
        unloadable, pending = frozenset(services), frozenset(loading)
        if (
            self.gpu.unloadable.get(node, frozenset()) == unloadable
            and self.gpu.loading.get(node, frozenset()) == pending
        ):
            return
        self.gpu.unloadable[node] = unloadable
        if pending:
            self.gpu.loading[node] = pending
        else:
            self.gpu.loading.pop(node, None)
        self._recount()

    def cordon_node(self, name: str) -> None:
        """``name`` takes no new work (its agent said it stops, and lets what runs finish):
        no trajectory is placed there, nothing starts on its cores or GPUs, no call joins
        an instance there, and nothing is restored ahead there, as if its capacity were
        gone. What runs there goes on and ends with ``complete`` as any run does. Queued
        actions of its trajectories (they cannot run elsewhere) and calls no other node can
        host wait, holding nobody back (``stranded``), until ``drain_node`` takes the node
        out (dropping the former, ``Drained.dropped``). Cordoning a node twice is one."""
        if name not in self.cpu.nodes and name not in self.gpu.nodes:
            raise SchedulingError("node", f"{name} is not part of the pool")
        if name in self.cpu.cordoned or name in self.gpu.cordoned:
            return
        if name in self.cpu.nodes:
            self.cpu.cordoned.add(name)
        if name in self.gpu.nodes:
            self.gpu.cordoned.add(name)
        self._nodes_changed()

    def is_cordoned(self, name: str) -> bool:
        """Whether ``name`` takes no new work (``cordon_node``), until it is drained."""
        return name in self.cpu.cordoned or name in self.gpu.cordoned

    def drain_node(self, name: str) -> Drained:
        """Take a node out. The runs on its cores or GPUs end (``Drained.running``): their
        quota units come back, and their trajectories stop counting them. Its trajectories
        are closed and their queued actions dropped; their runs elsewhere (a service call
        on another node's GPUs, an API call) go on, and end with ``complete`` as any run
        does, giving back what they hold."""
        if name not in self.cpu.nodes and name not in self.gpu.nodes:
            raise SchedulingError("node", f"{name} is not part of the pool")
        placed = tuple(sorted(t for t, n in self.cpu.placement.items() if n == name))
        # Exec actions hold cores of their trajectory's node, service calls a chunk of a
        # GPU node: either way, ``node`` is where their units are.
        ended = tuple(aid for aid, r in self.running.items() if r.assignment.node == name)
        for aid in ended:
            run = self.running.pop(aid)
            if isinstance(self.queue, FairQueue):
                self.queue.forget(aid)
            for q, n in run.assignment.quotas:
                self.quotas[q].release(n)
            # Its cores and its chunk leave with the node (``remove_node`` below).
            traj = self._owner(run.action.trajectory)
            if traj is not None and self._settle(traj):
                traj.idle_since = None  # no think time: it did not end on its own
        dropped: list[str] = []
        for tid in placed:
            dropped.extend(self._close(self.trajectories[tid], finished=False))
        self.cpu.nodes.pop(name, None)
        self.cpu.cordoned.discard(name)  # (one that joins again takes work)
        self.gpu.remove_node(name)
        if self.retired:
            self._drop_retired()  # their last calls may have run there
        self._nodes_changed()
        return Drained(running=ended, trajectories=placed, dropped=tuple(dropped))

    def _nodes_changed(self) -> None:
        """Capacity changed: every cached choice, waiting count and stranded action is stale."""
        self._capacity_changed()
        self.sizing = replace(
            self.sizing,
            biggest_node=_biggest(self.cpu),
            biggest_any_node=_biggest(self.cpu, cordoned=True),
        )
        for a in self.actions.values():
            a.cache, a.needs = None, None
        self._recount()

    def _recount(self) -> None:
        """Which queued actions the pool can host now, and the waiting counts of those."""
        self.waiting, self.queued_work = {}, {}
        capacity = self._capacity() if self.round_caps_apply() else None
        self.stranded = {a.id for a in self.actions.values() if not self._hostable(a, capacity)}
        for a in self.actions.values():
            self._count(a, +1)

    def _hostable(self, a: Action, capacity: Mapping[Resource, int] | None = None) -> bool:
        """Whether the pool as it is now can ever run queued action ``a``: a node with its
        minimum cores and its trajectory's memory (placed: its node, checked at placement),
        a GPU node its service fits at one of its DoPs, its quota units within the limits,
        none of it on a cordoned node (``cordon_node``);
        with the pool's ``capacity`` (``_capacity``), its smallest size within its tenant's
        share of it (checked at submit: nodes or quota concurrency may go since)."""
        if capacity is not None and self._over_share(a, capacity) is not None:
            return False
        cordoned = self.cpu.cordoned
        if a.cpu and a.trajectory not in self.cpu.placement:
            mem = self.trajectories[a.trajectory].memory_gb
            if not any(
                n.cores >= a.cpu[0] and n.memory_gb + 1e-9 >= mem and n.name not in cordoned
                for n in self.cpu.nodes.values()
            ):
                return False
        elif a.cpu and cordoned and self.cpu.placement[a.trajectory] in cordoned:
            return False  # its trajectory's node takes no new work
        if a.service is not None and not any(self.gpu.fits(a.service, k) for k in a.gpu):
            return False
        return all(n <= quota_limit(self.quotas[q]) for q, n in a.quotas)

    # ---- configuration changes while running --------------------------------------
    def set_quotas(self, apis: Sequence[ApiSpec]) -> None:
        """New quota definitions: limits change in place (units held stay held, and a lower
        limit only stops new starts); new quotas appear; a removed one stays while any
        queued or running action needs it, so nothing waiting is dropped."""
        wanted = {a.name: a for a in apis}
        for name, spec in wanted.items():
            q = self.quotas.get(name)
            if q is None:
                self.quotas[name] = Quota.of(spec)
            else:
                q.set_limits(spec)
        self.retired_quotas = {n for n in self.quotas if n not in wanted}
        self._capacity_changed()  # (a concurrency changed, a quota came or went)
        self._drop_retired_quotas()
        self._recount()  # a lower limit may leave an action asking more than it

    def _drop_retired_quotas(self) -> None:
        """Forget the removed quotas no queued or running action needs any more."""
        needed = {q for a in self.actions.values() for q, _ in a.quotas} | {
            q for r in self.running.values() for q, _ in r.assignment.quotas
        }
        for name in [n for n in self.retired_quotas if n not in needed]:
            del self.quotas[name]
            self.retired_quotas.discard(name)
            self._capacity_changed()  # (its concurrency counted till now)

    def set_config(self, config: SchedulerConfig) -> None:
        """New scheduling settings, all applied at once. A change of the queue ordering or
        of whether tenants are queued fairly rebuilds the queue under the new settings
        (``_requeue``): the queued actions stay queued, re-ordered by the new policy."""
        reorder = (config.ordering, config.tenant_fairness) != (
            self.config.ordering,
            self.config.tenant_fairness,
        )
        self.config = config
        self.sizing = replace(self.sizing, config=config)
        for a in self.actions.values():
            a.cache = None
        if reorder:
            self._requeue(config)

    def _requeue(self, config: SchedulerConfig) -> None:
        """A new queue in ``config``'s order holding the queued actions: each pushed again
        in submission order with its key as the new policy makes it now and its ageing
        deadline counted from its own submission (a change does not reset ageing). Nothing
        else of the actions changes: their waiting counts, stranding and trajectories'
        bookkeeping are the queue's contents, which stay. A fair queue replacing a fair
        queue keeps the tenants' virtual times, so no tenant banks or loses credit."""
        old = self.queue
        queue = self._new_queue(config)
        if isinstance(old, FairQueue) and isinstance(queue, FairQueue):
            queue.resume_tags(old)
        self.queue = queue
        for a in sorted(self.actions.values(), key=lambda a: a.seq):  # (the queued ones)
            traj = self.trajectories[a.trajectory]
            self._push(a, traj.tenant, *self._rank(a, traj))

    def set_tenants(self, shares: Mapping[str, TenantShare], default: TenantShare = EQUAL) -> None:
        """Each tenant's weight and cap; tenants not named get ``default``. Queued actions
        keep their places; the new weights count from the next start on. A queued action
        whose tenant's cap is lowered below its smallest size could never start: it is
        refused, as at submit (``invalid``, reported by the next round)."""
        before = {t: self.share_of(t).max_share for t in self.queued_by_tenant}
        self.shares, self.default_share = dict(shares), default
        changed = {t for t, m in before.items() if self.share_of(t).max_share != m}
        if not changed:
            return
        lowered = {t for t in changed if self.share_of(t).max_share < before[t]}
        capacity = self._capacity(cordoned=True)
        for a in list(self.actions.values()):
            if self.trajectories[a.trajectory].tenant in lowered:
                e = self._over_share(a, capacity)
                if e is not None:
                    self._dequeue(a.id)
                    self.invalid.append(Invalid(action_id=a.id, field=e.field, message=e.message))
        self._recount()  # a higher cap may host an action stranded by a smaller pool

    def share_of(self, tenant: str) -> TenantShare:
        return self.shares.get(tenant, self.default_share)

    def round_caps_apply(self) -> bool:
        """Whether some tenant is capped (its ``max_share`` below 1)."""
        return self.default_share.max_share < 1.0 or any(
            s.max_share < 1.0 for s in self.shares.values()
        )

    def round_caps(self) -> RoundCaps | None:
        """The room capped tenants have in a round; None when no tenant is capped."""
        if not self.round_caps_apply():
            return None
        return RoundCaps(self.share_of, self.holdings(cordoned=False), self._capacity())

    def _over_share(self, a: Action, capacity: Mapping[Resource, int]) -> SchedulingError | None:
        """Why ``a`` could never start under its tenant's cap, as a refusal naming the
        request's field; None when its smallest size fits the cap (``core.shares``). A call
        of a service that batches may join an instance, holding no GPUs: only its quota
        units count then."""
        tenant = self.trajectories[a.trajectory].tenant
        share = self.share_of(tenant).max_share
        batches = a.service is not None and self.gpu.max_calls.get(a.service, 1) > 1
        hit = over_share(a, share, capacity, gpus=not batches)
        if hit is None:
            return None
        r, n, of, cap = hit
        if r == POOL_CORES:
            field, what, pool = "cpu", "cores", f"the pool's {of} cores"
        elif r == GPU:
            field, what, pool = "gpu", "GPUs", f"the pool's {of} GPUs"
        else:
            q = r.name
            # An api action's own quota: its units are the request's ``units`` (a lease).
            field = "units" if a.kind is ActionKind.API and q == a.quotas[0][0] else "quotas"
            what, pool = f"units of {q}", f"{q}'s concurrency of {of}"
        return SchedulingError(
            field,
            f"{n} {what} exceed the most tenant {tenant!r} may ever hold, {cap}: its cap "
            f"spec.access.tenants[].maxShare is {share} of {pool}",
        )

    def holdings(self, *, cordoned: bool = True) -> Holdings:
        """What each tenant's running actions hold, counted when a round needs it (only
        while some tenant is capped), so that starts and completions pay nothing for it.
        ``cordoned`` False: not the cores or GPUs of runs on a cordoned node, which are
        not in the capacity a round's shares are of (``_capacity``); their quota units
        are (a quota is the pool's, not a node's)."""
        held = Holdings()
        out = set() if cordoned else self.cpu.cordoned | self.gpu.cordoned
        for run in self.running.values():
            traj = self._owner(run.action.trajectory)
            if traj is not None:  # "" too: the default share caps it like any other
                # A call that joined an instance holds no GPUs of its own.
                asg = run.assignment
                units = 0 if asg.sharing or (out and asg.node in out) else asg.units
                held.add(traj.tenant, units_held(run.action, units))
        return held

    def _capacity(self, *, cordoned: bool = False) -> Mapping[Resource, int]:
        """The pool's units of each kind a tenant's share caps (for one round).

        A cordoned node's cores and GPUs are left out: nothing new starts there (its agent
        stops), so counting them would let a capped tenant take more than its share of the
        units that do take new work, and leave the other tenants less of them.
        ``cordoned``: counted too, for a refusal of what could never start (at submit, a
        lower share): its agent may come back (a roll), and until then what only a share
        of it would fit waits (``_hostable``), as for a node gone.

        Summed once and kept (read-only) until ``_capacity_changed``."""
        cached = self._capacities.get(cordoned)
        if cached is not None:
            return cached
        cpu_out = () if cordoned else self.cpu.cordoned
        gpu_out = () if cordoned else self.gpu.cordoned
        capacity = {
            POOL_CORES: sum(n.cores for n in self.cpu.nodes.values() if n.name not in cpu_out),
            GPU: sum(n.gpus for n in self.gpu.nodes.values() if n.name not in gpu_out),
        }
        for name, quota in self.quotas.items():
            if quota.concurrency is not None:
                capacity[Resource.api(name)] = quota.concurrency
        kept = self._capacities[cordoned] = MappingProxyType(capacity)
        return kept

    def _capacity_changed(self) -> None:
        """What ``_capacity`` sums changed (a node came, went or was cordoned; a quota came,
        went or took new limits): it is summed again when next asked."""
        self._capacities.clear()

    def set_hint(self, tid: str, remaining_steps: int | None) -> None:
        traj = self._traj(tid)
        traj.hint_steps, traj.hint_at = remaining_steps, traj.steps_done

    # ---- actions -----------------------------------------------------------------
    def submit(self, action_id: str, trajectory: str, spec: ActionSpec, now: float) -> Action:
        traj = self._traj(trajectory)
        if action_id in self.actions or action_id in self.running:
            raise SchedulingError("id", f"action {action_id} already exists")
        action = self._resolve(action_id, trajectory, spec, now, capped=True)
        if traj.in_flight == 0 and traj.idle_since is not None:
            self.returns.think.observe(max(0.0, now - traj.idle_since))
        self._enqueue(action, *self._rank(action, traj))
        return action

    def _rank(self, a: Action, traj: Trajectory) -> tuple[tuple[float, ...], float | None]:
        """``a``'s key and ageing deadline under the current ordering (the deadline counted
        from its submission)."""
        policy, expected = POLICIES[self.config.ordering], partial(self._expected, a)
        key = policy.key(a.seq, traj, self.lengths, expected)
        return key, policy.deadline(a.submitted_at, expected, self.config, self.recent_wait_s)

    def cancel(self, action_id: str) -> bool:
        """Remove a queued action; False if it is not queued (running ones end in ``complete``)."""
        if action_id not in self.queue:
            return False
        self._dequeue(action_id)
        return True

    def complete(
        self,
        action_id: str,
        now: float,
        *,
        ok: bool = True,
        restore_s: float | None = None,
        resident: bool | None = None,
        learn: bool = True,
    ) -> Assignment:
        """A running action ended: release its units; learn from it when it succeeded.

        ``restore_s``: what a service call spent restoring (and evicting), as measured;
        learning leaves it out. ``resident``: whether its instance is in GPU memory now, as
        its worker said (a call that timed out may still have restored it); when unknown,
        a failed call that had to restore, or that joined an instance, leaves it out: the
        restore may be what failed. ``learn=False``: its time is not what it takes (its
        agent answered with the reply of an earlier run of its key).
        """
        run = self.running.pop(action_id, None)
        if run is None:
            raise SchedulingError("id", f"action {action_id} is not running")
        a, asg = run.action, run.assignment
        if asg.cores:
            assert asg.node is not None
            self.cpu.give_back(asg.node, asg.cores)
        if asg.chunk is not None:
            assert a.service is not None
            if resident is None:  # a failed call that restored, or joined a restore, may
                resident = ok or not (asg.restore or asg.sharing)  # have left nothing
            self.gpu.release(a.service, asg.chunk, resident=resident)
        for q, n in asg.quotas:
            self.quotas[q].release(n)
        # What it did: the units it held times the seconds it held them (a call that joined
        # an instance, its part of the instance's GPUs). Its tenant pays that in fair
        # queuing, whatever it was expected to be.
        took = max(0.0, now - asg.started_at)
        work = _held_units(a, asg.units) * took / (asg.sharing + 1)
        if isinstance(self.queue, FairQueue):
            self.queue.ended(action_id, work)
        if learn:
            self.recent_work.setdefault(_work_kind(a), RunningMean()).observe(work)
        traj = self._owner(a.trajectory)
        if traj is not None and self._settle(traj):
            traj.idle_since = now  # its think time starts
        if traj is not None and ok:
            traj.steps_done += 1
            traj.busy_s += took
            # Not from a call that joined an instance: its time holds the batch's slowdown
            # and any wait for the instance's restore, not what the call takes alone.
            alone = learn and not asg.sharing
            if alone and self.config.learn and (a.profile is None or a.profile.efficiency is None):
                if asg.chunk is not None and a.service is not None:
                    # Learn the call, not the restore: the DP adds restores itself.
                    if restore_s is None:
                        restore_s = self.services[a.service].restore_cost(asg.chunk.size)
                        restore_s = restore_s if asg.restore else 0.0
                    took -= restore_s
                self.book.observe(a.type, asg.units, max(0.0, took))
        if self.retired and a.service in self.retired:
            self._drop_retired()  # removed while it ran: gone once its last call ended
        if self.retired_quotas and any(q in self.retired_quotas for q, _ in asg.quotas):
            self._drop_retired_quotas()
        return asg

    def adopt(
        self,
        action_id: str,
        trajectory: str,
        spec: ActionSpec,
        *,
        units: int,
        started_at: float,
        node: str | None = None,
        cores: Sequence[int] | None = None,
        joins: str | None = None,
        gpu_start: int | None = None,
        granted: bool = False,
    ) -> Assignment:
        """Register an action that is already running (a restarted scheduler, ``explain``).

        Exec actions land on ``node`` (or the trajectory's node, or one chosen as for a
        new trajectory) with ``cores`` when given (the ones it runs on), else ``units``
        NUMA-chosen cores; service actions take a chunk: with ``gpu_start``, the one of
        ``node`` that starts at that GPU (the one it runs on); with ``joins`` (the id of a
        running call of the same service), that call's instance, shared. ``granted``: its
        quota units were granted by an earlier scheduler (an API lease still held): they
        are held again whatever room is left, and its start is not counted in the rate
        window again (``resume_windows`` brings back the window it was counted in).
        """
        if cores is not None and len(set(cores)) != units:
            raise SchedulingError("cores", f"{len(set(cores))} distinct cores for {units} units")
        self._traj(trajectory)
        if action_id in self.actions or action_id in self.running:
            raise SchedulingError("id", f"action {action_id} already exists")
        a = self._resolve(action_id, trajectory, spec, started_at)
        key_units = a.cpu or a.gpu or (1,)
        if units not in key_units:
            raise SchedulingError("units", f"{units} is not an allowed count {list(key_units)}")
        # Check every capacity before changing any state: a refused adopt leaves no trace.
        for q, n in a.quotas:
            if not granted and self.quotas[q].free(started_at) < n:
                raise SchedulingError("quotas", f"{q} has no room for {n} more unit(s)")
        if joins is not None and gpu_start is not None:
            raise SchedulingError("gpu_start", "a call joins an instance or takes a chunk")
        chunk = None if joins is None else self._joinable(a, units, joins)
        at = None if gpu_start is None else self._adoptable(a, units, node, gpu_start)
        hosted = (
            chunk is not None
            or at is not None
            or a.service is None
            or self.gpu.can_host(a.service, units)
        )
        if a.gpu and not hosted:
            raise SchedulingError("units", f"no free GPU chunk of {units} for {action_id}")
        placed: str | None = None
        if a.cpu:
            placed = self.cpu.placement.get(trajectory)
            if node is not None and placed is not None and node != placed:
                raise SchedulingError("node", f"trajectory {trajectory} is on {placed}, not {node}")
            if placed is None:
                mem = self.trajectories[trajectory].memory_gb
                free = {n: c.free_cores for n, c in self.cpu.nodes.items()}
                placed = node if node is not None else self.cpu.choose_node(mem, units, free)
                if placed is None or placed not in self.cpu.nodes:
                    raise SchedulingError(
                        "node",
                        f"no node has {units} free cores and {mem} GB free for {trajectory}",
                    )
            if self.cpu.nodes[placed].free_cores < units:
                raise SchedulingError(
                    "units", f"node {placed} has {self.cpu.nodes[placed].free_cores} free cores"
                )
            node_cpu = self.cpu.nodes[placed]
            per = node_cpu.cores // len(node_cpu.numa)
            busy = [
                c
                for c in cores or ()
                if not 0 <= c < node_cpu.cores or c not in node_cpu.numa[c // per]
            ]
            if busy:
                raise SchedulingError("cores", f"cores {busy} of node {placed} are not free")
            if trajectory not in self.cpu.placement:
                self._place(trajectory, placed)
        node = placed if a.cpu else None
        start = Start(
            action_id=action_id,
            resource=needs(a, node, self.cpu.placement)[0],
            node=node,
            units=units,
            expected_s=self._adopted_expected(a, node, units, chunk),
            join=chunk,
        )
        self._enqueue(a, (float(a.seq),), None)
        asg = self._start(a, start, started_at, exact=cores, at=at, granted=granted)
        if asg is None:
            self._dequeue(action_id)
            raise SchedulingError("units", f"no free GPU chunk of {units} for {action_id}")
        return asg  # running until started_at + its expected time, as _start keeps

    def _adopted_expected(
        self, a: Action, node: str | None, units: int, joins: Chunk | None
    ) -> float:
        """An adopted action's expected duration; one sharing an instance is slowed by the
        calls already on it, as a joiner is."""
        expected = self.sizing.choices(a, node)[1].get(units, 0.0)
        if joins is None or a.service is None:
            return expected
        calls = self.gpu.busy.get(Instance(a.service, joins), 0)
        return expected * self.services[a.service].slowdown(calls)

    def _adoptable(self, a: Action, units: int, node: str | None, start: int) -> Chunk:
        """The chunk of ``node`` at GPU ``start`` that ``a``, a call running there at
        ``units`` GPUs, is adopted on; a SchedulingError naming the bad argument if it
        cannot be."""
        if a.service is None:
            raise SchedulingError("gpu_start", f"{a.id} is not a service call: it has no GPUs")
        gpu_node = self.gpu.nodes.get(node or "")
        if gpu_node is None:
            raise SchedulingError("node", f"{node!r} is not a GPU node")
        size = chunk_level(units)
        if start % size or not 0 <= start <= gpu_node.gpus - size:
            raise SchedulingError(
                "gpu_start", f"no chunk of {size} GPUs starts at GPU {start} of {node}"
            )
        chunk = Chunk(gpu_node.name, start, size)
        if not self.gpu.is_free(chunk):
            raise SchedulingError("gpu_start", f"GPUs {list(chunk.gpus)} of {node} are not free")
        return chunk

    def _joinable(self, a: Action, units: int, joins: str) -> Chunk:
        """The chunk of running call ``joins``, whose instance ``a`` (adopted at ``units``)
        shares; a SchedulingError on ``joins`` or ``units`` if it cannot."""
        if a.service is None:
            raise SchedulingError("joins", f"{a.id} is not a service call: it joins nothing")
        run = self.running.get(joins)
        chunk = None if run is None else run.assignment.chunk
        if run is None or chunk is None or run.action.service != a.service:
            raise SchedulingError("joins", f"{joins} is not a running call of {a.service}")
        if chunk.size != chunk_level(units):
            raise SchedulingError(
                "units", f"{units} GPUs, but the instance of {joins} runs on {chunk.size}"
            )
        instance = Instance(a.service, chunk)
        if not self.gpu.has_room(instance, self.gpu.busy.get(instance, 0)):
            raise SchedulingError("joins", f"the instance of {joins} has no room for a call")
        return chunk

    @property
    def queued(self) -> int:
        return len(self.queue)

    def core_prices(self) -> dict[str, NodePrice]:
        """Each CPU node's core price now, with its terms (``core.pricing``); empty when
        prices are off."""
        if self.config.core_price == "none":
            return {}
        return {name: price_of(self, name) for name in self.cpu.nodes}

    # ---- the round ---------------------------------------------------------------
    def schedule(self, now: float) -> Round:
        """One round: plan it, then commit the plan. ``Round.again``: run another now."""
        return self._commit(self.plan(now), now)

    def _joiners_wait(self, started: Sequence[Assignment]) -> bool:
        """Whether ``started`` opened an instance that queued calls of its service could
        join: a plan joins only running instances, so they may start in a round now rather
        than wait for the next event."""
        for asg in started:
            if asg.chunk is not None and not asg.sharing:
                service = self.running[asg.action_id].action.service
                if (
                    service is not None
                    and self.gpu.max_calls.get(service, 1) > 1
                    and self.queued_calls.get(service, 0) > 0
                ):
                    return True
        return False

    def plan(self, now: float) -> Plan:
        """The round's decisions at ``now``: which trajectories go where, which actions start
        with how many units, and why the others wait. Nothing in the pools or the queue
        changes (planning twice gives the same plan); ``schedule`` commits it."""
        return plan_round(self, now)

    def _commit(self, plan: Plan, now: float) -> Round:
        """Apply a plan made at ``now`` with nothing changed since: place its trajectories,
        then allocate exact units and start its actions in queue order."""
        for tid, node in plan.placements:
            self._place(tid, node)  # (refuses its queued actions too wide for the node)
        assignments: list[Assignment] = []
        refused: list[str] = []
        for s in plan.starts:
            asg = self._start(self.actions[s.action_id], s, now)
            if asg is None:
                refused.append(s.action_id)
            else:
                assignments.append(asg)
        for asg in assignments:
            self.recent_wait.observe(max(0.0, asg.queued_s))
        waiting = self.waiting
        wake = [
            t
            for name, q in self.quotas.items()
            if waiting.get(Resource.api(name), 0) > 0 and (t := q.next_expiry_s(now)) is not None
        ]
        invalid, self.invalid = tuple(self.invalid), []
        return Round(
            assignments=tuple(assignments),
            wake_at=min(wake, default=None),
            groups=plan.groups,
            blocked=plan.blocked + tuple((aid, _NO_LANDING) for aid in refused),
            refused=tuple(refused),
            invalid=invalid,
            again=self._joiners_wait(assignments),
            ahead=self._restore_ahead(now) if self.config.restore_ahead else (),
        )

    def _restore_ahead(self, now: float) -> tuple[Ahead, ...]:
        """Instances to restore ahead now: for each service with calls queued or running,
        most calls first, one at the largest DoP it allows (the fastest call, and the
        fewest GB per GPU when sharded) where its next call would land, if that chunk is
        free and has the memory free (``GpuPool.restore_ahead``)."""
        if not self.gpu.nodes:
            return ()
        demand = dict(self.queued_calls)
        for inst, calls in self.gpu.busy.items():  # the running calls, by their instances
            demand[inst.service] = demand.get(inst.service, 0) + calls
        out: list[Ahead] = []
        fixed = self.config.fixed_dop
        for service in sorted(demand, key=lambda s: (-demand[s], s)):
            svc = self.services.get(service)
            if svc is None or service in self.retired:  # (removed: no call will come)
                continue
            sizes = [k for k in svc.dop_choices if fixed is None or k <= fixed]
            k = max((k for k in sizes if self.gpu.fits(service, k)), default=None)
            if k is None:
                continue
            cost = svc.restore_cost(chunk_level(k))
            got = self.gpu.restore_ahead(service, k, now, cost)
            if got is not None:
                inst, ready = got
                out.append(
                    Ahead(service=service, chunk=inst.chunk, expected_s=ready - now, ready_at=ready)
                )
        return tuple(out)

    def ahead_done(self, service: str, chunk: Chunk, *, ok: bool = True) -> None:
        """A restore ahead of ``service`` on ``chunk`` ended; ``ok`` false: it failed (or
        its worker could not say), and the instance is not counted in GPU memory."""
        self.gpu.ahead_done(Instance(service, chunk), resident=ok)

    # ---- internals ---------------------------------------------------------------
    def _traj(self, tid: str) -> Trajectory:
        try:
            return self.trajectories[tid]
        except KeyError:
            raise SchedulingError("trajectory", f"{tid} is not open") from None

    def _resolve(
        self, action_id: str, trajectory: str, spec: ActionSpec, now: float, *, capped: bool = False
    ) -> Action:
        """The action ``spec`` describes, or a SchedulingError naming the field at fault;
        ``capped``: refused too if its tenant's share could never hold it (a new action,
        not one adopted, which runs already)."""
        a = resolve(
            spec,
            action_id=action_id,
            trajectory=trajectory,
            seq=self._seq + 1,
            now=now,
            sizing=self.sizing,
            gpu=self.gpu,
            services=(
                {n: v for n, v in self.services.items() if n not in self.retired}
                if self.retired
                else self.services
            ),
            quotas=self.quotas,
        )
        # Only its own tenant's cap can refuse it: the pool's capacity is summed then.
        if capped and self.share_of(self._traj(trajectory).tenant).max_share < 1.0:
            refused = self._over_share(a, self._capacity(cordoned=True))
            if refused is not None:
                raise refused
        self._seq += 1  # only once it is accepted
        return a

    def _expected(self, a: Action) -> float:
        return self.sizing.expected(a, self.cpu.placement.get(a.trajectory) if a.cpu else None)

    def _new_queue(self, config: SchedulerConfig) -> ActionQueue | FairQueue:
        policy = POLICIES[config.ordering]
        if not config.tenant_fairness:
            return policy.new_queue()
        return FairQueue(policy.new_queue, lambda t: self.share_of(t).weight, self._work)

    def _work(self, action_id: str) -> float:
        """A queued action's length in fair queuing: the work it is expected to be, the
        units it holds at its smallest size times its expected duration then. Of a type
        neither declared (``t1_s``) nor learned yet: the mean work of the recent runs of
        its kind (``recent_work``), the default duration only until one has ended. Either
        way only its start is ordered by it: its tenant is charged what it did when it
        ends (``complete``, ``FairQueue.ended``)."""
        a = self.actions[action_id]
        if a.profile is None and not self.book.knows(a.type):
            recent = self.recent_work.get(_work_kind(a))
            if recent is not None and recent.seen:
                return recent.mean
        k, d = self.sizing.smallest(a, self.cpu.placement.get(a.trajectory) if a.cpu else None)
        return _held_units(a, k) * d

    def _enqueue(self, a: Action, key: tuple[float, ...], deadline: float | None) -> None:
        traj = self.trajectories[a.trajectory]
        self.actions[a.id] = a
        node = self.cpu.placement.get(a.trajectory)
        if traj.in_flight == 0:
            self.returns.stops_thinking(node)
        traj.in_flight += 1
        if a.cpu:
            k, d = self.sizing.smallest(a, node)
            a.work = k * d
            self.returns.asks(k, d)
            traj.queued_exec += 1
            traj.queued_work += a.work
            traj.widest = max(traj.widest, a.cpu[0])
        by_tenant = self.queued_by_tenant
        by_tenant[traj.tenant] = by_tenant.get(traj.tenant, 0) + 1
        # Admission checked the rest against the pool as it is; not the memory of a
        # trajectory opened before the nodes with enough of it left, a service call's
        # nodes still loading its service (``set_unloadable``) or cordoned, a placed
        # trajectory's node cordoned, nor its tenant's share of the nodes taking new work
        # (admission counts a cordoned node's units: ``_capacity``).
        shares = (
            self._capacity()
            if (self.cpu.cordoned or self.gpu.cordoned) and self.round_caps_apply()
            else None
        )
        if (
            (a.cpu and (node is None or node in self.cpu.cordoned))
            or a.service is not None
            or shares is not None
        ) and not self._hostable(a, shares):
            self.stranded.add(a.id)
        self._count(a, +1)
        if a.service is not None:
            self.queued_calls[a.service] = self.queued_calls.get(a.service, 0) + 1
        self._push(a, traj.tenant, key, deadline)

    def _push(self, a: Action, tenant: str, key: tuple[float, ...], deadline: float | None) -> None:
        """Into the queue (a fair queue: under its trajectory's tenant)."""
        if isinstance(self.queue, FairQueue):
            self.queue.push(a.id, key, a.seq, deadline, tenant=tenant)
        else:
            self.queue.push(a.id, key, a.seq, deadline)

    def _dequeue(self, action_id: str, *, started: bool = False) -> Action:
        """Take an action off the queue (cancelled, dropped or, ``started``, starting:
        then its tenant is charged for it in fair queuing)."""
        if started and isinstance(self.queue, FairQueue):
            self.queue.started(action_id)
        else:
            self.queue.remove(action_id)
        a = self.actions.pop(action_id)
        self._count(a, -1)
        self.stranded.discard(action_id)
        if a.service is not None:
            calls = self.queued_calls[a.service] - 1
            if calls:
                self.queued_calls[a.service] = calls
            else:
                del self.queued_calls[a.service]
        traj = self.trajectories[a.trajectory]
        if a.cpu:
            traj.queued_exec -= 1
            traj.queued_work = traj.queued_work - a.work if traj.queued_exec else 0.0
            if not traj.queued_exec:
                traj.widest = 0
        if not started and self._settle(traj):
            traj.idle_since = None  # cancelled: the gap to its next action is no think time
        left = self.queued_by_tenant[traj.tenant] - 1
        if left:
            self.queued_by_tenant[traj.tenant] = left
        else:
            del self.queued_by_tenant[traj.tenant]
        if (
            not started
            and self.retired_quotas
            and any(q in self.retired_quotas for q, _ in a.quotas)
        ):
            self._drop_retired_quotas()  # (cancelled, dropped: it needs them no more)
        return a

    def _count(self, a: Action, delta: int) -> None:
        if self.stranded and a.id in self.stranded:
            return  # it waits for the pool to change, for nothing in it
        w, placement = self.waiting, self.cpu.placement
        wants = needs(a, placement.get(a.trajectory) if a.cpu else None, placement)
        for r in wants:
            w[r] = w.get(r, 0) + delta
        if a.work:
            self._add_work(wants[0], delta * a.work)

    def _add_work(self, r: Resource, work: float) -> None:
        left = self.queued_work.get(r, 0.0) + work
        if self.waiting.get(r, 0) > 0:
            self.queued_work[r] = left
        else:  # nothing queued there: drop the sum's rounding residue with the entry
            self.queued_work.pop(r, None)

    def _settle(self, traj: Trajectory) -> bool:
        """One of ``traj``'s actions left the queue or ended; True if it is thinking now."""
        traj.in_flight -= 1
        if traj.in_flight:
            return False
        if self.closing.get(traj.id) is traj:  # closed by a drain: its last run ended
            del self.closing[traj.id]
            return False
        self.returns.starts_thinking(self.cpu.placement.get(traj.id))
        return True

    def _owner(self, tid: str) -> Trajectory | None:
        """The trajectory a run counts for: open, or closed by a drain while it ran."""
        traj = self.trajectories.get(tid)
        return traj if traj is not None else self.closing.get(tid)

    def _place(self, tid: str, node: str) -> None:
        """Place a trajectory; its queued exec actions now wait on that node's cores, but
        those whose minimum exceeds them, which are refused (``invalid``)."""
        traj = self.trajectories[tid]
        if traj.queued_exec and traj.widest > self.cpu.nodes[node].cores:
            self._refuse_wider(traj, node, self.cpu.nodes[node].cores)
        self.cpu.place(tid, node, traj.memory_gb)
        if traj.in_flight == 0:
            self.returns.starts_thinking(node)
        if traj.queued_exec:
            w = self.waiting
            w[PLACE] -= traj.queued_exec
            cores = Resource.cpu(node)
            w[cores] = w.get(cores, 0) + traj.queued_exec
            self._add_work(PLACE, -traj.queued_work)
            self._add_work(cores, traj.queued_work)

    def _refuse_wider(self, traj: Trajectory, node: str, cores: int) -> None:
        """Take out of the queue ``traj``'s exec actions that need more than the ``cores``
        of ``node``, where it is being placed: they could never run (the trajectory stays
        there). Refused as at submit, they are reported by the next round."""
        tid, widest = traj.id, 0
        for a in [a for a in self.actions.values() if a.trajectory == tid and a.cpu]:
            if a.cpu[0] <= cores:
                widest = max(widest, a.cpu[0])
                continue
            self._dequeue(a.id)
            e = too_wide(a.cpu[0], tid, node, cores)
            self.invalid.append(Invalid(action_id=a.id, field=e.field, message=e.message))
        traj.widest = widest

    def _start(
        self,
        a: Action,
        s: Start,
        now: float,
        *,
        exact: Sequence[int] | None = None,
        at: Chunk | None = None,
        granted: bool = False,
    ) -> Assignment | None:
        """Allocate and start; None (the action stays queued) if its GPU chunk went to an
        earlier candidate of this round (chunk counts cannot see per-node GPU memory).
        ``exact``: these very cores, ``at``: this very chunk, ``granted``: its quota units
        granted before (an adopted action, ``adopt``)."""
        k = s.units
        grant = None
        if a.gpu:
            assert a.service is not None
            try:
                grant = self.gpu.allocate(a.service, k, join=s.join, at=at)
            except ValueError:
                return None
        self._dequeue(a.id, started=True)
        cores: tuple[int, ...] = ()
        chunk = None
        restore = False
        evicted: tuple[str, ...] = ()
        expected = s.expected_s
        if a.cpu:
            assert s.node is not None
            cores = (
                self.cpu.take(s.node, k) if exact is None else self.cpu.take_exact(s.node, exact)
            )
        ready_in = 0.0
        if grant is not None:
            assert a.service is not None
            chunk, restore = grant.chunk, not grant.resident
            if not grant.sharing:  # a joiner's wait for the instance is in its estimate
                ready_in = max(0.0, self.gpu.ahead.get(Instance(a.service, chunk), now) - now)
                expected += ready_in
            evicted = tuple(
                f"{i.service}@{i.chunk.node}:{i.chunk.start}+{i.chunk.size}" for i in grant.evicted
            )
            if restore:
                expected += self.services[a.service].restore_cost(chunk.size)
        for q, n in a.quotas:
            if granted:
                self.quotas[q].hold(n)
            else:
                self.quotas[q].acquire(now, n)
        asg = Assignment(
            action_id=a.id,
            trajectory=a.trajectory,
            node=s.node or (chunk.node if chunk else None),
            cores=cores,
            chunk=chunk,
            restore=restore,
            evicted=evicted,
            sharing=grant.sharing if grant is not None else 0,
            ready_in_s=ready_in,
            quotas=a.quotas,
            units=k,
            expected_s=expected,
            started_at=now,
            queued_s=now - a.submitted_at,
        )
        self.running[a.id] = Running(asg, a, now + expected, s.resource)
        return asg


def _held_units(a: Action, units: int) -> int:
    """The units ``a`` holds started with ``units`` (its cores or GPUs), as fair queuing
    counts its work: those, or an API action's units of its quota."""
    if a.cpu or a.gpu or not a.quotas:
        return units
    return a.quotas[0][1]


def _work_kind(a: Action) -> str:
    """The kind of action whose recent runs stand for one of a type not known yet: exec
    actions, the calls of one service, those of one API quota."""
    if a.service is not None:
        return f"service:{a.service}"
    if a.kind is ActionKind.API and a.quotas:
        return f"api:{a.quotas[0][0]}"
    return a.kind.value


def _most_seen(means: Mapping[str, RunningMean], most: int) -> dict[str, LearnedMean]:
    """The ``most`` of ``means`` with the most samples (ties by kind), exported; a kind of
    a name too long for the document (a simulated cluster's names are unbounded) is not."""
    sane = [k for k, m in means.items() if m.seen and len(k) <= MAX_KIND_CHARS]
    kept = sorted(sane, key=lambda k: (-means[k].seen, k))[:most]
    return {k: means[k].export() for k in sorted(kept)}


def _learned(name: str, value: float) -> float:
    """``value`` given for a learned mean (``Scheduler.assume_*``): finite and >= 0, or a
    SchedulingError naming ``name``."""
    if not (math.isfinite(value) and value >= 0):
        raise SchedulingError(name, f"{value} must be finite and >= 0")
    return value


def _biggest(cpu: CpuPool, *, cordoned: bool = False) -> int:
    """Cores of the largest node taking new work; ``cordoned``: of the largest node,
    cordoned or not (``Sizing.biggest_any_node``)."""
    return max(
        (n.cores for n in cpu.nodes.values() if cordoned or n.name not in cpu.cordoned),
        default=0,
    )
