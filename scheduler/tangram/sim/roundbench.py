"""``tangram bench scheduler``: latency of one scheduling round (docs/architecture.md).

A case is (cores, queued, candidates, elastic). One node with ``cores`` cores;
running actions hold all but ``candidates`` cores, so exactly ``candidates``
queued actions fit at one core; ``queued`` actions wait, all of trajectories
already placed on the node (so the estimate sees the whole queue). Elastic cases
use actions with a 1-32 core range and a profile; non-elastic ones a single core.
After each timed round the started actions complete and equal ones are queued
again, so every round sees the same shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tangram.api.action import MAX_T1_S, ActionSpec
from tangram.api.cluster import ClusterSpec, NodeSpec
from tangram.api.demand import AmdahlEfficiency, RangeDemand
from tangram.scheduler.core.scheduler import Scheduler, SchedulerConfig

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
