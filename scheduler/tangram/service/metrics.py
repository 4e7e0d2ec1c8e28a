"""Prometheus metrics of one scheduler (its own registry, so engines never share series).

Histograms are observed as actions end; gauges (queue depth, units in use and capacity
per resource and node, quota use, agent health) come from a snapshot of the engine's
figures taken at scrape time (:class:`LiveFigures`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tangram.api.wire import ActionResult, ServiceStats
from tangram.scheduler.core.pricing import NodePrice

# From 100 µs (the fast path's share) to two hours: past the example pool's
# maxCommandSeconds (3600), so that the longest commands a pool allows fall in a bucket
# of their own rather than in +Inf with everything over 20 minutes.
_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1200,
    1800,
    3600,
    7200,
)

# Why admission control refused (``PoolState.overloaded``'s field): the queue (the pool's
# maxQueued or a tenant's), a tenant's maxTrajectories, no node with the memory for an
# environment, a tenant's maxStreams. The label of tangram_admission_rejected_total takes
# these values only, each exported from the start (0: none yet).
REJECTED_REASONS = ("queue", "trajectory", "env", "stream")

# The unit of each resource's units (tangram_units_capacity, tangram_units_in_use); an
# API quota's are its concurrency: calls and leases at once.
UNITS_HELP = "cpu: cores; memory_gb: GiB; gpu: GPUs; api:<quota>: calls or leases at once"


_PHASES = ("act", "queued", "overhead", "exec")


class Metrics:
    """The sink the engine reports ended actions to, and the gauges it is scraped for
    (``snapshot``, called at scrape time)."""

    def __init__(self, pool: str, snapshot: Callable[[], LiveFigures]) -> None:
        self.registry = CollectorRegistry()
        labels = ("pool", "kind")
        self.actions = Counter(
            "tangram_actions",
            "Actions ended, by status",
            (*labels, "status"),
            registry=self.registry,
        )
        self.phases = {
            phase: Histogram(
                f"tangram_action_{phase}_seconds",
                doc,
                labels,
                buckets=_BUCKETS,
                registry=self.registry,
            )
            for phase, doc in (
                ("act", "Action completion time: queued + overhead + restore + exec"),
                ("queued", "Time from submission to allocation"),
                ("overhead", "System overhead: dispatch, cgroup writes, start, reclaim"),
                ("restore", "Service calls: evicting and restoring models on their GPUs"),
                ("exec", "The command's own run time"),
            )
        }
        self.service_calls = Counter(
            "tangram_service_calls",
            "RewardService calls answered with outputs, by whether the model was already on "
            'its GPUs (every call ended: tangram_actions_total{kind="service"})',
            ("pool", "service", "resident"),
            registry=self.registry,
        )
        self.joined_calls = Counter(
            "tangram_service_calls_joined",
            "RewardService calls started on an instance already running calls (batched)",
            ("pool", "service"),
            registry=self.registry,
        )
        self.restored_bytes = Counter(
            "tangram_service_restored_bytes",
            "Bytes of models restored into GPU memory",
            ("pool", "service"),
            registry=self.registry,
        )
        self.restores_ahead = Counter(
            "tangram_service_restores_ahead",
            "Model instances restored ahead of their calls into free GPU memory, by result "
            "(restored, resident: it was already, failed)",
            ("pool", "service", "result"),
            registry=self.registry,
        )
        self.evictions = Counter(
            "tangram_service_evictions",
            "Model instances evicted from GPU memory for another call",
            ("pool", "service"),
            registry=self.registry,
        )
        self.service_phases = {
            phase: Histogram(
                f"tangram_service_{phase}_seconds",
                doc,
                ("pool", "service"),
                buckets=_BUCKETS,
                registry=self.registry,
            )
            for phase, doc in (
                ("restore", "Service calls that restored: copying the model into GPU memory"),
                ("evict", "Service calls that evicted: freeing GPU memory for their model"),
            )
        }
        self.rejected = Counter(
            "tangram_admission_rejected",
            "Requests shed by admission control (429), by what was full (reason: queue, "
            "trajectory: a tenant's maxTrajectories, env: no node with the memory, stream: "
            "a tenant's maxStreams)",
            ("pool", "reason"),
            registry=self.registry,
        )
        for reason in REJECTED_REASONS:
            self.rejected.labels(pool, reason)
        self.opened = Counter(
            "tangram_trajectories_opened",
            "Trajectories opened (their environment made) since this scheduler started",
            ("pool",),
            registry=self.registry,
        )
        self.closed = Counter(
            "tangram_trajectories_closed",
            "Trajectories closed, by their owner or their env's idleTimeoutSeconds, since this "
            "scheduler started (one it took back after a restart counts when it closes: this "
            "may exceed the opened count)",
            ("pool",),
            registry=self.registry,
        )
        self.opened.labels(pool)
        self.closed.labels(pool)
        self.pool = pool
        self.registry.register(_Live(lambda: self.pool, snapshot))
        self._children: dict[tuple[str, str], tuple[Any, ...]] = {}
        # service -> the labelled series it has, so that a removed one's can go
        self._series: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}

    def _of(self, metric: Any, service: str, *labels: str) -> Any:
        """``metric``'s child of ``service`` (and ``labels``), remembered as its series."""
        values = (self.pool, service, *labels)
        self._series.setdefault(service, set()).add((metric, values))
        return metric.labels(*values)

    def joined(self, service: str) -> None:
        """A call joined an instance running calls (batching)."""
        self._of(self.joined_calls, service).inc()

    def forget_services(self, keep: Container[str]) -> None:
        """The series of every service not in ``keep`` go (removed from the pool, its last
        call ended): they would be exported for ever, though no call of it can come."""
        for service in [s for s in self._series if s not in keep]:
            for metric, values in self._series.pop(service):
                with contextlib.suppress(KeyError):
                    metric.remove(*values)

    def ended(self, result: ActionResult) -> None:
        key = (result.kind, result.status.value)
        children = self._children.get(key)
        if children is None:  # label lookups cost more than the observations: cache them
            children = (
                self.actions.labels(self.pool, *key),
                *(self.phases[p].labels(self.pool, result.kind) for p in _PHASES),
            )
            self._children[key] = children
        children[0].inc()
        if result.status.value in ("ok", "timeout"):
            t = result.timings
            for child, value in zip(
                children[1:], (t.act_s, t.queued_s, t.overhead_s, t.exec_s), strict=True
            ):
                child.observe(value)
        stats = result.service
        if stats is not None:  # service calls only: off the exec hot path
            self.phases["restore"].labels(self.pool, result.kind).observe(result.timings.restore_s)
            self._of(self.service_calls, stats.service, str(stats.resident).lower()).inc()
            self._residency(stats)

    def restored_ahead(self, service: str, stats: ServiceStats | None) -> None:
        """A restore ahead ended: ``stats`` from its worker, or None if it failed."""
        result = "failed" if stats is None else "resident" if stats.resident else "restored"
        self._of(self.restores_ahead, service, result).inc()
        if stats is not None:
            self._residency(stats)

    def _residency(self, stats: ServiceStats) -> None:
        """What making a model resident cost, for a call or a restore ahead."""
        svc = stats.service
        self._of(self.restored_bytes, svc).inc(stats.restored_bytes)
        if stats.evicted:
            self._of(self.evictions, svc).inc(len(stats.evicted))
            self._of(self.service_phases["evict"], svc).observe(stats.evict_s)
        if not stats.resident:
            self._of(self.service_phases["restore"], svc).observe(stats.restore_s)

    def scrape(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class Units:
    resource: str  # "cpu", "memory_gb", "gpu", "api:<quota>"
    node: str  # "" for a quota
    capacity: float | None  # None: unbounded (a quota with a rate but no concurrency)
    in_use: float


@dataclass(frozen=True, slots=True)
class LiveFigures:
    """What the gauges show, as the engine sees it at scrape time."""

    queue_depth: int
    units: Sequence[Units]
    agents_seen_s: Mapping[str, float]  # node -> seconds since its agent was last heard
    trajectories: Mapping[str, int]  # state -> how many
    resident: Mapping[tuple[str, str], int]  # (service, node) -> instances in GPU memory
    gpu_memory_gb: Mapping[tuple[str, int], float]  # (node, device index) -> GB resident
    core_prices: Mapping[str, NodePrice]  # node -> its core price now, with its terms
    think_s: float  # the learned mean think time (0: none yet)
    thinking: Mapping[str, int]  # CPU node -> its placed trajectories with nothing in flight


class _Live(Collector):
    """Gauges from a snapshot taken when Prometheus scrapes."""

    def __init__(self, pool: Callable[[], str], snapshot: Callable[[], LiveFigures]) -> None:
        self.pool = pool
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live, pool = self.snapshot(), self.pool()
        depth = GaugeMetricFamily(
            "tangram_queue_depth", "Actions waiting for units", labels=["pool"]
        )
        depth.add_metric([pool], live.queue_depth)
        yield depth
        cap = GaugeMetricFamily(
            "tangram_units_capacity",
            f"Units a resource has, per node ({UNITS_HELP})",
            labels=["pool", "resource", "node"],
        )
        used = GaugeMetricFamily(
            "tangram_units_in_use",
            "Units held now: cores, GPUs and quota units by running actions and held leases; "
            f"memory by the environments of trajectories placed on the node, idle or not "
            f"({UNITS_HELP})",
            labels=["pool", "resource", "node"],
        )
        for u in live.units:
            if u.capacity is not None:
                cap.add_metric([pool, u.resource, u.node], u.capacity)
            used.add_metric([pool, u.resource, u.node], u.in_use)
        yield cap
        yield used
        instances = GaugeMetricFamily(
            "tangram_service_resident_instances",
            "RewardService instances resident in GPU memory (a DoP-k instance spans k GPUs)",
            labels=["pool", "service", "node"],
        )
        for (service, node), n in sorted(live.resident.items()):
            instances.add_metric([pool, service, node], n)
        yield instances
        memory = GaugeMetricFamily(
            "tangram_gpu_memory_resident_gb",
            "GPU memory held by resident service instances, per GPU",
            labels=["pool", "node", "gpu"],  # gpu: the device index on its node
        )
        for (node, device), gb in live.gpu_memory_gb.items():
            memory.add_metric([pool, node, str(device)], gb)
        yield memory
        yield from _prices(pool, live)
        agents = GaugeMetricFamily(
            "tangram_agents_connected", "Node agents connected", labels=["pool"]
        )
        agents.add_metric([pool], len(live.agents_seen_s))
        yield agents
        age = GaugeMetricFamily(
            "tangram_agent_heartbeat_age_seconds",
            "Since an agent was last heard",
            labels=["pool", "node"],
        )
        for name, seconds in live.agents_seen_s.items():
            age.add_metric([pool, name], seconds)
        yield age
        traj = GaugeMetricFamily(
            "tangram_trajectories",
            "Trajectories the pool holds now, by state (those closed are counted by "
            "tangram_trajectories_closed_total)",
            labels=["pool", "state"],
        )
        for state, n in sorted(live.trajectories.items()):
            traj.add_metric([pool, state], n)
        yield traj


def _prices(pool: str, live: LiveFigures) -> Iterator[GaugeMetricFamily]:
    """The core price per node and what it is made of (docs/scheduler.md, "The core price")."""
    labels = ["pool", "node"]
    price = GaugeMetricFamily(
        "tangram_core_price",
        "A node's core price: ACT-seconds of the others one held core-second costs "
        "(the load term plus the return term)",
        labels=labels,
    )
    returns = GaugeMetricFamily(
        "tangram_core_price_return",
        "The core price's return term: the thinking trajectories back before the node's "
        "queue drains, weighted by its offered load (corePrice arrivals)",
        labels=labels,
    )
    offered = GaugeMetricFamily(
        "tangram_offered_load",
        "The share of a node's cores its placed trajectories would hold at their actions' "
        "smallest sizes (0 until a think time is learned)",
        labels=labels,
    )
    thinking = GaugeMetricFamily(
        "tangram_thinking_trajectories",
        "Trajectories placed on a node with nothing queued or running (whatever the "
        "corePrice rule: only arrivals prices them)",
        labels=labels,
    )
    for node, p in sorted(live.core_prices.items()):
        price.add_metric([pool, node], p.total)
        returns.add_metric([pool, node], p.returns)
        offered.add_metric([pool, node], p.offered)
    for node, n in sorted(live.thinking.items()):
        thinking.add_metric([pool, node], n)
    think = GaugeMetricFamily(
        "tangram_think_seconds",
        "The learned mean think time: from an action's end to its trajectory's next "
        "submission (0: none yet)",
        labels=["pool"],
    )
    think.add_metric([pool], live.think_s)
    yield from (price, returns, offered, thinking, think)
