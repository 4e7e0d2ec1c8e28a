"""``tangram bench scheduler``: latency of one scheduling round (docs/architecture.md).

A case is (cores, queued, candidates, elastic). One node with ``cores`` cores;
running actions hold all but ``candidates`` cores, so exactly ``candidates``
queued actions fit at one core; ``queued`` actions wait, all of trajectories
already placed on the node (so the estimate sees the whole queue). Elastic cases
use actions with a 1-32 core range and a profile; non-elastic ones a single core.
After each timed round the started actions complete and equal ones are queued
again, so every round sees the same shape.

A quota case is (queued, rule): DeepSearch's two quotas (``search`` 128 at once,
``pdf_parse`` 16), every ``pdf_parse`` unit held by a running call, ``queued`` calls
waiting for one (each needs both quotas, as a fetch-and-parse step does), and
``QUOTA_BURST`` search calls submitted before each round that start in it and end before
the next. Under ``quota_waiting`` "pass" the new search calls are behind every waiter and
start in the round; under "hold" the first waiter holds them back.

A GPU case is (GPUs, queued): the 10-service mix's services (nine teachers and the
judge, batching up to 8 calls per instance) on ``GPUs / 8`` nodes, ``queued`` calls
waiting, Zipf over the services. Calls run for ``GPU_CALL_ROUNDS`` rounds, so the pool
stays full of resident, busy instances that new calls may join, and every restore ahead
ends in the round after it started: a round plans batching, DoP and restores ahead as the
service's rounds do under load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tangram.api.action import MAX_T1_S, ActionSpec
from tangram.api.cluster import ApiSpec, ClusterSpec, NodeSpec
from tangram.api.demand import AmdahlEfficiency, RangeDemand
from tangram.api.orderings import QuotaWaiting
from tangram.scheduler.core.scheduler import Scheduler, SchedulerConfig
from tangram.sim.tracegen import (
    GPUS_PER_NODE,
    PDF_API,
    PDF_CONCURRENCY,
    SEARCH_API,
    SEARCH_CONCURRENCY,
    scenario_cluster,
    service_call,
    zipf_weights,
)

DEFAULT_CASES: tuple[tuple[int, int, int, bool], ...] = tuple(
    (cores, queued, cands, elastic)
    for elastic in (False, True)
    for cores in (64, 256)
    for queued in (256, 2048, 10_000)
    for cands in (16, 64, 256)
    if cands <= cores and cands <= queued
)


@dataclass(frozen=True, slots=True)
class Case:
    cores: int
    queued: int
    candidates: int
    elastic: bool


def _spec(elastic: bool, rng: np.random.Generator) -> ActionSpec:
    t1 = float(rng.lognormal(np.log(60.0), 1.0))
    if elastic:
        return ActionSpec(
            kind="exec",
            type="bench.reward",
            cpu=RangeDemand(min=1, max=32),
            t1_s=t1,
            efficiency=AmdahlEfficiency(amdahl=float(rng.uniform(0.85, 0.98))),
        )
    return ActionSpec(kind="exec", type="bench.shell", t1_s=t1)


def measure(case: Case, rounds: int, depth: int = 2, seed: int = 0) -> list[float]:
    """Wall-clock seconds of ``rounds`` scheduling rounds of one case."""
    rng = np.random.default_rng(seed)
    cluster = ClusterSpec(nodes=[NodeSpec(name="n0", cpus=case.cores, memory_gb=1e6)])
    s = Scheduler(cluster, SchedulerConfig(depth=depth, learn=False))
    blockers = case.cores - case.candidates
    s.open_trajectory("blocker")
    s.place_trajectory("blocker", "n0")
    if blockers:
        hold = ActionSpec(kind="exec", cpu=blockers, t1_s=MAX_T1_S)  # holds its cores all along
        s.adopt("hold", "blocker", hold, units=blockers, started_at=0.0)
    serial = 0
    for i in range(case.queued):
        tid = f"t{i}"
        s.open_trajectory(tid)
        s.place_trajectory(tid, "n0")
        s.submit(f"a{serial}", tid, _spec(case.elastic, rng), 0.0)
        serial += 1
    out: list[float] = []
    now = 1.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        result = s.schedule(now)
        out.append(time.perf_counter() - t0)
        for asg in result.assignments:
            s.complete(asg.action_id, now)
            s.submit(f"a{serial}", asg.trajectory, _spec(case.elastic, rng), now)
            serial += 1
        now += 1.0
    return out


DEFAULT_QUOTA_CASES: tuple[tuple[int, QuotaWaiting], ...] = tuple(
    (queued, rule) for rule in ("hold", "pass") for queued in (2048, 10_000)
)
QUOTA_BURST = 16  # search calls submitted before each round


@dataclass(frozen=True, slots=True)
class QuotaCase:
    queued: int
    rule: QuotaWaiting


def measure_quota(case: QuotaCase, rounds: int, depth: int = 2) -> list[float]:
    """Wall-clock seconds of ``rounds`` scheduling rounds of one quota case."""
    apis = [
        ApiSpec(name=SEARCH_API, concurrency=SEARCH_CONCURRENCY),
        ApiSpec(name=PDF_API, concurrency=PDF_CONCURRENCY),
    ]
    cluster = ClusterSpec(nodes=[NodeSpec(name="n0", cpus=1, memory_gb=1.0)], apis=apis)
    s = Scheduler(cluster, SchedulerConfig(depth=depth, learn=False, quota_waiting=case.rule))
    search = ActionSpec(kind="api", type="bench.search", api=SEARCH_API, t1_s=1.0)
    both = ActionSpec(kind="api", type="bench.pdf", api=SEARCH_API, quotas={PDF_API: 1}, t1_s=4.0)
    forever = both.model_copy(update={"t1_s": MAX_T1_S})
    for i in range(PDF_CONCURRENCY):  # running calls that hold every pdf_parse unit
        s.open_trajectory(f"p{i}")
        s.adopt(f"parsing{i}", f"p{i}", forever, units=1, started_at=0.0)
    for i in range(case.queued):
        s.open_trajectory(f"w{i}")
        s.submit(f"w{i}", f"w{i}", both, 0.0)
    for i in range(QUOTA_BURST):
        s.open_trajectory(f"s{i}")
    out: list[float] = []
    now, serial = 1.0, 0
    for _ in range(rounds):
        for i in range(QUOTA_BURST):
            s.submit(f"s{serial}", f"s{i}", search, now)
            serial += 1
        t0 = time.perf_counter()
        result = s.schedule(now)
        out.append(time.perf_counter() - t0)
        for asg in result.assignments:
            s.complete(asg.action_id, now + 0.5)
        now += 1.0
    return out


DEFAULT_GPU_CASES: tuple[tuple[int, int], ...] = tuple(
    (gpus, queued) for gpus in (40, 160) for queued in (256, 2048)
)
GPU_CALL_ROUNDS = 3  # a call holds its instance for this many rounds (1 s apart)
GPU_WARMUP_ROUNDS = 20  # untimed: the pool fills, instances become resident


@dataclass(frozen=True, slots=True)
class GpuCase:
    gpus: int
    queued: int


def _call(services: list[str], weights: np.ndarray, rng: np.random.Generator) -> ActionSpec:
    service = services[int(rng.choice(len(services), p=weights))]
    steps = int(rng.integers(1, 40))  # of its trajectory: short and long contexts
    t_at_4 = float(rng.lognormal(np.log(1.0), 0.5))  # seconds at DoP 4
    return service_call(service, f"bench.{service}", t_at_4, 4, steps)


def measure_gpu(case: GpuCase, rounds: int, depth: int = 2, seed: int = 0) -> list[float]:
    """Wall-clock seconds of ``rounds`` scheduling rounds of one GPU case."""
    if case.gpus % GPUS_PER_NODE:
        raise ValueError(f"gpus: must be a multiple of {GPUS_PER_NODE}, got {case.gpus}")
    rng = np.random.default_rng(seed)
    cluster = scenario_cluster("mixed", cpu_nodes=0, gpu_nodes=case.gpus // GPUS_PER_NODE)
    services = [svc.name for svc in cluster.services]
    weights = zipf_weights(len(services))
    s = Scheduler(cluster, SchedulerConfig(depth=depth, learn=False))
    serial = 0

    def queue_one(now: float) -> None:
        nonlocal serial
        tid = f"t{serial}"
        s.open_trajectory(tid)
        s.submit(f"a{serial}", tid, _call(services, weights, rng), now)
        serial += 1

    for _ in range(case.queued):
        queue_one(0.0)
    started: list[list[str]] = []  # the call ids each round started, oldest first
    out: list[float] = []
    now = 1.0
    for i in range(GPU_WARMUP_ROUNDS + rounds):
        t0 = time.perf_counter()
        result = s.schedule(now)
        took = time.perf_counter() - t0
        if i >= GPU_WARMUP_ROUNDS:
            out.append(took)
        for ahead in result.ahead:
            s.ahead_done(ahead.service, ahead.chunk)
        started.append([asg.action_id for asg in result.assignments])
        if len(started) > GPU_CALL_ROUNDS:
            for action_id in started.pop(0):
                tid = s.complete(action_id, now).trajectory
                s.close_trajectory(tid)
                queue_one(now)
        now += 1.0
    return out
