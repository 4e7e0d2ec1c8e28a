"""``tangram bench tenants``: one tenant floods the pool, another submits steadily.

The real scheduler service, with a process-runtime node agent in a process of its own (as
in a cluster: its process starts would otherwise stall the scheduler's event loop): every
action is a real ``sleep`` on the pool's cores. The steady tenant runs one trajectory, an
action at a time with a short think between; the flooding tenant submits its whole
backlog at once. The figure is the steady tenant's queueing time (admission to start),
alone and beside the flood under each policy:

* ``fcfs``: one first-come-first-served order across tenants (``tenantFairness: false``);
* ``fair``: fair queuing between tenants, equal weights (the default);
* ``fair+share``: the same, with the flooding tenant held to half the cores
  (``spec.access.tenants[].maxShare: 0.5``), so a core is free for the other.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from tangram.api.wire import EnvSpec
from tangram.cli.bench_agent import bench_pool, nearest_rank
from tangram.cli.progress import note
from tangram.client.aio import AsyncClient
from tangram.scheduler.core.scheduler import SchedulerConfig
from tangram.service.config import EnvConfig, PoolConfig, TenantLimits

STEADY, FLOOD = "steady", "flood"
SCENARIOS = ("alone", "fcfs", "fair", "fair+share")


def _config(scenario: str) -> PoolConfig:
    env = EnvConfig(spec=EnvSpec(name="shell", image="unused-by-the-process-runtime",
                                 memory_gb=0.01))  # fmt: skip
    config = PoolConfig(name="tenants", envs={"shell": env}, idle_cores=1)
    if scenario == "fcfs":
        config = replace(config, scheduling=SchedulerConfig(tenant_fairness=False))
    if scenario == "fair+share":
        config = replace(config, tenants={FLOOD: TenantLimits(max_share=0.5)})
    return config


async def _scenario(scenario: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sleep = ["sleep", str(args.action_s)]
    pool = bench_pool(_config(scenario), work, (STEADY, FLOOD), runtime="process",
                      cores=args.cores, what="tenants")  # fmt: skip
    async with (
        pool as (running, token),
        AsyncClient(running.url, token[STEADY]) as steady,
        AsyncClient(running.url, token[FLOOD]) as flood,
    ):
        floods: list[asyncio.Task[Any]] = []
        if scenario != "alone":
            tids = [(await flood.open("shell")).id for _ in range(args.flood_trajectories)]
            per = args.flood_actions // len(tids)
            floods = [
                asyncio.create_task(flood.exec(tid, sleep)) for tid in tids for _ in range(per)
            ]
            await asyncio.sleep(args.action_s)  # the backlog is in before the first step
        tid = (await steady.open("shell")).id
        queued: list[float] = []
        for _ in range(args.steps):
            result = await steady.exec(tid, sleep)
            queued.append(result.timings.queued_s)
            await asyncio.sleep(args.think_s)
        for t in floods:
            t.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
    return {
        "queued_p50_s": statistics.median(queued),
        "queued_p99_s": nearest_rank(queued, 0.99),
        "queued_max_s": max(queued),
        "steps": len(queued),
    }


def run_tenants_bench(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workload": {
            "cores": args.cores,
            "action_s": args.action_s,
            "steady_steps": args.steps,
            "think_s": args.think_s,
            "flood_actions": args.flood_actions,
            "flood_trajectories": args.flood_trajectories,
        },
        "scenarios": {},
    }
    with tempfile.TemporaryDirectory(prefix="tangram-bench-tenants-") as tmp:
        for scenario in SCENARIOS:
            note(f"bench tenants: {scenario}")
            figures = asyncio.run(_scenario(scenario, args, Path(tmp) / scenario))
            out["scenarios"][scenario] = figures
    alone = out["scenarios"]["alone"]["queued_p99_s"]
    for figures in out["scenarios"].values():
        figures["p99_vs_alone"] = figures["queued_p99_s"] / alone if alone > 0 else None
    return out
