"""``tangram bench service``: the scheduler service under closed-loop load.

Three processes, as in a cluster: ``tangram serve`` (the scheduler), ``tangram agent
--runtime noop`` (a node agent whose commands end at once, on 1024 virtual cores, so an
action's whole time is the system's), and the load generator (this process, the real
``AsyncClient``, its execs on the action stream unless ``--transport http``). N
trajectories run a closed loop — think (exponential, mean ``think``), submit, wait for the
result — for a warm-up and then a measured window. A sweep over think times raises the
offered load until the service saturates.

Overhead is what a client sees beyond the command's run time: the transport, admission,
the scheduling round, the agent round trip, the answer. All processes share this machine;
with ``--placement dedicated`` (the default) the scheduler runs alone on one CPU and the
agent and the generator share the rest, as in a cluster whose scheduler pod asks for a
whole core (the kubelet's static CPU manager then gives it one of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from tangram.cli.files import InputError
from tangram.cli.progress import bar, note
from tangram.cli.up import run_loop
from tangram.client import AsyncClient
from tangram.service.auth import TokenStore
from tangram.service.embedded import quiet_gc

POOL = """\
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {name: bench}
spec:
  cpu: {idleCores: 1}
  admission: {maxQueued: 1000000}
---
apiVersion: tangram.dev/v1alpha1
kind: TrajectoryEnv
metadata: {name: bench}
spec:
  poolRef: bench
  image: none
  memoryGiB: 0.001
"""


async def _load(
    url: str,
    token: str,
    n: int,
    think_s: float,
    *,
    warmup_s: float,
    measure_s: float,
    generator_gc: bool = False,
    stream: bool = True,
) -> dict[str, Any]:
    overhead: list[float] = []
    server: list[float] = []  # queued + overhead, as the service reports it
    async with AsyncClient(url, token, retries=0, stream=stream) as client:
        sem = asyncio.Semaphore(64)

        async def open_one() -> str:
            async with sem:
                return (await client.open("bench")).id

        ids = await asyncio.gather(*(open_one() for _ in range(n)))
        quiet_gc()
        # The generator's own collections must not show up as service latency: its young
        # generation holds every trajectory's last result, timer and future (15-25k
        # objects), so each collection was a 6-20 ms pause landing on every action in
        # flight, every ~4.5 s. The client makes no cyclic garbage (a collection after
        # 40,000 actions finds none), so pausing the collector costs no memory.
        if not generator_gc:
            gc.disable()
        start = time.perf_counter()
        lo, hi = start + warmup_s, start + warmup_s + measure_s

        async def loop(i: int, tid: str) -> None:
            rng = random.Random(i)
            while True:
                if think_s > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                t0 = time.perf_counter()
                if t0 >= hi:
                    return
                r = await client.exec(tid, ["true"])
                t1 = time.perf_counter()
                if lo <= t0 and t1 <= hi:
                    overhead.append(t1 - t0 - r.timings.exec_s)
                    server.append(r.timings.queued_s + r.timings.overhead_s)

        try:
            await asyncio.gather(*(loop(i, t) for i, t in enumerate(ids)))
        finally:
            gc.enable()
        for chunk in range(0, n, 64):
            await asyncio.gather(*(client.close(t) for t in ids[chunk : chunk + 64]))
    ms, srv = np.asarray(overhead) * 1e3, np.asarray(server) * 1e3
    return {
        "trajectories": n,
        "think_s": think_s,
        "actions": len(overhead),
        "actions_per_s": len(overhead) / measure_s,
        "offered_per_s": n / think_s if think_s > 0 else None,
        "p50_overhead_ms": float(np.percentile(ms, 50)),
        "p99_overhead_ms": float(np.percentile(ms, 99)),
        "server_p50_ms": float(np.percentile(srv, 50)),
        "server_p99_ms": float(np.percentile(srv, 99)),
    }


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tangram.cli.main", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ready(url: str, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 60
    while True:
        for p in procs:
            if p.poll() is not None:
                err = p.stderr.read() if p.stderr else ""
                raise InputError(f"bench service: a process exited at start: {err[-500:]}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:  # loopback only
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise InputError("bench service: the service did not become ready in 60 s")
        time.sleep(0.1)


def cpu_placement(mode: str, allowed: set[int]) -> tuple[set[int], set[int]] | None:
    """The scheduler's CPUs and everyone else's, or None to let the OS place all three.

    Dedicated needs two CPUs at least: the lowest allowed one is the scheduler's.
    """
    if mode == "shared" or len(allowed) < 2:
        return None
    first = min(allowed)
    return {first}, allowed - {first}


def run_service_bench(args: argparse.Namespace) -> dict[str, Any]:
    thinks = [float(x) for x in str(args.sweep).split(",")] if args.sweep else [args.think]
    tmp = Path(tempfile.mkdtemp(prefix="tangram-bench-service-"))
    (tmp / "pool.yaml").write_text(POOL)
    from tangram.service.embedded import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp / "tokens")}
    allowed = os.sched_getaffinity(0)
    placement = cpu_placement(args.placement, allowed)
    if args.placement == "dedicated" and placement is None:
        note("bench service: one CPU only, so the three processes share it")
    # A child takes the CPU set of the thread that starts it: this thread moves to the
    # scheduler's CPU to start it, then to the others' for the agent and the generator.
    procs: list[subprocess.Popen[str]] = []
    try:
        if placement is not None:
            os.sched_setaffinity(0, placement[0])
        procs.append(_spawn(["serve", "-f", str(tmp / "pool.yaml"), "--port", str(port)], env))
        if placement is not None:
            os.sched_setaffinity(0, placement[1])
        _ready_file(tmp / "tokens", procs)
        procs.append(
            _spawn(
                [
                    "agent",
                    "--scheduler",
                    f"ws://127.0.0.1:{port}/v1/agents",
                    "--runtime",
                    "noop",
                    "--cores",
                    "1024",
                    "--node",
                    "bench",
                    "--state-dir",
                    str(tmp),
                ],
                env,
            )
        )
        _ready(url, procs)
        token = TokenStore.load(tmp / "tokens").token_for("local")  # what serve created
        assert token is not None
        cases = []
        with bar("service load", len(thinks), enabled=not args.json) as update:
            for i, think in enumerate(thinks):
                load = _load(
                    url,
                    token,
                    args.trajectories,
                    think,
                    warmup_s=args.warmup,
                    measure_s=args.duration,
                    generator_gc=args.generator_gc,
                    stream=args.transport == "stream",
                )
                cases.append(run_loop(load))
                update(i + 1, len(thinks))
    finally:
        os.sched_setaffinity(0, allowed)
        for p in reversed(procs):
            p.send_signal(signal.SIGINT)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    best = max(cases, key=lambda c: c["actions_per_s"])
    report = {
        **{
            k: best[k]
            for k in ("trajectories", "actions_per_s", "p50_overhead_ms", "p99_overhead_ms")
        },
        "think_s": best["think_s"],
        "cases": cases,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "generator_gc": args.generator_gc,
        "transport": args.transport,
        "placement": (
            {"mode": "shared", "cpus": sorted(allowed)}
            if placement is None
            else {
                "mode": "dedicated",
                "scheduler_cpus": sorted(placement[0]),
                "agent_and_generator_cpus": sorted(placement[1]),
            }
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
    }
    if not args.json:
        for c in cases:
            note(
                f"{c['trajectories']} trajectories, think {c['think_s']} s: "
                f"{c['actions_per_s']:.0f} actions/s, overhead p50 {c['p50_overhead_ms']:.2f} ms "
                f"p99 {c['p99_overhead_ms']:.2f} ms (scheduler's share p50 "
                f"{c['server_p50_ms']:.2f} p99 {c['server_p99_ms']:.2f})"
            )
    return report


def _ready_file(path: Path, procs: list[subprocess.Popen[str]]) -> None:
    """Wait for the scheduler to write the token file the agent needs."""
    deadline = time.monotonic() + 60
    while not path.exists():
        if procs[0].poll() is not None or time.monotonic() > deadline:
            err = procs[0].stderr.read() if procs[0].stderr and procs[0].poll() is not None else ""
            raise InputError(f"bench service: the scheduler did not start: {err[-500:]}")
        time.sleep(0.05)
