"""Where simulated actions run: ARL-Tangram's scheduler, or one of the paper's baselines (§6.1).

Modelling assumptions are listed in docs/simulator.md; each class states its own.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from statistics import NormalDist

import numpy as np

from tangram.api.action import ActionKind, ActionSpec
from tangram.api.cluster import ClusterSpec, NodeSpec, ServiceSpec
from tangram.api.demand import AmdahlEfficiency, Efficiency, allowed_units, duration
from tangram.api.trace import TrajectoryTrace
from tangram.scheduler.core.admission import quota_units
from tangram.scheduler.core.decisions import Ahead
from tangram.scheduler.core.gpu_pool import Chunk, gb_per_gpu, holds
from tangram.scheduler.core.quota_pool import Quota
from tangram.scheduler.core.scheduler import Round, Scheduler, SchedulerConfig
from tangram.sim.engine import Done
from tangram.sim.events import EventLoop
from tangram.sim.records import ActionRecord
from tangram.sim.validate import why_no_node_holds


@dataclass(frozen=True, slots=True)
class Overheads:
    """System overhead per action, added inside the action's run (seconds)."""

    exec_s: float = 0.044  # Docker update + exec round trip per action (issue #3's figure)
    service_s: float = 0.0
    api_s: float = 0.0
    profile_noise: float = 0.2  # lognormal sigma of profiled t1 vs the truth


_NORMAL = NormalDist()


def keyed_normal(seed: int, *key: str | int) -> float:
    """A standard normal draw fixed by ``seed`` and ``key`` alone (a hash, inverted
    through the normal CDF): independent of the order of the draws and of any other, so
    every policy replaying a trace at one seed draws the same for the same key."""
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return _NORMAL.inv_cdf((int.from_bytes(digest, "big") + 0.5) / 2.0**64)


def profile_factor(seed: int, sigma: float, trajectory: str, step: int) -> float:
    """The profiling noise of a trajectory's step: lognormal(0, ``sigma``), by its key."""
    return math.exp(sigma * keyed_normal(seed, "profile", trajectory, step))


def true_duration(spec: ActionSpec, units: int) -> float:
    """What the action really takes with ``units`` key units (the trace's ground truth)."""
    t1 = spec.t1_s if spec.t1_s is not None else 1.0
    return duration(t1, spec.efficiency, units)


def speedup(eff: Efficiency | None, cores: float) -> float:
    """Progress rate with a fractional share of cores (CFS time slicing below one core)."""
    if cores <= 1.0 or eff is None:
        return min(cores, 1.0)
    if isinstance(eff, AmdahlEfficiency):
        p = eff.amdahl
        return 1.0 / ((1.0 - p) + p / cores)
    lo = math.floor(cores)
    hi = lo + 1
    s_lo = eff.efficiency(lo) * lo
    s_hi = eff.efficiency(hi) * hi
    return s_lo + (s_hi - s_lo) * (cores - lo)


# --------------------------------------------------------------------------- ARL-Tangram
class SchedulerBackend:
    """Actions go through the real ``tangram.scheduler`` core; execution is simulated.

    What the scheduler is told mirrors the paper's setup (§6.1): profiles (t1 and
    efficiency) only for actions that carry an efficiency curve, perturbed by
    profiling noise; every other duration it learns online from completions. The noise
    of an action is a function of the seed, its trajectory and its step
    (``profile_factor``), so every policy sees the same profiles at one seed.
    """

    def __init__(
        self,
        loop: EventLoop,
        cluster: ClusterSpec,
        config: SchedulerConfig,
        overheads: Overheads,
        seed: int,
        *,
        steps_hint: tuple[float, np.random.Generator] | None = None,
    ) -> None:
        self.loop = loop
        self.sched = Scheduler(cluster, config)
        # (sigma, rng): each trajectory's client sends its remaining actions at open, as
        # the true count times lognormal(0, sigma); None: no client sends a hint.
        self.steps_hint = steps_hint
        self.overheads = overheads
        self.seed = seed
        self.services = {s.name: s for s in cluster.services}
        self._pending: dict[str, tuple[ActionRecord, ActionSpec, Done]] = {}
        self._dirty = False
        self._wake: set[float] = set()
        self.unit_seconds: dict[str, float] = {}
        # (node, GPU) -> the period it is held in, still open to extension: chunks of
        # different sizes may overlap on a GPU (a restore ahead, a call beside it).
        self._held: dict[tuple[str, int], tuple[float, float]] = {}
        self._ready: dict[Chunk, float] = {}  # chunk -> when its last restore ends
        self.rounds = 0
        self.restores_ahead = 0
        loop.on_instant_end(self._round)

    def open(self, traj: TrajectoryTrace, now: float, ready: Callable[[], None]) -> None:
        hint = None
        if self.steps_hint is not None:
            sigma, rng = self.steps_hint
            hint = max(1, round(len(traj.steps) * float(rng.lognormal(0.0, sigma))))
        self.sched.open_trajectory(traj.id, traj.memory_gb, hint)
        ready()

    def close(self, traj: TrajectoryTrace, now: float) -> None:
        self.sched.close_trajectory(traj.id)

    def submit(self, record: ActionRecord, spec: ActionSpec, done: Done) -> None:
        aid = f"{record.trajectory}#{record.step}"
        self._pending[aid] = (record, spec, done)
        self.sched.submit(aid, record.trajectory, self._visible(spec, record), record.submitted)
        self._dirty = True

    def _visible(self, spec: ActionSpec, record: ActionRecord) -> ActionSpec:
        """What the scheduler is told of ``spec``, the step ``record`` of its trajectory."""
        if spec.efficiency is None and spec.kind is not ActionKind.SERVICE:
            return spec.model_copy(update={"t1_s": None})
        sigma = self.overheads.profile_noise
        if spec.t1_s is None or sigma <= 0:
            return spec
        noise = profile_factor(self.seed, sigma, record.trajectory, record.step)
        return spec.model_copy(update={"t1_s": spec.t1_s * noise})

    def _round(self, now: float) -> None:
        if not self._dirty and now not in self._wake:
            return
        self._dirty = False
        self._wake.discard(now)
        again = True
        while again:  # another round at once when calls may join an instance it opened
            self.rounds += 1
            result = self.sched.schedule(now)
            again = result.again
            self._start(result, now)

    def _start(self, result: Round, now: float) -> None:
        for asg in result.assignments:
            record, spec, done = self._pending.pop(asg.action_id)
            overhead = {
                ActionKind.EXEC: self.overheads.exec_s,
                ActionKind.SERVICE: self.overheads.service_s,
                ActionKind.API: self.overheads.api_s,
            }[spec.kind]
            if asg.restore and spec.service is not None and asg.chunk is not None:
                overhead += self.services[spec.service].restore_cost(asg.chunk.size)
            took = true_duration(spec, asg.units)
            if asg.sharing and spec.service is not None and asg.chunk is not None:
                # It joined a running instance: slowed by the calls on it, and after the
                # instance's restore if that is still under way.
                took *= self.services[spec.service].slowdown(asg.sharing)
                took += max(0.0, self._ready.get(asg.chunk, now) - now)
            elif asg.chunk is not None and (asg.restore or asg.ready_in_s):
                # It restores the instance, or waits for the rest of its restore ahead.
                overhead += asg.ready_in_s
                self._ready[asg.chunk] = now + overhead
            took += overhead
            record.started, record.units, record.overhead_s = now, asg.units, overhead
            kind = spec.kind.value
            if asg.chunk is not None:
                # A chunk's GPUs are held from its first call's start to its last call's
                # end, whoever joined it meanwhile: GPU-seconds count GPUs, not calls.
                self._hold_chunk(asg.chunk, now, now + took)
            else:
                self.unit_seconds[kind] = self.unit_seconds.get(kind, 0.0) + asg.units * took
            self.loop.at(now + took, partial(self._end, asg.action_id, record, done))
        for ahead in result.ahead:
            # The restore holds the chunk's GPUs (their host links) for GPU-seconds, not
            # for calls: others may run there meanwhile.
            self._hold_chunk(ahead.chunk, now, ahead.ready_at)
            self.loop.at(ahead.ready_at, partial(self._ahead_done, ahead))
        if result.wake_at is not None and result.wake_at not in self._wake:
            self._wake.add(result.wake_at)
            self.loop.at(result.wake_at, lambda: None)

    def _hold_chunk(self, chunk: Chunk, start: float, end: float) -> None:
        """Count each GPU of ``chunk`` as held over [start, end]: the union over whatever
        holds it, so a GPU-second is counted once. ``start`` never decreases (it is now),
        so a period that ``start`` is past is closed for good and counted."""
        for gpu in chunk.gpus:
            key = (chunk.node, gpu)
            held = self._held.get(key)
            if held is not None and held[1] >= start:
                self._held[key] = (held[0], max(held[1], end))
                continue
            if held is not None:
                self._count(*held)
            self._held[key] = (start, end)

    def _count(self, start: float, end: float) -> None:
        self.unit_seconds["service"] = self.unit_seconds.get("service", 0.0) + (end - start)

    def _ahead_done(self, ahead: Ahead) -> None:
        self.sched.ahead_done(ahead.service, ahead.chunk)
        self.restores_ahead += 1
        self._dirty = True

    def _end(self, aid: str, record: ActionRecord, done: Done) -> None:
        now = self.loop.now
        self.sched.complete(aid, now)
        record.ended = now
        self._dirty = True
        done(record)

    def finish(self, now: float) -> tuple[dict[str, float], list[str]]:
        for held in self._held.values():
            self._count(*held)
        self._held.clear()
        return self.unit_seconds, [
            f"scheduler rounds: {self.rounds}",
            f"instances restored ahead: {self.restores_ahead}",
        ]


# --------------------------------------------------------------------------- k8s-static
@dataclass(slots=True)
class _Job:
    record: ActionRecord
    spec: ActionSpec
    done: Done
    work: float  # single-core seconds left
    want: float  # cores it can use (DoP, capped by the pod limit)
    rate: float = 0.0


@dataclass(slots=True)
class _PodNode:
    name: str
    cores: float
    memory_gb: float
    requested: float = 0.0
    memory_used: float = 0.0
    jobs: dict[int, _Job] = field(default_factory=dict)
    last: float = 0.0
    version: int = 0


class K8sStaticBackend:
    """A pod per trajectory for its whole life (seed 000 §6.1 coding baseline).

    * Pods request ``request`` cores and the trajectory's memory; the kube-scheduler
      places a pod on the node with the most unrequested CPU where requests fit, or
      leaves it Pending (FIFO) until a pod ends. A placed pod becomes ready after a
      lognormal start latency (median ``pod_start_s``), a function of the seed and its
      trajectory, whatever order pods start in.
    * Each exec action runs in its pod with up to ``dop`` processes, capped by the
      pod's CPU ``limit``. Running actions on a node share its cores like CFS with
      equal shares: max-min fair water-filling of their demands; an action's progress
      rate is its speed-up at that (fractional) share.
    * Unit-seconds are the requested cores times each pod's lifetime.
    * ``binds``: the control plane binds placed pods no faster than a token bucket of
      ``(per_s, burst)`` allows, in order (the kube-scheduler's client rate limit;
      ``K8S_SCHEDULER_BINDS``); a pod starts once bound. None: bound at once.
    """

    def __init__(
        self,
        loop: EventLoop,
        cluster: ClusterSpec,
        overheads: Overheads,
        seed: int,
        *,
        request: float = 0.5,
        limit: float = 4.0,
        dop: int = 1,
        pod_start_s: float = 5.0,
        pod_start_sigma: float = 0.5,
        binds: tuple[float, int] | None = None,
    ) -> None:
        self.loop = loop
        self.overheads = overheads
        self.seed = seed
        self.request, self.limit, self.dop = request, limit, dop
        self.pod_start_s, self.pod_start_sigma = pod_start_s, pod_start_sigma
        self.nodes = [_PodNode(n.name, float(n.cpus), n.memory_gb) for n in cluster.nodes if n.cpus]
        self.pods: dict[str, tuple[_PodNode, float]] = {}  # trajectory -> (node, admitted at)
        self.pending: deque[tuple[TrajectoryTrace, Callable[[], None]]] = deque()
        self.unit_seconds: dict[str, float] = {}
        self.max_pending = 0
        self._jid = 0
        self._binds = TokenBucket(*binds) if binds is not None else None

    def open(self, traj: TrajectoryTrace, now: float, ready: Callable[[], None]) -> None:
        self.pending.append((traj, ready))
        self.max_pending = max(self.max_pending, len(self.pending))
        self._admit(now)

    def _admit(self, now: float) -> None:
        while self.pending:
            traj, ready = self.pending[0]
            fitting = [
                n
                for n in self.nodes
                if n.requested + self.request <= n.cores + 1e-9
                and n.memory_used + traj.memory_gb <= n.memory_gb + 1e-9
            ]
            if not fitting:
                return  # FIFO: the head pod blocks the rest, as the default queue sort does
            self.pending.popleft()
            node = max(fitting, key=lambda n: (n.cores - n.requested, n.name))
            node.requested += self.request
            node.memory_used += traj.memory_gb
            self.pods[traj.id] = (node, now)
            bound = self._binds.take(now) if self._binds is not None else now
            z = keyed_normal(self.seed, "pod", traj.id)
            start = self.pod_start_s * math.exp(self.pod_start_sigma * z)
            self.loop.at(bound + start, ready)

    def close(self, traj: TrajectoryTrace, now: float) -> None:
        node, since = self.pods.pop(traj.id)
        node.requested -= self.request
        node.memory_used -= traj.memory_gb
        held = self.request * (now - since)
        self.unit_seconds["exec"] = self.unit_seconds.get("exec", 0.0) + held
        self._admit(now)

    def submit(self, record: ActionRecord, spec: ActionSpec, done: Done) -> None:
        node, _ = self.pods[record.trajectory]
        units = allowed_units(spec.cpu) if spec.cpu is not None else (1,)
        fitting = [k for k in units if k <= self.dop]
        want = min(float(fitting[-1] if fitting else units[0]), self.limit)
        self._jid += 1
        job = _Job(record, spec, done, spec.t1_s if spec.t1_s is not None else 1.0, want)
        record.overhead_s = self.overheads.exec_s
        jid = self._jid

        def start() -> None:
            record.started = self.loop.now - self.overheads.exec_s
            record.units = want
            self._update(node)
            node.jobs[jid] = job
            self._reschedule(node)

        self.loop.at(self.loop.now + self.overheads.exec_s, start)

    def _update(self, node: _PodNode) -> None:
        """Advance every job on ``node`` to now at its current rate."""
        now = self.loop.now
        dt = now - node.last
        if dt > 0:
            for job in node.jobs.values():
                job.work = max(0.0, job.work - job.rate * dt)
        node.last = now

    def _reschedule(self, node: _PodNode) -> None:
        jobs = list(node.jobs.values())
        shares = _water_fill([j.want for j in jobs], node.cores)
        for job, share in zip(jobs, shares, strict=True):
            job.rate = speedup(job.spec.efficiency, share)
        node.version += 1
        if not jobs:
            return
        version = node.version
        soonest = min(job.work / job.rate if job.rate > 0 else math.inf for job in jobs)
        self.loop.at(self.loop.now + soonest, lambda: self._tick(node, version))

    def _tick(self, node: _PodNode, version: int) -> None:
        if version != node.version:
            return
        self._update(node)
        finished = [jid for jid, j in node.jobs.items() if j.work <= 1e-9]
        for jid in finished:
            job = node.jobs.pop(jid)
            job.record.ended = self.loop.now
            job.done(job.record)
        self._reschedule(node)

    def finish(self, now: float) -> tuple[dict[str, float], list[str]]:
        return self.unit_seconds, [f"k8s-static: most pods pending at once: {self.max_pending}"]


# The kube-scheduler's binding rate with its default client settings (v1.34
# KubeSchedulerConfiguration clientConnection: qps 50, burst 100): one API request a
# binding. e2e/bench_control_plane.py measures it on a real kube-scheduler
# (docs/benchmarks.md, "A control plane that binds at its rate").
K8S_SCHEDULER_BINDS = (50.0, 100)


class TokenBucket:
    """client-go's token-bucket rate limiter over simulated time: ``burst`` tokens at
    first, refilled at ``per_s``; each request takes one, in the order asked."""

    def __init__(self, per_s: float, burst: int) -> None:
        if per_s <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs per_s > 0 and burst >= 1, got {per_s}, {burst}")
        self.per_s, self.burst = per_s, burst
        self._at, self._tokens = 0.0, float(burst)  # tokens held at time _at

    def take(self, now: float) -> float:
        """When a request asked at ``now`` goes (not before an earlier one)."""
        at = max(now, self._at)
        tokens = min(float(self.burst), self._tokens + (at - self._at) * self.per_s)
        if tokens < 1.0:
            at += (1.0 - tokens) / self.per_s
            tokens = 1.0
        self._at, self._tokens = at, tokens - 1.0
        return at


def _water_fill(wants: list[float], capacity: float) -> list[float]:
    """Max-min fair shares of ``capacity`` for the given demands."""
    shares = [0.0] * len(wants)
    order = sorted(range(len(wants)), key=lambda i: wants[i])
    left, n = capacity, len(wants)
    for pos, i in enumerate(order):
        fair = left / (n - pos)
        shares[i] = min(wants[i], fair)
        left -= shares[i]
    return shares


# --------------------------------------------------------------------------- static-gpu
class _NoTrajectoryState:
    """For baselines that keep nothing per trajectory: admitted at once, nothing to close."""

    def open(self, traj: TrajectoryTrace, now: float, ready: Callable[[], None]) -> None:
        ready()

    def close(self, traj: TrajectoryTrace, now: float) -> None:
        return None


@dataclass(slots=True)
class _Instance:
    service: str
    dop: int
    node: str
    in_flight: int = 0


class StaticGpuBackend(_NoTrajectoryState):
    """Each reward service on dedicated GPUs, always resident (seed 000 §6.1 MOPD baseline).

    The cluster's GPUs are split evenly among the services; each service gets
    instances of the largest allowed DoP that fits its share and one node, GPUs and
    memory (9 services on 40 GPUs: one TP-4 instance each; 1 service: five TP-8
    replicas), unless ``dop`` is given. Each instance lies on one node; a replica that
    no node has room for is left out, a service that gets none is an error.
    An instance batches like an inference server (SGLang in the paper): up to the
    service's ``max_calls`` calls in flight (``max_batch`` overrides it), each slowed by
    ``ServiceSpec.slowdown(n)`` where n is the number already in flight when it is admitted
    (fixed at admission: a simplification of continuous batching). Further calls queue
    FIFO per service. Pooled instances batch by the same rule (``GpuPool.joinable``).
    """

    def __init__(
        self,
        loop: EventLoop,
        cluster: ClusterSpec,
        overheads: Overheads,
        dop: int | None = None,
        *,
        max_batch: int | None = None,
    ) -> None:
        self.loop = loop
        self.overheads = overheads
        self.specs = {s.name: s for s in cluster.services}
        self.max_batch = {s.name: max_batch or s.max_calls for s in cluster.services}
        nodes = [n for n in cluster.nodes if n.gpus]
        services = cluster.services
        if not services:
            raise ValueError("static-gpu: the cluster defines no services")
        share = sum(n.gpus for n in nodes) // len(services)
        plans = [(svc, _static_dop(svc, nodes, dop or share, share)) for svc in services]
        # Each service's first instance, then the replicas, the largest first on each
        # pass, on the node that fits it most tightly (exact for powers of two).
        passes = [[(svc, k) for svc, k in plans], []]
        for svc, k in plans:
            passes[1] += [(svc, k)] * (max(1, share // k) - 1)
        free = {n.name: n.gpus for n in nodes}
        self.instances: dict[str, list[_Instance]] = {s.name: [] for s in services}
        self.queues: dict[str, deque[tuple[ActionRecord, ActionSpec, Done]]] = {
            s.name: deque() for s in services
        }
        self.gpus = 0
        for first, batch in enumerate(passes):
            for svc, k in sorted(batch, key=lambda p: -p[1]):
                room = [n for n in nodes if free[n.name] >= k and _fits(svc, k, n)]
                if not room:
                    if first == 0:
                        raise ValueError(
                            f"static-gpu: service {svc.name}: no node has {k} GPUs left for "
                            f"its DoP-{k} instance (the nodes' gpus are split among "
                            f"{len(services)} services)"
                        )
                    continue
                node = min(room, key=lambda n: (free[n.name], n.name))
                free[node.name] -= k
                self.instances[svc.name].append(_Instance(svc.name, k, node.name))
                self.gpus += k

    def submit(self, record: ActionRecord, spec: ActionSpec, done: Done) -> None:
        assert spec.service is not None
        k = self.instances[spec.service][0].dop
        if spec.gpu is not None and k not in allowed_units(spec.gpu):
            raise ValueError(
                f"trajectory {record.trajectory}, step {record.step}: gpu: "
                f"{list(allowed_units(spec.gpu))} excludes DoP {k}, that of service "
                f"{spec.service}'s static instances"
            )
        self.queues[spec.service].append((record, spec, done))
        self._dispatch(spec.service)

    def _dispatch(self, service: str) -> None:
        queue = self.queues[service]
        while queue:
            inst = min(self.instances[service], key=lambda i: i.in_flight)
            if inst.in_flight >= self.max_batch[service]:
                return
            record, spec, done = queue.popleft()
            slowdown = self.specs[service].slowdown(inst.in_flight)
            inst.in_flight += 1
            now = self.loop.now
            took = self.overheads.service_s + true_duration(spec, inst.dop) * slowdown
            record.started, record.units, record.overhead_s = (
                now,
                inst.dop,
                self.overheads.service_s,
            )

            def end(
                inst: _Instance = inst, record: ActionRecord = record, done: Done = done
            ) -> None:
                inst.in_flight -= 1
                record.ended = self.loop.now
                done(record)
                self._dispatch(inst.service)

            self.loop.at(now + took, end)

    def finish(self, now: float) -> tuple[dict[str, float], list[str]]:
        return {"service": self.gpus * now}, [
            f"static-gpu: {self.gpus} GPUs dedicated for the whole run"
        ]


def _fits(svc: ServiceSpec, k: int, node: NodeSpec) -> bool:
    """Whether a DoP-``k`` instance of ``svc`` fits ``node``'s GPUs and their memory."""
    per_gpu = gb_per_gpu(svc.gpu_memory_gb, svc.replicated, k)
    return holds(node.gpus, node.gpu_memory_gb, k, per_gpu)


def _static_dop(svc: ServiceSpec, nodes: list[NodeSpec], cap: int, share: int) -> int:
    """The largest of ``svc``'s DoP choices up to ``cap`` that one node can hold."""
    choices = [k for k in svc.dop_choices if k <= cap]
    if not choices:
        raise ValueError(
            f"static-gpu: service {svc.name} gets {share} GPUs, below its dop_choices "
            f"{svc.dop_choices}"
        )
    for k in reversed(choices):
        if any(_fits(svc, k, n) for n in nodes):
            return k
    why = [why_no_node_holds(svc, k, nodes) for k in choices]
    raise ValueError(f"static-gpu: service {svc.name}: no DoP fits one node: {'; '.join(why)}")


# --------------------------------------------------------------------------- unmanaged API
@dataclass(slots=True)
class _Provider:
    """The provider's own limits: the same window arithmetic as the scheduler's quota."""

    limits: Quota
    timeout_s: float
    waiting: deque[Callable[[], None]] = field(default_factory=deque)

    def rate_ok(self, now: float, n: int) -> bool:
        return self.limits.window_room(now) >= n

    def full(self, n: int) -> bool:
        q = self.limits
        return q.concurrency is not None and q.in_use + n > q.concurrency


class UnmanagedApiBackend(_NoTrajectoryState):
    """Every trajectory calls the APIs itself (seed 000 §6.1 DeepSearch baseline).

    The provider enforces its limits: a call over the rate quota fails with a
    rate-limit error after ``reject_s``; a call over the concurrency cap waits in
    the provider's queue and fails if it is not served within ``timeout_s`` (600 s
    in the paper). The client retries up to ``retries`` times after a backoff of
    1, 2, 4 s; then the action fails (it still ends, and its ACT counts).
    """

    def __init__(
        self,
        loop: EventLoop,
        cluster: ClusterSpec,
        overheads: Overheads,
        *,
        retries: int = 3,
        reject_s: float = 0.2,
    ) -> None:
        self.loop = loop
        self.overheads = overheads
        self.retries, self.reject_s = retries, reject_s
        self.providers = {a.name: _Provider(Quota.of(a), a.timeout_s) for a in cluster.apis}
        self.unit_seconds: dict[str, float] = {}
        self.errors = 0

    def submit(self, record: ActionRecord, spec: ActionSpec, done: Done) -> None:
        record.started = self.loop.now
        self._attempt(record, spec, done, 0)

    def _attempt(
        self,
        record: ActionRecord,
        spec: ActionSpec,
        done: Done,
        attempt: int,
        queued: tuple[_Provider, float] | None = None,
    ) -> None:
        now = self.loop.now
        record.attempts = attempt + 1
        # The units the scheduler's quotas would hold for it, per provider.
        held = [(self.providers[q], n) for q, n in quota_units(spec).items()]
        if not all(p.rate_ok(now, n) for p, n in held):
            self.loop.at(now + self.reject_s, lambda: self._failed(record, spec, done, attempt))
            return
        full = [p for p, n in held if p.full(n)]
        if full:
            provider = full[0]
            state = {"served": False}
            # Woken by this provider without room for all its units, it waits again until
            # the same deadline (another provider's queue has its own).
            deadline = now + provider.timeout_s
            if queued is not None and queued[0] is provider:
                deadline = queued[1]

            def serve() -> None:
                state["served"] = True
                self._attempt(record, spec, done, attempt, (provider, deadline))

            def timeout() -> None:
                if not state["served"]:
                    provider.waiting.remove(serve)
                    self._failed(record, spec, done, attempt)

            provider.waiting.append(serve)
            self.loop.at(deadline, timeout)
            return
        for p, n in held:
            p.limits.acquire(now, n)
        took = self.overheads.api_s + true_duration(spec, 1)
        self.unit_seconds["api"] = self.unit_seconds.get("api", 0.0) + took

        def end() -> None:
            for p, n in held:
                p.limits.release(n)
                for _ in range(n):  # n units free: up to n waiters may fit now
                    if p.waiting:
                        p.waiting.popleft()()
            record.ended = self.loop.now
            record.units = 1
            done(record)

        self.loop.at(now + took, end)

    def _failed(self, record: ActionRecord, spec: ActionSpec, done: Done, attempt: int) -> None:
        self.errors += 1
        if attempt >= self.retries:
            record.ok = False
            record.ended = self.loop.now
            done(record)
            return
        backoff = float(2**attempt)
        self.loop.at(
            self.loop.now + backoff, lambda: self._attempt(record, spec, done, attempt + 1)
        )

    def finish(self, now: float) -> tuple[dict[str, float], list[str]]:
        return self.unit_seconds, [
            f"unmanaged: {self.errors} failed attempts (rate limit or timeout)"
        ]
