"""The scheduler: unified action queue, elastic rounds, resource bookkeeping.

``Scheduler`` is synchronous and deterministic: every method takes the time as
an argument and returns plain data. The service (HTTP), the node agent and the
simulator all drive this one object.

A round (``schedule``) follows Algorithm 1 of seed 000:

1. Candidates: walk the queue in policy order and take every action that fits
   at its minimum units, respecting topology (free cores of the trajectory's
   node, buddy GPU chunks, quota windows). An action that does not fit — or
   that waits behind one that did not — blocks every resource it needs for the
   rest of the round, so nothing behind it on those resources overtakes it (FCFS
   per resource, hence no starvation: by induction on queue position, the first
   waiting action of a resource holds its reservation until running actions
   release enough), while actions on unrelated resources — another node, an API
   quota — still proceed. The price is head-of-line blocking for actions that
   need several quotas; docs/simulator.md measures it.
2. Split candidates by key resource (the cores of one node, the GPU pool).
3. Groups with no elastic candidate run at minimum units; the others go through
   greedy eviction (``elastic.greedy_evict``) with the ACT approximation.
4. Allocate exact cores (NUMA-aware), GPU chunks (buddy, residency-aware) and
   quota units, and return the assignments.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tangram.api.action import ActionKind, ActionSpec
from tangram.api.cluster import ApiSpec, ClusterSpec, ServiceSpec
from tangram.api.demand import allowed_units
from tangram.scheduler.core.cpu_pool import CpuPool, PlannedPlacements
from tangram.scheduler.core.dp import ChunkState, chunk_level, take_chunk
from tangram.scheduler.core.elastic import EvictionStep, greedy_evict
from tangram.scheduler.core.gpu_pool import Chunk, GpuPool
from tangram.scheduler.core.objective import Pending
from tangram.scheduler.core.ordering import FifoQueue, LengthModel, OrderedQueue
from tangram.scheduler.core.profiles import Profile, ProfileBook
from tangram.scheduler.core.quota_pool import Quota
from tangram.scheduler.core.resource import GPU, PLACE, Resource

Ordering = Literal["fcfs", "trajectory-priority"]


class SchedulingError(ValueError):
    """A request the scheduler cannot accept; ``field`` names the offending input."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    ordering: Ordering = "fcfs"
    depth: int = 2
    explore: Literal["paper", "doubling"] = "paper"  # head counts the estimate tries
    max_candidates: int | None = None  # per round; None = the whole fitting prefix
    elastic: bool = True
    fixed_dop: int | None = None  # baseline: elastic actions always get this many units
    ageing_factor: float = 4.0  # trajectory-priority: overdue after this x expected duration
    min_age_s: float = 1.0
    horizon: int | None = None  # queued actions per resource the estimate looks at
    learn: bool = True

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise SchedulingError("depth", "must be at least 1")
        if self.max_candidates is not None and self.max_candidates < 1:
            raise SchedulingError("max_candidates", "must be at least 1")
        if self.fixed_dop is not None and self.fixed_dop < 1:
            raise SchedulingError("fixed_dop", "must be at least 1")
        if self.explore not in ("paper", "doubling"):
            raise SchedulingError("explore", f"unknown rule {self.explore!r}")
        if self.ordering not in ("fcfs", "trajectory-priority"):
            raise SchedulingError("ordering", f"unknown policy {self.ordering!r}")


@dataclass(slots=True, kw_only=True)
class Trajectory:
    id: str
    memory_gb: float
    hint_steps: int | None = None  # remaining steps the client announced ...
    hint_at: int = 0  # ... when it had taken this many
    steps_done: int = 0
    busy_s: float = 0.0
    queued_exec: int = 0  # queued exec actions (their key resource moves when it is placed)


@dataclass(slots=True, kw_only=True)
class Action:
    id: str
    trajectory: str
    kind: ActionKind
    type: str
    seq: int
    submitted_at: float
    cpu: tuple[int, ...]
    gpu: tuple[int, ...]
    service: str | None
    quotas: tuple[tuple[str, int], ...]
    profile: Profile | None
    elastic_capable: bool
    probe: bool = False
    # Cache of _choices: (book version of the type, units, durations, pending view).
    cache: tuple[int, tuple[int, ...], dict[int, float], Pending] | None = None
    needs: tuple[Resource, ...] | None = None  # cached once the resources it needs are settled


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    action_id: str
    trajectory: str
    node: str | None
    cores: tuple[int, ...] = ()
    chunk: Chunk | None = None
    restore: bool = False  # the service instance must be restored into the chunk
    evicted: tuple[str, ...] = ()  # "service@node:start+size" instances evicted for it
    quotas: tuple[tuple[str, int], ...] = ()
    units: int = 1  # units of the key resource (DoP)
    expected_s: float = 0.0
    started_at: float = 0.0
    queued_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupDecision:
    """How one key resource's candidates were arranged (for ``tangram explain``)."""

    resource: Resource
    candidates: tuple[str, ...]
    elastic: bool
    kept: int
    steps: tuple[EvictionStep, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    assignments: tuple[Assignment, ...]
    wake_at: float | None  # earliest time a rate window frees a blocked action
    groups: tuple[GroupDecision, ...] = ()
    blocked: tuple[tuple[str, str], ...] = ()  # (action id, resource it waits for)


@dataclass(frozen=True, slots=True, kw_only=True)
class Start:
    """A queued action a round starts: on which resource and node, with how many units."""

    action_id: str
    resource: Resource  # its key resource
    node: str | None  # the node of its cores (exec actions)
    units: int  # of the key resource
    expected_s: float  # expected duration at ``units``, before any restore


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A round's decisions before any is applied (``Scheduler.plan``)."""

    placements: tuple[tuple[str, str], ...]  # (trajectory, node), in the order decided
    starts: tuple[Start, ...]  # in queue order
    groups: tuple[GroupDecision, ...]
    blocked: tuple[tuple[str, str], ...]  # (action id, resource it waits for)


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained:
    """What a node took with it when it left (its agent stopped answering)."""

    running: tuple[str, ...]  # actions that were running there: they end in error
    trajectories: tuple[str, ...]  # trajectories placed there: their environments are lost
    dropped: tuple[str, ...]  # queued actions of those trajectories


@dataclass(slots=True)
class _Running:
    assignment: Assignment
    action: Action
    expected_end: float
    resource: Resource


@dataclass(slots=True)
class _Provisional:
    cpu_free: dict[str, int]
    chunks: ChunkState
    quota_free: dict[str, int]


@dataclass(slots=True)
class _Candidate:
    action: Action
    resource: Resource
    node: str | None
    durations: dict[int, float]


class Scheduler:
    def __init__(self, cluster: ClusterSpec, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.cpu = CpuPool.build((n.name, n.cpus, n.numa_nodes, n.memory_gb) for n in cluster.nodes)
        self.gpu = GpuPool.build(
            ((n.name, n.gpus, n.gpu_memory_gb) for n in cluster.nodes),
            {s.name: s.gpu_memory_gb for s in cluster.services},
            (s.name for s in cluster.services if s.replicated),
        )
        self.services = {s.name: s for s in cluster.services}
        self._biggest_node = max((n.cores for n in self.cpu.nodes.values()), default=0)
        self.quotas = {
            a.name: Quota(a.name, a.concurrency, *(a.window() or (None, 1.0))) for a in cluster.apis
        }
        self.book = ProfileBook()
        self.lengths = LengthModel()
        self.trajectories: dict[str, Trajectory] = {}
        self.actions: dict[str, Action] = {}
        self.queue: FifoQueue | OrderedQueue = (
            FifoQueue() if self.config.ordering == "fcfs" else OrderedQueue()
        )
        self.running: dict[str, _Running] = {}
        self._seq = 0
        # Queued demand per resource, so a round stops walking once every resource anyone
        # waits for is blocked (a round then costs O(candidates), not O(queue)).
        self._waiting: dict[Resource, int] = {}

    # ---- trajectories -------------------------------------------------------------
    def open_trajectory(
        self, tid: str, memory_gb: float = 0.0, hint_steps: int | None = None
    ) -> None:
        if tid in self.trajectories:
            raise SchedulingError("trajectory", f"{tid} is already open")
        if memory_gb < 0:
            raise SchedulingError("memory_gb", "must be >= 0")
        if self.cpu.nodes and all(memory_gb > n.memory_gb for n in self.cpu.nodes.values()):
            raise SchedulingError("memory_gb", f"{memory_gb} GB exceeds every node's memory")
        self.trajectories[tid] = Trajectory(id=tid, memory_gb=memory_gb, hint_steps=hint_steps)

    def close_trajectory(self, tid: str, finished: bool = True) -> list[str]:
        """Close a trajectory; its queued actions are dropped and returned.

        Running actions must end (``complete``) first.
        """
        traj = self._traj(tid)
        if any(r.action.trajectory == tid for r in self.running.values()):
            raise SchedulingError("trajectory", f"{tid} still has running actions")
        dropped = [a.id for a in self.actions.values() if a.trajectory == tid]
        for aid in dropped:
            self._dequeue(aid)
        self.cpu.unplace(tid)
        if finished:
            self.lengths.finished(traj.steps_done)
        del self.trajectories[tid]
        return dropped

    def place_trajectory(self, tid: str, node: str) -> None:
        """Pin a trajectory to a node (its environment already lives there)."""
        traj = self._traj(tid)
        if node not in self.cpu.nodes:
            raise SchedulingError("node", f"unknown CPU node {node!r}")
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
        """New RewardService definitions. A removed service stays while any queued or
        running action needs it (nothing waiting is dropped); a changed footprint drops its
        idle instances."""
        wanted = {s.name: s for s in services}
        needed = {a.service for a in self.actions.values()} | {
            r.action.service for r in self.running.values()
        }
        for name in [n for n in self.services if n not in wanted and n not in needed]:
            del self.services[name]
            self.gpu.remove_service(name)
        for spec in wanted.values():
            self.services[spec.name] = spec
            self.gpu.set_service(spec.name, spec.gpu_memory_gb, spec.replicated, spec.revision)

    def sync_resident(self, node: str, instances: Iterable[tuple[str, int, int]]) -> None:
        """What ``node``'s worker holds in GPU memory: ``(service, first GPU, GPUs)``, least
        recently used first (after a restart or a reconnect the scheduler knows nothing)."""
        if node not in self.gpu.nodes:
            raise SchedulingError("node", f"{node} has no GPUs in the pool")
        self.gpu.sync_node(node, instances)

    def set_unloadable(self, node: str, services: Iterable[str]) -> None:
        """The services ``node``'s GPU worker could not load: no call of them is placed
        there (others may still run them)."""
        if node not in self.gpu.nodes:
            raise SchedulingError("node", f"{node} has no GPUs in the pool")
        self.gpu.unloadable[node] = frozenset(services)

    def drain_node(self, name: str) -> Drained:
        """Take a node out: its trajectories are closed, every running action of theirs
        or on its GPUs forgotten (quota units come back), their queued actions dropped."""
        if name not in self.cpu.nodes and name not in self.gpu.nodes:
            raise SchedulingError("node", f"{name} is not part of the pool")
        placed = tuple(sorted(t for t, n in self.cpu.placement.items() if n == name))
        lost = set(placed)
        running = tuple(
            aid
            for aid, r in self.running.items()
            if r.assignment.node == name or r.action.trajectory in lost
        )
        for aid in running:
            for q, n in self.running.pop(aid).assignment.quotas:
                self.quotas[q].release(n)
        dropped: list[str] = []
        for tid in placed:
            dropped.extend(self.close_trajectory(tid, finished=False))
        self.cpu.nodes.pop(name, None)
        self.gpu.remove_node(name)
        self._nodes_changed()
        return Drained(running=running, trajectories=placed, dropped=tuple(dropped))

    def _nodes_changed(self) -> None:
        """Capacity changed: every cached choice and waiting count is stale."""
        self._biggest_node = max((n.cores for n in self.cpu.nodes.values()), default=0)
        self._waiting = {}
        for a in self.actions.values():
            a.cache, a.needs = None, None
            self._count(a, +1)

    # ---- configuration changes while running --------------------------------------
    def set_quotas(self, apis: Sequence[ApiSpec]) -> None:
        """New quota definitions: limits change in place (units held stay held, and a lower
        limit only stops new starts); new quotas appear; a removed one stays while any
        queued or running action needs it, so nothing waiting is dropped."""
        wanted = {a.name: a for a in apis}
        for name, spec in wanted.items():
            per, period = spec.window() or (None, 1.0)
            q = self.quotas.get(name)
            if q is None:
                self.quotas[name] = Quota(name, spec.concurrency, per, period)
            else:
                q.concurrency, q.per_period, q.period_s = spec.concurrency, per, period
        needed = {q for a in self.actions.values() for q, _ in a.quotas} | {
            q for r in self.running.values() for q, _ in r.assignment.quotas
        }
        for name in [n for n in self.quotas if n not in wanted and n not in needed]:
            del self.quotas[name]

    def set_config(self, config: SchedulerConfig) -> None:
        """New scheduling settings; the queue ordering can only change with an empty queue."""
        if config.ordering != self.config.ordering and len(self.queue):
            raise SchedulingError("ordering", "can only change while no action is queued")
        if config.ordering != self.config.ordering:
            self.queue = FifoQueue() if config.ordering == "fcfs" else OrderedQueue()
        self.config = config
        for a in self.actions.values():
            a.cache = None

    def set_hint(self, tid: str, remaining_steps: int | None) -> None:
        traj = self._traj(tid)
        traj.hint_steps, traj.hint_at = remaining_steps, traj.steps_done

    # ---- actions -----------------------------------------------------------------
    def submit(self, action_id: str, trajectory: str, spec: ActionSpec, now: float) -> Action:
        traj = self._traj(trajectory)
        if action_id in self.actions or action_id in self.running:
            raise SchedulingError("id", f"action {action_id} already exists")
        action = self._resolve(action_id, trajectory, spec, now)
        self._enqueue(action, self._order_key(action, traj), self._deadline(action, now))
        return action

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
    ) -> Assignment:
        """A running action ended: release its units; learn from it when it succeeded.

        ``restore_s``: what a service call spent restoring (and evicting), as measured;
        learning leaves it out. ``resident``: whether its instance is in GPU memory now, as
        its worker said (a call that timed out may still have restored it); when unknown,
        a failed call that had to restore leaves it out: the restore may be what failed.
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
            if resident is None:
                resident = ok or not asg.restore
            self.gpu.release(a.service, asg.chunk, resident=resident)
        for q, n in asg.quotas:
            self.quotas[q].release(n)
        traj = self.trajectories.get(a.trajectory)
        if traj is not None and ok:
            took = max(0.0, now - asg.started_at)
            traj.steps_done += 1
            traj.busy_s += took
            if self.config.learn and (a.profile is None or a.profile.efficiency is None):
                if asg.chunk is not None and a.service is not None:
                    # Learn the call, not the restore: the DP adds restores itself.
                    if restore_s is None:
                        restore_s = self.services[a.service].restore_cost(asg.chunk.size)
                        restore_s = restore_s if asg.restore else 0.0
                    took -= restore_s
                self.book.observe(a.type, asg.units, max(0.0, took))

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
    ) -> Assignment:
        """Register an action that is already running (a restarted scheduler, ``explain``).

        Exec actions land on ``node`` (or the trajectory's node, or one chosen as for a
        new trajectory) with ``cores`` when given (the ones it runs on), else ``units``
        NUMA-chosen cores; service actions take a chunk.
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
            if self.quotas[q].free(started_at) < n:
                raise SchedulingError("quotas", f"{q} has no room for {n} more unit(s)")
        if a.gpu and a.service is not None and not self.gpu.can_host(a.service, units):
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
            resource=self._needs(a, node)[0],
            node=node,
            units=units,
            expected_s=self._choices(a, node)[1].get(units, 0.0),
        )
        self._enqueue(a, (float(a.seq),), None)
        asg = self._start(a, start, started_at, exact=cores)
        if asg is None:
            self._dequeue(action_id)
            raise SchedulingError("units", f"no free GPU chunk of {units} for {action_id}")
        run = self.running[action_id]
        run.expected_end = started_at + asg.expected_s
        return asg

    @property
    def queued(self) -> int:
        return len(self.queue)

    # ---- the round ---------------------------------------------------------------
    def schedule(self, now: float) -> Round:
        """One round: plan it, then commit the plan (place, allocate, start)."""
        plan = self.plan(now)
        for tid, node in plan.placements:
            self._place(tid, node)
        started = (self._start(self.actions[s.action_id], s, now) for s in plan.starts)
        assignments = [a for a in started if a is not None]
        waiting = self._waiting
        wake = [
            t
            for name, q in self.quotas.items()
            if waiting.get(Resource.api(name), 0) > 0 and (t := q.next_expiry_s(now)) is not None
        ]
        return Round(
            assignments=tuple(assignments),
            wake_at=min(wake, default=None),
            groups=plan.groups,
            blocked=plan.blocked,
        )

    def plan(self, now: float) -> Plan:
        """The round's decisions at ``now``: which trajectories go where, which actions start
        with how many units, and why the others wait. Nothing in the pools or the queue
        changes (planning twice gives the same plan); ``schedule`` commits it."""
        view = PlannedPlacements(self.cpu)
        cands, rest, blocked = self._candidates(now, view)
        groups: dict[Resource, list[_Candidate]] = {}
        for c in cands:
            groups.setdefault(c.resource, []).append(c)
        decisions: list[GroupDecision] = []
        chosen: dict[str, int] = {}
        for resource, group in groups.items():
            units, decision = self._arrange(resource, group, rest.get(resource, []), now)
            decisions.append(decision)
            for c, k in zip(group, units, strict=False):
                chosen[c.action.id] = k
            for c in group[decision.kept :]:
                blocked.append((c.action.id, f"{resource} (evicted: waiting beats starting now)"))
        starts = tuple(
            Start(
                action_id=c.action.id,
                resource=c.resource,
                node=c.node,
                units=n,
                expected_s=c.durations.get(n, 0.0),
            )
            for c in cands
            if (n := chosen.get(c.action.id)) is not None
        )
        return Plan(
            placements=tuple(view.planned.items()),
            starts=starts,
            groups=tuple(decisions),
            blocked=tuple(blocked),
        )

    # ---- internals ---------------------------------------------------------------
    def _traj(self, tid: str) -> Trajectory:
        try:
            return self.trajectories[tid]
        except KeyError:
            raise SchedulingError("trajectory", f"{tid} is not open") from None

    def _resolve(self, action_id: str, trajectory: str, spec: ActionSpec, now: float) -> Action:
        cpu: tuple[int, ...] = ()
        gpu: tuple[int, ...] = ()
        profile = Profile(spec.t1_s, spec.efficiency) if spec.t1_s is not None else None
        quotas = dict(spec.quotas)
        for q in quotas:
            if q not in self.quotas:
                raise SchedulingError("quotas", f"unknown API quota {q!r}")
        if spec.kind is ActionKind.EXEC:
            if not self.cpu.nodes:
                raise SchedulingError("kind", "this pool has no CPU nodes for exec actions")
            cpu = allowed_units(spec.cpu) if spec.cpu is not None else (1,)
            placed = self.cpu.placement.get(trajectory)
            cap = self.cpu.nodes[placed].cores if placed is not None else self._biggest_node
            if cpu[0] > cap:
                where = (
                    f"node {placed}, where {trajectory} lives," if placed else "the largest node"
                )
                raise SchedulingError(
                    "cpu", f"minimum {cpu[0]} cores exceeds {where} ({cap} cores)"
                )
        elif spec.kind is ActionKind.SERVICE:
            assert spec.service is not None
            svc = self.services.get(spec.service)
            if svc is None:
                raise SchedulingError("service", f"unknown RewardService {spec.service!r}")
            wanted = allowed_units(spec.gpu) if spec.gpu is not None else tuple(svc.dop_choices)
            gpu = tuple(k for k in wanted if k in svc.dop_choices and self.gpu.fits(svc.name, k))
            if not gpu:
                raise SchedulingError(
                    "gpu", f"no DoP in {list(wanted)} fits service {svc.name} on this pool's GPUs"
                )
            if profile is not None and profile.efficiency is None and svc.efficiency is not None:
                profile = Profile(profile.t1_s, svc.efficiency)
        else:
            assert spec.api is not None
            if spec.api not in self.quotas:
                raise SchedulingError("api", f"unknown API quota {spec.api!r}")
            quotas[spec.api] = quotas.get(spec.api, 0) + 1
        for q, n in quotas.items():
            quota = self.quotas[q]
            limit = min(x for x in (quota.concurrency, quota.per_period, 1 << 30) if x is not None)
            if n > limit:
                raise SchedulingError("quotas", f"{n} units of {q} exceed its limit of {limit}")
        units = cpu or gpu
        elastic_capable = len(units) > 1
        self._seq += 1
        action = Action(
            id=action_id,
            trajectory=trajectory,
            kind=spec.kind,
            type=spec.action_type(),
            seq=self._seq,
            submitted_at=now,
            cpu=cpu,
            gpu=gpu,
            service=spec.service,
            quotas=tuple(sorted(quotas.items(), key=lambda kv: (kv[0] != spec.api, kv[0]))),
            profile=profile,
            elastic_capable=elastic_capable,
        )
        if (
            elastic_capable
            and self.config.learn
            and self.config.elastic
            and self.config.fixed_dop is None
            and (profile is None or profile.efficiency is None)
            and self.book.learned(action.type) is None
        ):
            action.probe = self.book.should_probe(action.type)
        return action

    def _order_key(self, a: Action, traj: Trajectory) -> tuple[float, ...]:
        if self.config.ordering == "fcfs":
            return (float(a.seq),)
        remaining = (
            float(max(0, traj.hint_steps - (traj.steps_done - traj.hint_at)))
            if traj.hint_steps is not None
            else self.lengths.expected_remaining(traj.steps_done)
        )
        per_step = traj.busy_s / traj.steps_done if traj.steps_done else self._expected(a)
        return (-(remaining * per_step + self._expected(a)), float(a.seq))

    def _deadline(self, a: Action, now: float) -> float | None:
        if self.config.ordering == "fcfs":
            return None
        return now + max(self.config.min_age_s, self.config.ageing_factor * self._expected(a))

    def _expected(self, a: Action) -> float:
        units, durations, _ = self._choices(
            a, self.cpu.placement.get(a.trajectory) if a.cpu else None
        )
        return durations[units[0]]

    def _enqueue(self, a: Action, key: tuple[float, ...], deadline: float | None) -> None:
        traj = self.trajectories[a.trajectory]
        self.actions[a.id] = a
        if a.cpu:
            traj.queued_exec += 1
        self._count(a, +1)
        self.queue.push(a.id, key, a.seq, deadline)

    def _dequeue(self, action_id: str) -> Action:
        """Take an action off the queue (cancelled, dropped or starting)."""
        self.queue.remove(action_id)
        a = self.actions.pop(action_id)
        self._count(a, -1)
        if a.cpu:
            self.trajectories[a.trajectory].queued_exec -= 1
        return a

    def _count(self, a: Action, delta: int) -> None:
        w = self._waiting
        for r in self._needs(a, self.cpu.placement.get(a.trajectory) if a.cpu else None):
            w[r] = w.get(r, 0) + delta

    def _place(self, tid: str, node: str) -> None:
        """Place a trajectory; its queued exec actions now wait on that node's cores."""
        traj = self.trajectories[tid]
        self.cpu.place(tid, node, traj.memory_gb)
        if traj.queued_exec:
            w = self._waiting
            w[PLACE] -= traj.queued_exec
            cores = Resource.cpu(node)
            w[cores] = w.get(cores, 0) + traj.queued_exec

    def _choices(
        self, a: Action, node: str | None
    ) -> tuple[tuple[int, ...], dict[int, float], Pending]:
        """Allowed key units this round, their expected durations (no restore), as Pending too.

        ``node``: the node of an exec action's trajectory, placed or planned this round.
        Cached per action until the profile book changes its mind about the action's type.
        """
        static = a.profile is not None and a.profile.efficiency is not None
        stamp = -1 if static else self.book.version(a.type)
        if a.cpu and a.trajectory not in self.cpu.placement:
            stamp = -2  # not placed yet: its node, hence its core cap, is still open
        cache = a.cache
        if cache is not None and cache[0] == stamp and stamp != -2:
            return cache[1], cache[2], cache[3]
        units, durations = self._compute_choices(a, node)
        pending = Pending(units, tuple(durations[k] for k in units))
        a.cache = (stamp, units, durations, pending)
        return units, durations, pending

    def _compute_choices(
        self, a: Action, node: str | None
    ) -> tuple[tuple[int, ...], dict[int, float]]:
        units = a.cpu or a.gpu or (1,)
        if a.cpu:
            # Never more cores than the trajectory's node has (unplaced: the largest node), so
            # fixed DoP and probe sizes stay runnable.
            cap = self.cpu.nodes[node].cores if node is not None else self._biggest_node
            units = tuple(k for k in units if k <= cap) or units[:1]
        profile = a.profile
        learned = None
        if profile is None or profile.efficiency is None:
            learned = self.book.learned(a.type) if a.elastic_capable else None
        elastic_profile = (
            profile if profile is not None and profile.efficiency is not None else learned
        )
        cfg = self.config
        if len(units) > 1:
            if cfg.fixed_dop is not None:
                fitting = [k for k in units if k <= cfg.fixed_dop]
                units = (fitting[-1] if fitting else units[0],)
            elif not cfg.elastic or elastic_profile is None:
                probe = [k for k in units if k >= 2 * units[0]]
                units = (probe[0],) if a.probe and probe else (units[0],)
        if elastic_profile is not None:
            return units, {k: elastic_profile.duration(k) for k in units}
        base = profile.t1_s if profile is not None else self.book.mean_duration(a.type)
        return units, dict.fromkeys(units, base)

    def _candidates(
        self, now: float, view: PlannedPlacements
    ) -> tuple[list[_Candidate], dict[Resource, list[Pending]], list[tuple[str, str]]]:
        prov = _Provisional(
            {n: node.free_cores for n, node in self.cpu.nodes.items()},
            self.gpu.chunk_counts(),
            {q: quota.free(now) for q, quota in self.quotas.items()},
        )
        waited_on = {r for r, n in self._waiting.items() if n > 0}
        blocked: set[Resource] = set()
        cands: list[_Candidate] = []
        rest: dict[Resource, list[Pending]] = {}
        waits: list[tuple[str, str]] = []
        horizon = self.config.horizon
        limit = self.config.max_candidates
        elastic_resources: set[Resource] = set()  # whose remaining queue the estimate needs
        order = self.queue.order(now)
        for aid in order:
            a = self.actions[aid]
            node = view.node_of(a.trajectory) if a.cpu else None
            units, durations, pending = self._choices(a, node)
            needs = self._needs(a, node)
            if blocked.isdisjoint(needs):
                fit = self._fit(a, units[0], node, prov, blocked, view=view)
                if isinstance(fit, str):
                    if a.cpu and node is None:
                        view.place(a.trajectory, fit, self.trajectories[a.trajectory].memory_gb)
                    node = fit if a.cpu else None
                    resource = (
                        Resource.cpu(node)
                        if node is not None
                        else (GPU if a.gpu else Resource.api(a.quotas[0][0]))
                    )
                    cands.append(_Candidate(a, resource, node, durations))
                    if len(durations) > 1:
                        elastic_resources.add(resource)
                    if limit is not None and len(cands) >= limit:
                        blocked |= waited_on
                    continue
                # It reserves everything it needs, not just what it is short of: an action
                # that needs two quotas must not be overtaken forever on either one.
                blocked.update(self._reserves(a, needs, fit, view))
                waits.append((aid, ",".join(sorted(str(r) for r in fit))))
            else:
                blocked.update(self._reserves(a, needs, set(), view))
            key = needs[0]
            if key in elastic_resources and (horizon is None or len(rest.get(key, ())) < horizon):
                rest.setdefault(key, []).append(pending)
            if blocked >= waited_on:
                break
        # Everything anyone waits for is blocked: no more candidates. Only the estimate's
        # view of the remaining queue on elastic resources is still needed.
        if elastic_resources:
            self._collect_rest(order, elastic_resources, rest, horizon, view)
        return cands, rest, waits

    def _collect_rest(
        self,
        order: Iterator[str],
        resources: set[Resource],
        rest: dict[Resource, list[Pending]],
        horizon: int | None,
        view: PlannedPlacements,
    ) -> None:
        open_lists = {r: rest.setdefault(r, []) for r in resources}
        actions, node_of = self.actions, view.node_of
        version = self.book.version
        for aid in order:
            a = actions[aid]
            needs = a.needs or self._needs(a, node_of(a.trajectory) if a.cpu else None)
            target = open_lists.get(needs[0])
            if target is None:
                continue
            cache = a.cache  # inlined cache hit of _choices: this loop sees the whole queue
            if cache is not None and (cache[0] == -1 or cache[0] == version(a.type)):
                target.append(cache[3])
            else:
                target.append(self._choices(a, node_of(a.trajectory) if a.cpu else None)[2])
            if horizon is not None and len(target) >= horizon:
                del open_lists[needs[0]]
                if not open_lists:
                    return

    def _needs(self, a: Action, node: str | None) -> tuple[Resource, ...]:
        """Resources an action competes on; the first is its key resource."""
        if a.needs is not None:
            return a.needs
        needs: list[Resource] = []
        if a.cpu:
            needs.append(Resource.cpu(node) if node is not None else PLACE)
        if a.gpu:
            needs.append(GPU)
        needs.extend(Resource.api(q) for q, _ in a.quotas)
        out = tuple(needs)
        if not a.cpu or a.trajectory in self.cpu.placement:  # else they change on placement
            a.needs = out
        return out

    def _reserves(
        self,
        a: Action,
        needs: tuple[Resource, ...],
        short: set[Resource],
        view: PlannedPlacements,
    ) -> set[Resource]:
        """What a waiting action reserves for the rest of the round.

        Normally everything it needs. A trajectory's first action (not yet placed) reserves
        only placement and the cores it is short of: memory is held for a trajectory's whole
        life, so if it also reserved a quota, a placed trajectory needing that quota to
        finish could never release the memory it waits for (hold-and-wait deadlock).
        """
        if a.cpu and view.node_of(a.trajectory) is None:
            return {PLACE} | {r for r in short if r.kind == "cpu"}
        return set(needs) | short

    def _fit(
        self,
        a: Action,
        k: int,
        node: str | None,
        prov: _Provisional,
        blocked: set[Resource],
        *,
        view: PlannedPlacements,
    ) -> str | set[Resource]:
        """Provisionally take minimum units: the node (or "") if it fits, else what blocks it."""
        short: set[Resource] = set()
        for q, n in a.quotas:
            if prov.quota_free[q] < n:
                short.add(Resource.api(q))
        chunks = prov.chunks
        if a.gpu:
            nxt = take_chunk(chunks, k)
            if nxt is None or (a.service is not None and not self.gpu.can_host(a.service, k)):
                short.add(GPU)
            else:
                chunks = nxt
        if a.cpu:
            if node is None:
                mem = self.trajectories[a.trajectory].memory_gb
                # A node whose cores an earlier action waits for is not offered to newcomers.
                free = {
                    n: (0 if Resource.cpu(n) in blocked else c) for n, c in prov.cpu_free.items()
                }
                node = self.cpu.choose_node(mem, k, free, view.used_gb)
                if node is None:
                    short.add(PLACE)
                    fits = self.cpu.memory_fits_somewhere(mem, view.used_gb)
                    short.update(Resource.cpu(n) for n in fits)
            elif prov.cpu_free[node] < k:
                short.add(Resource.cpu(node))
        if short:
            return short
        for q, n in a.quotas:
            prov.quota_free[q] -= n
        prov.chunks = chunks
        if a.cpu:
            assert node is not None
            prov.cpu_free[node] -= k
            return node
        return ""

    def _arrange(
        self, resource: Resource, group: list[_Candidate], rest: list[Pending], now: float
    ) -> tuple[list[int], GroupDecision]:
        ids = tuple(c.action.id for c in group)
        durations = [self._with_restore(c) for c in group]
        if all(len(d) == 1 for d in durations):
            units = [next(iter(d)) for d in durations]
            return units, GroupDecision(
                resource=resource, candidates=ids, elastic=False, kept=len(group), steps=()
            )
        running = [
            (max(0.0, r.expected_end - now), _size(r.assignment))
            for r in self.running.values()
            if r.resource == resource
        ]
        doubling = self.config.explore == "doubling"
        if resource == GPU:
            arrangement = greedy_evict(
                durations,
                rest,
                running,
                self.config.depth,
                chunks=self.gpu.chunk_counts(),
                doubling=doubling,
            )
        else:
            capacity = self.cpu.nodes[resource.name].free_cores
            arrangement = greedy_evict(
                durations,
                rest,
                running,
                self.config.depth,
                capacity=capacity,
                doubling=doubling,
            )
        return list(arrangement.units), GroupDecision(
            resource=resource,
            candidates=ids,
            elastic=True,
            kept=arrangement.kept,
            steps=arrangement.steps,
        )

    def _with_restore(self, c: _Candidate) -> Mapping[int, float]:
        a = c.action
        if not a.gpu or a.service is None:
            return c.durations
        svc = self.services[a.service]
        return {
            k: d + (0.0 if self.gpu.is_warm(a.service, k) else svc.restore_cost(chunk_level(k)))
            for k, d in c.durations.items()
        }

    def _start(
        self, a: Action, s: Start, now: float, exact: Sequence[int] | None = None
    ) -> Assignment | None:
        """Allocate and start; None (the action stays queued) if its GPU chunk went to an
        earlier candidate of this round (chunk counts cannot see per-node GPU memory)."""
        k = s.units
        grant = None
        if a.gpu:
            assert a.service is not None
            try:
                grant = self.gpu.allocate(a.service, k)
            except ValueError:
                return None
        self._dequeue(a.id)
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
        if grant is not None:
            assert a.service is not None
            chunk, restore = grant.chunk, not grant.resident
            evicted = tuple(
                f"{i.service}@{i.chunk.node}:{i.chunk.start}+{i.chunk.size}" for i in grant.evicted
            )
            if restore:
                expected += self.services[a.service].restore_cost(chunk.size)
        for q, n in a.quotas:
            self.quotas[q].acquire(now, n)
        asg = Assignment(
            action_id=a.id,
            trajectory=a.trajectory,
            node=s.node or (chunk.node if chunk else None),
            cores=cores,
            chunk=chunk,
            restore=restore,
            evicted=evicted,
            quotas=a.quotas,
            units=k,
            expected_s=expected,
            started_at=now,
            queued_s=now - a.submitted_at,
        )
        self.running[a.id] = _Running(asg, a, now + expected, s.resource)
        return asg


def _size(asg: Assignment) -> int:
    if asg.chunk is not None:
        return asg.chunk.size
    return len(asg.cores) or asg.units
