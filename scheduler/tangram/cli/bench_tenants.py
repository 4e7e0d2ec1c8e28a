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
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from tangram.api.wire import EnvSpec
from tangram.cli.files import InputError
from tangram.cli.progress import note
from tangram.client.aio import AsyncClient
from tangram.scheduler.core.scheduler import SchedulerConfig
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import EnvConfig, PoolConfig, TenantLimits
from tangram.service.embedded import Running, free_port, run

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


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _scenario(scenario: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    tokens = {secrets.token_urlsafe(24): t for t in (STEADY, FLOOD, AGENT_TENANT)}
    token = {t: k for k, t in tokens.items()}
    work.mkdir(parents=True)
    (work / "tokens").write_text("".join(f"{k} {t}\n" for k, t in tokens.items()))
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    port = free_port()
    store = TokenStore(tokens)
    server = asyncio.create_task(
        run(_config(scenario), store, None, stop, port=port, on_ready=ready.set_result)
    )
    running = await ready
    running.engine.all_agents_joined()  # a fresh pool: no trajectory to wait for
    agent = subprocess.Popen(
        [sys.executable, "-m", "tangram.cli.main", "agent", "--scheduler",
         f"ws://127.0.0.1:{port}/v1/agents", "--runtime", "process", "--cores",
         str(args.cores), "--node", "bench", "--state-dir", str(work / "agent")],
        env={**os.environ, "TANGRAM_TOKEN_FILE": str(work / "tokens")},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    sleep = ["sleep", str(args.action_s)]
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while "bench" not in running.engine.hub.links:
            if agent.poll() is not None:
                raise InputError(f"bench tenants: the node agent exited ({agent.returncode})")
            if asyncio.get_running_loop().time() > deadline:
                raise InputError("bench tenants: the node agent did not connect in 60 s")
            await asyncio.sleep(0.05)
        async with (
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
    finally:
        stop.set()
        await server
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
    return {
        "queued_p50_s": statistics.median(queued),
        "queued_p99_s": _percentile(queued, 0.99),
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
